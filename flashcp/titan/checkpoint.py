"""DCP checkpoints that are published whole, verified on load, and never rewritten in place.

TorchTitan's CheckpointManager writes a step straight into `step-N/`: a save over an existing step
(after `checkpoint.load_step`) rewrote a complete checkpoint in place, so a kill mid-save left old
`.metadata` over truncated files, and nothing noticed bytes that changed after the save. Here:

- Save: every rank writes into `step-N.partial-<save id>/`, hashes the files it wrote (sizes and
  CRC-32, `flashcp.run.manifest`), rank 0 gathers the entries and writes `manifest.json`, then
  publishes the folder with a rename (`flashcp.run.publish`: a kill at any moment leaves a
  complete, loadable step N; a leftover `.replaced-` folder is removed once its step is published
  again).
- Load: the newest published checkpoint whose files match its manifest (each rank verifies a share
  of the files; the ranks agree on the verdict) and that DCP can read. A damaged or unreadable one
  is skipped with a warning naming the file and the cause, and the next older one is tried; one
  that does not fit the job (missing keys, other shapes) is an error, as is an explicit
  `checkpoint.load_step` that cannot be loaded. Checkpoints saved without a manifest (older
  FlashCP) load unverified, with a warning.
- Purge (`keep_latest_k`): the most recently published checkpoints are kept, after the final save
  too, and leftovers of interrupted saves are removed.

Asynchronous saving (`async_mode`) writes the partial folder in the background and publishes it
when TorchTitan next waits for it (the next save, or the final one): a checkpoint becomes loadable
one interval later than with synchronous saving, and never before it is complete.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint.api as dcp_api
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from flashcp.data.errors import DataError
from flashcp.run.manifest import MANIFEST, read_manifest, rank_entries, verify_files, write_manifest
from flashcp.run.publish import agreed_token, Candidate, complete_checkpoints, full_disk_named, LEFTOVER_DIR
from flashcp.run.publish import publish, root_cause, STEP_DIR

MISMATCH_HINTS = ("Missing key", "Unexpected key", "ize mismatch", "shape")


class CheckpointError(RuntimeError):
    """A checkpoint to resume from is missing, damaged or does not fit this job."""


class Unloadable(Exception):
    """One checkpoint cannot be loaded; `fits` False when it belongs to a different job."""

    def __init__(self, message: str, fits: bool = True):
        super().__init__(message)
        self.fits = fits


class Checkpointer(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        pass

    on_restore: Callable[[], None] | None = None  # called after a checkpoint of this run was loaded
    _loaded: bool | None = None  # what the run's one load returned
    _last_saved: int | None = None
    _pending: tuple[Path, Path, str] | None = None  # an asynchronous save in flight: (partial, target, id)

    def step_folder(self, step: int) -> Path:
        return Path(self._create_checkpoint_id(step))

    def saved_step(self, step: int) -> bool:
        """Whether this process's last save was of `step`."""
        return self._last_saved == step

    def save_now(self, step: int) -> None:
        """A full checkpoint of `step` whatever the interval (a stop between two saves)."""
        self.maybe_wait_for_saving()
        self.dcp_save(self._flattened_model_states_sd(), str(self.step_folder(step)), AsyncMode.DISABLED)
        self._purge_stale_checkpoints()

    def load(self, step: int = -1) -> bool:
        """Load once per run: the trainer loads before TorchTitan's loop to see what is left to train."""
        if self._loaded is None:
            self._loaded = super().load(step)
        return self._loaded

    # ------------------------------------------------------------------ save

    def _save_last_step(self, curr_step: int) -> None:
        """TorchTitan's final save skips the purge: `keep_latest_k` holds after the last step too."""
        super()._save_last_step(curr_step)
        self._purge_stale_checkpoints()

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any, **kwargs: Any) -> Any:
        """Write into a fresh folder, record what each rank wrote, publish by rename.

        An asynchronous save is published once it has completed, when TorchTitan waits for it
        (at the next save, which every rank reaches at the same step).
        """
        target = Path(checkpoint_id)
        save_id = agreed_token()
        partial = target.with_name(f"{target.name}.partial-{save_id}")
        with full_disk_named(partial):
            result = super().dcp_save(state_dict, str(partial), async_mode, **kwargs)
        if async_mode == AsyncMode.DISABLED:
            self._publish_save(partial, target, save_id)
        else:
            self._pending = (partial, target, save_id)
        return result

    def _wait_for_saving(self) -> None:
        with full_disk_named(self._pending[0] if self._pending else Path(self.folder)):
            super()._wait_for_saving()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._publish_save(*pending)

    def _publish_save(self, partial: Path, target: Path, save_id: str) -> None:
        entries = rank_entries(partial, dist.get_rank())
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entries)
        if dist.get_rank() == 0:
            write_manifest(partial, save_id, [e for part in gathered for e in part])
            replaced = publish(partial, target, save_id)
            if replaced is not None:
                self._remove(replaced)
        dist.barrier()
        self._last_saved = int(STEP_DIR.fullmatch(target.name).group(1))
        logger.info(f"checkpoint published: {target}")

    def _purge_stale_checkpoints(self) -> None:
        """Keep the `keep_latest_k` most recently published checkpoints; drop leftovers of interrupted saves."""
        if dist.get_rank() != 0 or not os.path.isdir(self.folder):
            return
        folder = Path(self.folder)
        for path in folder.iterdir():  # this save is published: any other partial one was interrupted
            match = LEFTOVER_DIR.fullmatch(path.name)
            if not match or (self._pending is not None and path == self._pending[0]):
                continue
            if match.group(2) == "partial" or (folder / f"step-{match.group(1)}").is_dir():
                self._remove(path)
        if self.keep_latest_k > 0:
            published = [c.path for c in complete_checkpoints(Path(self.folder)) if c.path.name == f"step-{c.step}"]
            published.sort(key=lambda p: (p / ".metadata").stat().st_mtime)
            for path in published[: -self.keep_latest_k]:
                self._remove(path)

    def _remove(self, path: Path) -> None:
        """Delete a folder on TorchTitan's purge thread (off the training loop) when there is one.

        A deletion cut short leaves a folder that fails verification and is skipped on load.
        """
        if self.purge_thread is not None and self.purge_thread.is_alive():
            self.purge_queue.put(str(path))
        else:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ load

    def _load(self, step: int = -1) -> bool:
        candidates = complete_checkpoints(Path(self.folder))
        if step != -1:
            chosen = [c for c in candidates if c.step == step]
            if not chosen:
                path = Path(self.folder) / f"step-{step}"
                state = "is incomplete (its save was interrupted)" if path.exists() else "does not exist"
                complete = sorted({c.step for c in candidates})
                raise CheckpointError(
                    f"checkpoint.load_step = {step}: {path} {state}; complete checkpoints: {complete or 'none'}"
                )
            candidates = chosen
        if not candidates:
            return self._initial_load()
        for partial in sorted(Path(self.folder).glob("step-*.partial-*")):
            logger.warning(f"ignoring {partial}: an interrupted save")
        for i, candidate in enumerate(candidates):
            try:
                self._load_candidate(candidate, model_only=candidate.step == 0)
            except Unloadable as e:
                if not e.fits or step != -1 or i == len(candidates) - 1:
                    tried = "" if i == 0 else " (newer ones were skipped as unloadable)"
                    raise CheckpointError(f"{e}{tried}") from e
                logger.warning(f"skipping {e}; trying the next older checkpoint")
                continue
            if self.on_restore is not None:
                self.on_restore()
            return True
        raise AssertionError("unreachable: the last candidate returns or raises")

    def _initial_load(self) -> bool:
        if not self.initial_load_path:
            logger.info("No checkpoint was provided, this is a fresh start.")
            return False
        path = Path(self.initial_load_path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.initial_load_path {path}: " +
                                  ("is not a folder" if path.exists() else "does not exist"))  # fmt: skip
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint.initial_load_path {path}: not a DCP checkpoint (no .metadata)")
        try:
            self._load_candidate(Candidate(-1, path, (path / MANIFEST).is_file()), self.initial_load_model_only)
        except Unloadable as e:
            raise CheckpointError(f"checkpoint.initial_load_path: {e}") from e
        return True

    def _load_candidate(self, candidate: Candidate, model_only: bool) -> None:
        """Verify (in parallel over ranks), then load; Unloadable says why not."""
        path = candidate.path
        if candidate.verified:
            problems = verify_files(path, read_manifest(path), dist.get_rank(), dist.get_world_size())
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, problems)
            problems = sorted(p for part in gathered for p in part)
            if problems:
                raise Unloadable(f"checkpoint {path} is damaged: {problems[0]}")
        else:
            logger.warning(f"checkpoint {path} has no {MANIFEST} (saved by an older FlashCP): loading it unverified")
        logger.info(f"Loading the checkpoint from {path}.")
        try:
            self.dcp_load(self._states_to_load(model_only), checkpoint_id=str(path), from_hf=False,
                          from_quantized=False)  # fmt: skip
        except DataError:
            raise
        except (Exception, dcp_api.CheckpointException) as e:  # the latter is a BaseException
            cause = root_cause(e)
            if any(hint in cause for hint in MISMATCH_HINTS):
                raise Unloadable(f"checkpoint {path} does not fit this job (different model or optimizer?): "
                                 f"{cause}", fits=False) from e  # fmt: skip
            raise Unloadable(f"checkpoint {path} cannot be read (damaged?): {cause}") from e


