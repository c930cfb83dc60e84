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
  that does not fit the job (`flashcp.run.safe_load`: a model, optimizer or loader key missing, a
  checkpoint key unused, another shape) is an error, as is an explicit `checkpoint.load_step` that
  cannot be loaded. A folder without `.metadata` or without a manifest is damaged like one whose
  bytes changed (deleting a file must not switch verification off); only a checkpoint named
  explicitly (`load_step` / `initial_load_path`) with `checkpoint.load_unverified = true` loads
  without a manifest, e.g. one written by another tool. Nothing loaded can run code
  (`flashcp.run.safe_load`).
- Hugging Face import (`initial_load_path` + `initial_load_in_hf`): an HF folder has no manifest;
  its `config.json` and safetensors headers are checked against the model first
  (`flashcp.titan.hf.folder`: every tensor present with its shape, files whole, safetensors only),
  then TorchTitan's state_dict_adapter maps the weights in through DCP's HF reader, strictly.
- The manifest records the model (`model_record`: its HF config.json and the tokenizer), so that
  `python -m flashcp.titan.export` can turn a checkpoint into an HF folder without the job file.
  `last_save_in_hf` keeps the final checkpoint a full, resumable DCP checkpoint (TorchTitan would
  write safetensors into `step-N` instead, a folder no resume could load); the trainer exports it
  to `step-N-hf` beside it once the run has ended.
- Save: a state whose loss went non-finite since the last save, or saved after the data loader of
  any rank found its token store changed under the job (which it may find batches before the step
  that would read the change), is not published (`save_problem`): the run stops with that line.
- Rewind: an explicit `load_step` older than the newest checkpoint starts a new branch: the newer
  checkpoints are moved aside into `set-aside/after-step-N.<id>/` (never deleted), so retention and a
  later plain resume see only the new branch.
- Purge (`keep_latest_k`): the newest checkpoints of the branch are kept, after the final save too,
  and leftovers of interrupted saves are removed.

Asynchronous saving (`async_mode`) writes the partial folder in the background and publishes it
when TorchTitan next waits for it (the next save, or the final one): a checkpoint becomes loadable
one interval later than with synchronous saving, and never before it is complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.api as dcp_api
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager, MODEL
from torchtitan.tools.logging import logger

from flashcp.data.errors import DataError
from flashcp.run.manifest import MANIFEST, read_manifest, rank_entries, verify_files, write_manifest
from flashcp.run.publish import agreed_token, Candidate, error_in, full_disk_named, LEFTOVER_DIR
from flashcp.run.publish import publish, published_checkpoints, root_cause, STEP_DIR
from flashcp.run.safe_load import MismatchedCheckpoint, SafeReader, StrictPlanner, UnsafeCheckpoint
from flashcp.titan.hf.config import HFConfigError, read_hf_config
from flashcp.titan.hf.folder import check_weights, HFFolderError

SET_ASIDE = "set-aside"  # under the checkpoint folder: checkpoints of a branch left by a rewind


def hf_shapes(sd_adapter: Any, model_state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face key of the whole model with its shape, whatever this rank holds: the
    adapter maps the global shapes (as meta tensors), so every expert is named, not only this rank's."""
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in model_state.items()}
    return {k: tuple(v.shape) for k, v in sd_adapter.to_hf(meta).items()}


class CheckpointError(RuntimeError):
    """A checkpoint to resume from is missing, damaged or does not fit this job."""


class Unloadable(Exception):
    """One checkpoint cannot be loaded; `fits` False when it belongs to a different job."""

    def __init__(self, message: str, fits: bool = True):
        super().__init__(message)
        self.fits = fits


def _unloadable(e: BaseException, path: Path) -> Unloadable:
    """What a failed load of `path` was, in one line: refused (unsafe, does not fit) or unreadable."""
    for kind in (UnsafeCheckpoint, MismatchedCheckpoint):
        refused = error_in(e, kind)
        if refused is not None:
            return Unloadable(str(refused), fits=False)
    return Unloadable(f"checkpoint {path} cannot be read (damaged?): {root_cause(e)}")


class Checkpointer(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        load_unverified: bool = False
        """Let the checkpoint named by load_step / initial_load_path load without a manifest."""

        model_record: dict[str, Any] | None = None
        """What each manifest records about the model (flashcp.titan.hf.export.model_record)."""

        def __post_init__(self) -> None:
            """TorchTitan's checks, except that last_save_in_hf needs no model-only last save: the
            HF export is written beside the (full) final checkpoint, not instead of it."""
            in_hf, self.last_save_in_hf = self.last_save_in_hf, False
            try:
                CheckpointManager.Config.__post_init__(self)
            finally:
                self.last_save_in_hf = in_hf

    on_restore: Callable[[], None] | None = None  # called after a checkpoint of this run was loaded
    # Why the state must not be saved (every rank gets the same verdict): raised as its type, naming the step.
    save_problem: Callable[[], Exception | None] | None = None
    _loaded: bool | None = None  # what the run's one load returned
    _last_saved: int | None = None
    _pending: tuple[Path, Path, str] | None = None  # an asynchronous save in flight: (partial, target, id)

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.load_unverified = config.load_unverified
        self.model_record = config.model_record

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
        """TorchTitan's final save skips the purge: `keep_latest_k` holds after the last step too. It is
        a DCP save whatever `last_save_in_hf` says (the trainer exports it to HF afterwards)."""
        in_hf, self.last_save_in_hf = self.last_save_in_hf, False
        try:
            super()._save_last_step(curr_step)
        finally:
            self.last_save_in_hf = in_hf
        self._purge_stale_checkpoints()

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any, **kwargs: Any) -> Any:
        """Write into a fresh folder, record what each rank wrote, publish by rename.

        An asynchronous save is published once it has completed, when TorchTitan waits for it
        (at the next save, which every rank reaches at the same step).
        """
        target = Path(checkpoint_id)
        problem = self.save_problem() if self.save_problem is not None else None
        if problem is not None:
            raise type(problem)(f"not saving {target.name}: {problem}; the newest checkpoint is the last sound state")
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
            write_manifest(partial, save_id, [e for part in gathered for e in part], self.model_record)
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
        if self.keep_latest_k > 0:  # newer steps of an abandoned branch were set aside: the newest are the branch's
            published = [c.path for c in published_checkpoints(folder) if c.problem is None and c.path.name == f"step-{c.step}"]
            for path in published[self.keep_latest_k :]:
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
        candidates = published_checkpoints(Path(self.folder))
        if step != -1:
            chosen = [c for c in candidates if c.step == step]
            if not chosen:
                path = Path(self.folder) / f"step-{step}"
                state = "is incomplete (its save was interrupted)" if path.exists() else "does not exist"
                complete = sorted({c.step for c in candidates if c.problem is None})
                raise CheckpointError(
                    f"checkpoint.load_step = {step}: {path} {state}; complete checkpoints: {complete or 'none'}"
                )
            newer, candidates = [c for c in candidates if c.step > step], chosen
        if not candidates:
            return self._initial_load()
        for partial in sorted(Path(self.folder).glob("step-*.partial-*")):
            logger.warning(f"ignoring {partial}: an interrupted save")
        for i, candidate in enumerate(candidates):
            try:
                self._load_candidate(candidate, model_only=candidate.step == 0, named=step != -1)
            except Unloadable as e:
                if not e.fits or step != -1 or i == len(candidates) - 1:
                    tried = "" if i == 0 else " (newer ones were skipped as unloadable)"
                    raise CheckpointError(f"{e}{tried}") from e
                logger.warning(f"skipping {e}; trying the next older checkpoint")
                continue
            if step != -1 and newer:
                self._set_aside(step, newer)
            if self.on_restore is not None:
                self.on_restore()
            return True
        raise AssertionError("unreachable: the last candidate returns or raises")

    def _set_aside(self, step: int, newer: list[Candidate]) -> None:
        """A rewind starts a new branch: move the newer checkpoints out of its way, never delete them."""
        if dist.get_rank() == 0:
            aside = Path(self.folder) / SET_ASIDE / f"after-step-{step}.{uuid.uuid4().hex[:12]}"
            aside.mkdir(parents=True)
            for candidate in newer:
                os.rename(candidate.path, aside / candidate.path.name)
            names = ", ".join(c.path.name for c in sorted(newer, key=lambda c: c.step))
            logger.warning(f"checkpoint.load_step = {step} starts a new branch: the newer checkpoints ({names}) were "
                           f"moved to {aside} (not deleted); a plain resume continues from this branch")  # fmt: skip
        dist.barrier()

    def _initial_load(self) -> bool:
        if not self.initial_load_path:
            logger.info("No checkpoint was provided, this is a fresh start.")
            return False
        path = Path(self.initial_load_path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.initial_load_path {path}: " +
                                  ("is not a folder" if path.exists() else "does not exist"))  # fmt: skip
        if self.initial_load_in_hf:
            self._load_hf(path)
            return True
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"checkpoint.initial_load_path {path}: not a DCP checkpoint (no .metadata)")
        problem = None if (path / MANIFEST).is_file() else f"no {MANIFEST}, so its files cannot be verified"
        try:
            self._load_candidate(Candidate(-1, path, problem), self.initial_load_model_only, named=True)
        except Unloadable as e:
            raise CheckpointError(f"checkpoint.initial_load_path: {e}") from e
        return True

    def _load_candidate(self, candidate: Candidate, model_only: bool, named: bool) -> None:
        """Verify (in parallel over ranks), then load; Unloadable says why not.

        `named`: the user chose this checkpoint (load_step, initial_load_path), so
        `load_unverified` may let it load without a manifest.
        """
        path = candidate.path
        if candidate.problem is not None:
            manifest_only = (path / ".metadata").is_file()
            if not (named and manifest_only and self.load_unverified):
                hint = " (set checkpoint.load_unverified = true to load it anyway)" if named and manifest_only else ""
                raise Unloadable(f"checkpoint {path} is damaged: {candidate.problem}{hint}")
            logger.warning(f"checkpoint {path} has no {MANIFEST}: loading it unverified (checkpoint.load_unverified)")
        else:
            problems = verify_files(path, read_manifest(path), dist.get_rank(), dist.get_world_size())
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, problems)
            problems = sorted(p for part in gathered for p in part)
            if problems:
                raise Unloadable(f"checkpoint {path} is damaged: {problems[0]}")
        logger.info(f"Loading the checkpoint from {path}.")
        dropped = [k for k in self.states if k != MODEL] if model_only else list(self.exclude_from_loading)
        try:
            self.dcp_load(self._states_to_load(model_only), str(path), from_hf=False, from_quantized=False,
                          dropped=dropped)  # fmt: skip
        except DataError:
            raise
        except (Exception, dcp_api.CheckpointException) as e:  # the latter is a BaseException
            raise _unloadable(e, path) from e

    def _load_hf(self, path: Path) -> None:
        """The model's weights from a Hugging Face folder, checked before reading (flashcp.titan.hf.folder)."""
        if self.sd_adapter is None:
            raise CheckpointError("checkpoint.initial_load_in_hf: this model has no Hugging Face state_dict adapter")
        model_state = self.states[MODEL].state_dict()
        try:
            read_hf_config(path)
            whole = hf_shapes(self.sd_adapter, model_state)
            unread = check_weights(path, whole)
        except (HFConfigError, HFFolderError) as e:
            raise CheckpointError(f"checkpoint.initial_load_path: {e}") from e
        logger.info(f"Loading the Hugging Face model from {path} (safetensors headers checked against the "
                    "model; an HF folder has no manifest to verify its bytes)")  # fmt: skip
        try:
            self.dcp_load(model_state, str(path), from_hf=True, from_quantized=False, dropped=unread,
                          whole=whole.keys())  # fmt: skip
        except (Exception, dcp_api.CheckpointException) as e:
            raise CheckpointError(f"checkpoint.initial_load_path: {_unloadable(e, path)}") from e

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool,
                 dropped: list[str] | tuple[str, ...] = (), whole: Iterable[str] = ()) -> None:  # fmt: skip
        """TorchTitan's dcp_load, reading data only and refusing a checkpoint that does not fit whole
        (`dropped`: states left unloaded on purpose). HF safetensors go through the model's
        state_dict_adapter and DCP's HF reader, as in TorchTitan, with the same strict plan; the
        adapter names only this rank's experts, so the other keys of `whole` (every HF key of the
        model, checked against the folder beforehand) are other ranks' to load."""
        path = Path(checkpoint_id)
        if from_hf:
            if from_quantized:
                raise CheckpointError("checkpoint.initial_load_in_hf_quantized: quantized HF weights are not supported")
            hf_state = self.sd_adapter.to_hf(state_dict)
            elsewhere = set(whole) - hf_state.keys()
            dcp.load(hf_state, storage_reader=self.sd_adapter.get_hf_storage_reader(str(path)),
                     planner=StrictPlanner(path, dropped, elsewhere))  # fmt: skip
            self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state))
            return
        reader = SafeReader(path)
        try:
            # Each pipeline stage loads its own layers: keys another rank holds are its to load.
            dcp.load(state_dict, storage_reader=reader, planner=StrictPlanner(path, dropped, across_ranks=True))
        except BaseException as e:
            if reader.refused is not None:
                raise reader.refused from e
            raise
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
