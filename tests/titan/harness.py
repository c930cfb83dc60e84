"""Run the FlashCP trainer inside a test process: a tiny job, its losses, no torchrun.

    cfg = tiny_job(tmp_path, training={"steps": 4})
    losses = train(cfg)                      # {step: loss}, on this process's world
    losses = train(cfg, stop_after=2)        # as if the job were killed after step 2
    losses = train(cfg, grad_norms=norms)    # also fills norms: {step: gradient norm}
    losses = train(cfg, validations=results) # also fills results: [ValidationResult] of [validation]
    losses = train(cfg, expert_biases=biases)  # also fills biases: each MoE layer's routing bias at the end
    losses = train(cfg, expert_counts=counts)  # also fills counts: each step's expert token counts, as accumulated

In the pytest process `single_rank()` provides a world of one gloo rank; in a DistributedPool
worker the pool's process group is reused (TorchTitan skips its own init when one exists).

Two things a launched job does are left out of these in-process runs, each tested where it
matters: TorchTitan's rank 0 sleeps 2 s after the last step "for other ranks to complete" (here
every rank returns to the test, which waits for all of them), and the tiny job plans its windows
in the loader's thread (`[flashcp] plan_worker = false`): a worker process per rank and run costs
a Python start-up with torch, and test_plan_worker_train.py checks that the worker trains the
thread's losses bit for bit. The launched jobs (test_e2e.py, test_nodes.py, ...) keep both.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import flashcp.titan  # noqa: F401  (TorchTitan shims before TorchTitan is imported)
import torch
import torch.distributed as dist
import torchtitan.trainer

from flashcp.attention import record_comm
from flashcp.titan.config import check_layout, validate

TINY: dict[str, dict[str, Any]] = {
    "model": {"flavor": "custom", "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32},
    "data": {"prefetch": 0},
    "training": {"seq_len": 256, "steps": 4, "mixed_precision_param": "float32", "seed": 0},
    "optimizer": {"lr": 3e-3, "implementation": "foreach"},
    "lr_scheduler": {"warmup_steps": 1},
    "parallelism": {"data_parallel_shard_degree": 1},
    "flashcp": {"backend": "reference", "plan_worker": False},
    "metrics": {"log_freq": 1},
    "activation_checkpoint": {"mode": "none"},
}


class _NoFinalSleep:
    """`time` for torchtitan.trainer without the 2 s sleep after the last step (see above)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


torchtitan.trainer.time = _NoFinalSleep()


def tiny_job(dump: Path, replace: tuple[str, ...] = (), **sections: dict[str, Any] | None) -> dict:
    """The tiny job with `sections` merged over it (None drops a section; those named in `replace`
    replace the tiny job's, e.g. a named flavor's [model]), validated; output under `dump`."""
    raw = copy.deepcopy(TINY)
    raw["job"] = {"dump_folder": str(dump)}
    for name, values in sections.items():
        if values is None or name in replace:
            raw.pop(name, None)
        if values is not None:
            raw.setdefault(name, {}).update(values)
    return validate(raw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Environment of a one-rank torchrun job; tears down whatever process group a run left."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.enable()  # TorchTitan's trainer takes over garbage collection
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def float64() -> Iterator[None]:
    """Train in float64 (for exactness checks: two layouts then agree to summation order, ~1e-15).

    TorchTitan 0.3.0 reads every "float32" of the job through one map, `TORCH_DTYPE_MAP`: the model's
    build dtype (`[training] dtype`) and FSDP's mixed-precision policy (`mixed_precision_param` /
    `_reduce`); here it reads float64. Its cross-entropy loss takes the logits' `.float()`, which
    here is left out (the loss without TP, the tiny jobs')."""
    from torchtitan.components import loss
    from torchtitan.config import TORCH_DTYPE_MAP

    def cross_entropy(pred: torch.Tensor, labels: torch.Tensor, *, global_vocab_size: int | None = None) -> Any:
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1), reduction="sum",
                                                 ignore_index=loss.IGNORE_INDEX)  # fmt: skip

    saved = loss.cross_entropy_loss
    TORCH_DTYPE_MAP["float32"], loss.cross_entropy_loss = torch.float64, cross_entropy
    try:
        yield
    finally:
        TORCH_DTYPE_MAP["float32"], loss.cross_entropy_loss = torch.float32, saved


def tiny_seed_checkpoint(root: Path) -> dict[str, Any]:
    """Save the tiny job's initial weights under `root` on one rank; the `[checkpoint]` settings that
    start a job from them. Sharded initialisation on CPU depends on the layout, so jobs of different
    layouts compared with each other start from this."""
    with single_rank():
        train(tiny_job(root, checkpoint={"enable": True, "create_seed_checkpoint": True}), seed_checkpoint=True)
    return {"enable": True, "initial_load_path": str(root / "checkpoint/step-0")}


def train(
    cfg: dict,
    stop_after: int | None = None,
    seed_checkpoint: bool = False,
    grad_norms: dict[int, float] | None = None,
    validations: list[Any] | None = None,
    expert_biases: list[torch.Tensor] | None = None,
    expert_counts: list[torch.Tensor] | None = None,
    first_grads: dict[str, torch.Tensor] | None = None,
) -> dict[int, float]:
    """Train `cfg` on the current world; {step: loss} of the steps this run logged.

    `grad_norms`, when given, receives {step: total gradient norm before clipping}; `validations`
    the `flashcp.titan.components.validate.ValidationResult` of every validation, in order;
    `expert_biases` each MoE layer's aux-loss-free routing bias after the last step (it moves by
    the sign of every step's global expert counts, so it records the router's load statistics);
    `expert_counts` one [MoE layers, experts] tensor per step: this rank's `tokens_per_expert_E` as
    the forward passes (and any recompute) accumulated them, read just before TorchTitan's bias
    update sums them over the ranks and clears them; `first_grads` every parameter's whole gradient
    (a DTensor's gathered on every rank) before the first optimizer step, by parameter name. With
    pipeline parallelism, the MoE layers and parameters are those of the stages this rank holds.
    """
    from flashcp.titan.launch.job import trainer_config
    from flashcp.titan.trainer import FlashCPTrainer

    check_layout(cfg, int(os.environ["WORLD_SIZE"]), has_cuda=False)
    trainer = FlashCPTrainer(trainer_config(cfg))
    losses: dict[int, float] = {}
    log = trainer.metrics_processor.log

    def record(step: int, loss: float, max_loss: float, grad_norm: float, *args: Any, **kwargs: Any) -> None:
        losses[step] = loss
        if grad_norms is not None:
            grad_norms[step] = grad_norm
        log(step, loss, max_loss, grad_norm, *args, **kwargs)

    trainer.metrics_processor.log = record
    if validations is not None and trainer.config.validator.enable:
        log_validation = trainer.validator.log

        def record_validation(result: Any) -> None:
            validations.append(result)
            log_validation(result)

        trainer.validator.log = record_validation
    if expert_counts is not None:
        moes = [block.moe for part in trainer.model_parts for block in part.layers.values()  # every PP stage
                if getattr(block, "moe_enabled", False)]  # fmt: skip

        def record_counts(*args: Any) -> None:
            counts = [moe.tokens_per_expert_E for moe in moes]  # this rank's share (a DTensor's local part)
            expert_counts.append(torch.stack([c.to_local() if hasattr(c, "to_local") else c for c in counts]).clone())

        # Ahead of the bias update, which TorchTitan registered when it built the optimizer.
        handle = trainer.optimizers.register_step_pre_hook(record_counts)
        trainer.optimizers._optimizer_step_pre_hooks.move_to_end(handle.id, last=False)
    if first_grads is not None:
        named = [(name, p) for part in trainer.model_parts for name, p in part.named_parameters()]  # every PP stage

        def record_grads(*args: Any) -> None:
            if not first_grads:
                for name, p in named:
                    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    first_grads[name] = grad.detach().clone()

        trainer.optimizers.register_step_pre_hook(record_grads)
    if stop_after is not None:
        trainer.should_continue_training = lambda: trainer.step < stop_after
    try:
        if seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
        for block in (block for part in trainer.model_parts for block in part.layers.values()):
            if expert_biases is not None and getattr(block, "moe_enabled", False):
                bias = block.moe.expert_bias_E
                expert_biases.append((bias.full_tensor() if hasattr(bias, "full_tensor") else bias).detach().clone())
    finally:
        trainer.close()
    return losses


def train_on_pool_rank(
    rank: int, group: Any, cfg: dict, grad_norms: dict[int, float] | None = None,
    validations: list[Any] | None = None, stop_after: int | None = None,
    expert_biases: list[torch.Tensor] | None = None, expert_counts: list[torch.Tensor] | None = None,
    first_grads: dict[str, torch.Tensor] | None = None,
) -> dict[int, float]:
    """DistributedPool task: one rank of a multi-rank run of `cfg`."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(dist.get_world_size())})
    return train(cfg, stop_after=stop_after, grad_norms=grad_norms, validations=validations,
                 expert_biases=expert_biases, expert_counts=expert_counts, first_grads=first_grads)  # fmt: skip


def train_counting_exchanges(
    rank: int, group: Any, cfg: dict
) -> tuple[dict[int, float], dict[int, float], dict[str, int]]:
    """DistributedPool task: a rank's losses, gradient norms and KV collectives run per pass.

    The attention is one dispatcher op (`flashcp::cp_attention`), so the exchange code runs
    exactly when the op runs: under selective activation checkpointing the policy either reruns
    the whole op (its collective included) or returns its cached output, and `record_comm`
    counts the collectives that actually execute. The transpose ("backward") is issued by the
    gathered keys' backward; a checkpoint's recompute inside backward counts as "forward".
    """
    grad_norms: dict[int, float] = {}
    with record_comm() as log:
        losses = train_on_pool_rank(rank, group, cfg, grad_norms)
    return losses, grad_norms, dict(Counter(entry.pass_ for entry in log))


def load_export(folder: Path, dtype: torch.dtype = torch.float32) -> Any:
    """An exported HF folder as transformers loads it for a user: the model, after its
    generation_config.json loaded as a GenerationConfig and validated strictly (a value transformers
    would only warn about fails here). Every export the tests write is loaded through this."""
    import transformers

    generation = transformers.GenerationConfig.from_pretrained(folder)
    generation.validate(strict=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    assert model.generation_config.to_diff_dict() == generation.to_diff_dict()
    return model
