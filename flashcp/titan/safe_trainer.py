"""TorchTitan's Trainer with run safety around its loop: what a run needs to stop, save and resume soundly.

- On SIGTERM / SIGINT the ranks agree to stop at the next step boundary and save a checkpoint there
  (`flashcp.run.preemption`): every rank stops after the same step.
- A state whose loss was not finite (inf / NaN) at some step since the last save, or whose data any
  rank's loader found changed, is never saved (`_save_problem`, the checkpointer's `save_problem`).
- A run restored past `training.steps` is a job error; one restored at it says it is complete,
  instead of silently training nothing.
- After a restore, the learning rate applied is the config's schedule at the restored step (the
  saved optimizer's rate was the old schedule's).
- With `checkpoint.last_save_in_hf`, rank 0 exports the final checkpoint as a Hugging Face folder at the end.

It expects FlashCP's components in TorchTitan's slots (`flashcp.titan.trainer.FlashCPTrainer`'s
config): the checkpointer (`on_restore`, `save_problem`, `save_now`), the metrics (`resume_from`)
and the window loader, whose `dataloader.loader.fault` says why its data changed. A subclass's own
setup goes in `_setup(config)`, which ends with `_connect_run_safety()`.
"""

from __future__ import annotations

import math
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from flashcp.data.errors import DataChanged
from flashcp.titan import compat
from flashcp.titan.components.checkpoint import CheckpointError
from flashcp.titan.hf.export import export, ExportError
from flashcp.run.preemption import StopRequest


class SafeTrainer(Trainer):
    def __init__(self, config: Trainer.Config) -> None:
        # Signals are caught from here on: one during building or loading stops at the first step boundary.
        self.stop_request = StopRequest()
        self._restored_step: int | None = None
        self._losses_finite: torch.Tensor | None = None  # every loss since the last save finite (on the device)
        try:
            super().__init__(config)
            self._setup(config)
        except BaseException:
            self.stop_request.close()
            raise

    def _setup(self, config: Trainer.Config) -> None:
        """A subclass's setup after TorchTitan's (a failure closes the stop request); it ends with
        `_connect_run_safety()`, which is all this one does."""
        self._connect_run_safety()

    def _connect_run_safety(self) -> None:
        """Catch the stop signals' agreement, and hook the restore checks, the save verdict and the
        schedule's restore into the checkpointer and lr schedulers."""
        self.stop_request.connect()
        self.checkpointer.on_restore = self._after_restore
        self.checkpointer.save_problem = self._save_problem
        self._load_schedule = self.lr_schedulers.load_state_dict
        self.lr_schedulers.load_state_dict = self._load_schedule_before_the_end

    def _load_schedule_before_the_end(self, state: dict[str, Any]) -> None:
        """Restore the lr scheduler's step unless it is past `training.steps` (refused in _after_restore).

        Past the end TorchTitan's schedule cannot be evaluated (with no decay steps it asserts),
        which the checkpoint loader would report as a damaged checkpoint.
        """
        if state["last_epoch"] <= self.config.training.steps:
            self._load_schedule(state)

    def _after_restore(self) -> None:
        """Called once a checkpoint has been loaded (self.step is its step).

        Restored past `training.steps` is a job error (CheckpointError: train.py exits 2 with one
        line): the config asks for fewer steps than were trained, most likely a mistake. Restored
        exactly at `training.steps` is a finished run started again (a scheduler's retry, a
        rerun of the same command): it says the run is complete and ends successfully.

        The learning rate the restored optimizer holds is the old schedule's; TorchTitan's
        scheduler recomputes the config's, which is the one logged, so it is applied here too.
        """
        steps = self.config.training.steps
        self._restored_step = self.step
        if self.step > steps:
            raise CheckpointError(
                f"the checkpoint restored is at step {self.step}, past [training] steps = {steps}: nothing to "
                "train; raise training.steps to continue this run (or pick checkpoint.load_step)"
            )
        changed = []
        for scheduler in self.lr_schedulers:
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                if not math.isclose(group["lr"], lr, rel_tol=1e-6, abs_tol=1e-15):
                    changed.append((group["lr"], lr))
                group["lr"] = lr
        if changed:
            saved, config = changed[0]
            logger.warning(
                f"lr schedule differs from the checkpoint's (saved lr {saved:.3e} for step {self.step + 1}, the "
                f"config gives {config:.3e}): following the config from step {self.step + 1}"
            )
        self.metrics_processor.resume_from(self.step)

    def train(self) -> None:
        """TorchTitan's loop, unless the checkpoint restored is already at `training.steps`: a finished
        run started again (a scheduler's retry, the same command rerun) says so once and ends."""
        self.checkpointer.load(step=self.config.checkpoint.load_step)
        steps = self.config.training.steps
        complete = self.step >= steps
        if not complete:
            with compat.no_final_wait_alone():
                super().train()
        self._export_hf()
        if complete and torch.distributed.get_rank() == 0:
            folder = Path(self.checkpointer.folder).resolve()
            print(f"flashcp: the run is already complete: the checkpoint at step {self.step} reached [training] "
                  f"steps = {steps}; nothing to train. To extend it, raise training.steps; to start afresh, "
                  f"choose another job.dump_folder (or move {folder} away)", flush=True)  # fmt: skip

    def _export_hf(self) -> None:
        """With `checkpoint.last_save_in_hf`, rank 0 exports the final checkpoint to `step-N-hf` beside it
        (`flashcp.titan.hf.export`) once training is over, so the other ranks wait in no collective
        meanwhile; a run started again after a crashed export exports then."""
        ckpt, steps = self.checkpointer, self.config.training.steps
        if not (ckpt.enable and self.config.checkpoint.last_save_in_hf and self.step == steps):
            return
        source = ckpt.step_folder(steps)
        target = source.with_name(f"{source.name}-hf")
        if torch.distributed.get_rank() != 0 or target.exists() or not source.is_dir():
            return
        # A crashed export's temporary folder (this run holds the checkpoint folder).
        for leftover in target.parent.glob(f".{target.name}.partial-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            export(source, target, dtype=self.config.checkpoint.export_dtype)
        except ExportError as e:
            raise CheckpointError(f"checkpoint.last_save_in_hf: {e}") from e
        logger.info(f"Hugging Face export of step {steps} written to {target}")

    def should_continue_training(self) -> bool:
        """TorchTitan's test, plus a stop agreed by all ranks after a SIGTERM / SIGINT."""
        if not super().should_continue_training():
            return False
        signum = self.stop_request.agreed()
        if signum:
            self._stop(signal.Signals(signum).name)
        return not signum

    def _stop(self, cause: str) -> None:
        """Save at this step boundary (unless that checkpoint exists) and say where, on rank 0."""
        ckpt = self.checkpointer
        if self.step == 0:
            where = "nothing trained, nothing saved"
        elif not ckpt.enable:
            where = "checkpoints are disabled, nothing saved"
        else:
            if not ckpt.saved_step(self.step) and self.step != self._restored_step:
                ckpt.save_now(self.step)
            where = f"checkpoint saved to {ckpt.step_folder(self.step).resolve()}"
        if torch.distributed.get_rank() == 0:
            logger.info(f"{cause}: every rank stops after step {self.step}")
            print(f"flashcp: preempted at step {self.step}: {where}", flush=True)

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        """TorchTitan's step, noting on the device (no sync) whether every loss since the last save was finite.

        TorchTitan checks the loss only on logging steps: a state that went to inf / NaN between two
        would otherwise be saved, published and resumed from.
        """
        loss = super().forward_backward_step(**kwargs)
        # With TP the chunked loss (ChunkedLossWrapper) is a replicated DTensor; its local value, as
        # TorchTitan's own loss reduction takes it, since the flag is all-reduced as a plain tensor.
        local = loss.detach().to_local() if isinstance(loss, DTensor) else loss.detach()
        finite = torch.isfinite(local)
        self._losses_finite = finite if self._losses_finite is None else self._losses_finite & finite
        return loss

    def _save_problem(self) -> Exception | None:
        """Why this state must not be saved, the same verdict on every rank (a collective: all ranks save):
        a loss that was not finite since the last save, or data that any rank's loader found changed."""
        flag = self._losses_finite
        finite = torch.ones((), device=self.device) if flag is None else flag.to(self.device, torch.float32)
        fault = self.dataloader.loader.fault
        sound = torch.stack([finite.reshape(()), torch.tensor(float(fault is None), device=self.device)])
        torch.distributed.all_reduce(sound, op=torch.distributed.ReduceOp.MIN)
        self._losses_finite = None
        finite_everywhere, data_unchanged = sound.tolist()
        if not data_unchanged:
            faults: list[str | None] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(faults, None if fault is None else str(fault))
            return DataChanged(next(f for f in faults if f is not None))
        if not finite_everywhere:
            return CheckpointError(f"the loss was not finite (inf or NaN) at some step up to {self.step}")
        return None

    def close(self) -> None:
        if hasattr(self, "stop_request"):
            self.stop_request.close()
        super().close()  # the checkpointer's purge thread finishes its deletions
