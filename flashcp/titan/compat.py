"""Every torch / TorchTitan version shim of the integration, in one place.

TorchTitan 0.3.0 targets CUDA and torch >= 2.14. FlashCP also trains on CPU (gloo) for development
and CI, and on GPU machines that ship an older torch. `prepare()` must run before any other
TorchTitan module is imported (the `flashcp.titan` package does it on import); each shim below
names the versions that need it, so it can be deleted when those versions are dropped.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import sys
import types
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_prepared = False


def prepare() -> None:
    """Apply all shims once; idempotent."""
    global _prepared
    if _prepared:
        return
    _add_set_timeout()
    _add_data_parallel_mesh_dims()
    _default_device_to_cpu()
    _flash_attention_impl_only_if_it_activates()
    _add_premade_microbatch_step()
    _prepared = True


def _add_set_timeout() -> None:
    # torch < 2.14 has no `torch.distributed.set_timeout`; TorchTitan 0.3.0 calls it after step 1.
    # `ProcessGroup.set_timeout` exists on 2.11..2.13 and does the same.
    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        pg.set_timeout(timeout)

    dist.set_timeout = set_timeout


def _add_data_parallel_mesh_dims() -> None:
    # torch 2.11 lacks `torch.distributed.fsdp.DataParallelMeshDims`, which
    # torchtitan/distributed/fsdp.py imports at module level. It is only used by the
    # "full_dtensor" / "spmd_types" backends, which FlashCP does not use on torch < 2.14.
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):

        class DataParallelMeshDims:
            """Placeholder for torch >= 2.12's FSDP mesh-dims descriptor (never constructed here)."""

            def __init__(self, *args, **kwargs) -> None:
                raise RuntimeError(
                    "DataParallelMeshDims needs torch >= 2.12; use "
                    "parallelism.spmd_backend = 'partial_dtensor'"
                )

        fsdp.DataParallelMeshDims = DataParallelMeshDims


def _default_device_to_cpu() -> None:
    # All TorchTitan versions: `torchtitan.tools.utils` sets `device_type = available or "cuda"`
    # at import time and many modules copy it when they are imported, so on a machine without
    # an accelerator everything would target torch.cuda. Point it at the CPU before anyone copies
    # it, with a device module that has the memory / naming calls the metrics use.
    if _available_accelerator():
        return
    copied = [m for m in ("torchtitan.trainer", "torchtitan.components.metrics") if m in sys.modules]
    if copied:
        raise RuntimeError(
            f"flashcp.titan must be imported before {copied[0]}: TorchTitan copies its device "
            "type at import time"
        )
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = _cpu_device_module()
    _cpu_offload_on_cpu()


def _cpu_offload_on_cpu() -> None:
    # All TorchTitan versions, without an accelerator: `[training] enable_cpu_offload` pins the host
    # shards (pinning needs an accelerator) and initialises "cpu:gloo" beside the device's backend,
    # here "cpu:gloo" too (torch refuses the duplicate). The shards are then plain host memory and the
    # one gloo backend serves both, so the job trains as it would on a GPU, for tests and development.
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.utils as tt_dist

    tt_fsdp.CPUOffloadPolicy = functools.partial(tt_fsdp.CPUOffloadPolicy, pin_memory=False)
    init = tt_dist.init_distributed
    tt_dist.init_distributed = lambda comm, enable_cpu_backend=False, **kwargs: init(comm, **kwargs)


def _flash_attention_impl_only_if_it_activates() -> None:
    # TorchTitan 0.3.0 (torch 2.11..2.13): `VarlenAttention` (model.attention = "varlen") activates
    # FA3 on sm90 and FA4 on sm100 whether or not their packages are there, and FA3's
    # (`flash_attn_interface`) exists only as a source build, so on an H100 the comparison path died
    # at model construction. The chooser now activates the implementation itself and reports it
    # only when torch accepted it; otherwise torch's built-in FlashAttention-2 runs varlen attention.
    import torchtitan.tools.utils as tt_utils

    wanted = tt_utils.get_cuda_flash_attention_impl

    def activated_impl() -> str | None:
        impl = wanted()
        return impl if impl is None or _activates(impl) else None

    tt_utils.get_cuda_flash_attention_impl = activated_impl


@functools.cache
def _activates(impl: str) -> bool:
    """Activate `impl` in torch's dispatcher as `VarlenAttention` would; whether torch accepted it.

    Activation is the exact test: FA3's module must import (a build for another torch does not)
    *and* register the `torch.ops.flash_attn_3` kernels torch dispatches to. Cached, so the layers
    after the first do not retry and a fallback is logged once."""
    from torch.nn.attention import activate_flash_attention_impl
    from torchtitan.tools.logging import logger

    try:
        activate_flash_attention_impl(impl)
    except Exception as e:  # ImportError, or RuntimeError for a module without the kernels
        logger.warning(f"{impl} cannot be activated ({type(e).__name__}: {e}); TorchTitan's varlen "
                       "attention uses torch's built-in FlashAttention-2")  # fmt: skip
        return False
    return True


# TorchTitan 0.3.0: torchtitan/models/qwen3_5/model.py imports flash-linear-attention's (`fla`, CUDA and
# triton only, not a FlashCP dependency) Gated DeltaNet kernels and causal convolution at module level.
# FlashCP runs those layers on its own ops (flashcp.titan.models.gated_deltanet), so without fla these
# names are stubs that raise if called. Delete once TorchTitan imports fla lazily.
_FLA_NAMES = {
    "fla.modules.conv.triton.ops": ("CausalConv1dFunction",),
    "fla.ops.gated_delta_rule": ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "fla.ops.gated_delta_rule.chunk": ("ChunkGatedDeltaRuleFunction",),
    "fla.ops.gated_delta_rule.fused_recurrent": ("FusedRecurrentFunction",),
}


def import_qwen3_5() -> types.ModuleType:
    """TorchTitan's `torchtitan.models.qwen3_5`, importable without fla (see `_FLA_NAMES`).

    The stub modules are in `sys.modules` only during that import: left there, they would make
    transformers' availability checks (`importlib.util.find_spec("fla")`) fail or believe fla is
    installed."""
    name = "torchtitan.models.qwen3_5"
    if name in sys.modules or importlib.util.find_spec("fla") is not None:
        # fla-core 0.6.0 warns at import on a machine without a GPU ("Triton is not supported on current
        # platform"); FlashCP runs its torch kernels there, so the warning would only clutter every run's
        # stderr (and its one-line errors). Delete with the fla pin once fla no longer warns.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
            return importlib.import_module(name)
    stubs: dict[str, types.ModuleType] = {}
    for module, names in _FLA_NAMES.items():
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            stubs.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        for attr in names:
            setattr(stubs[module], attr, _fla_stub(f"{module}.{attr}"))
    sys.modules.update(stubs)
    try:
        return importlib.import_module(name)
    finally:
        for stub in stubs:
            sys.modules.pop(stub, None)


def _fla_stub(name: str) -> Any:
    """A stand-in for fla's `name`: an autograd Function (TorchTitan registers those with spmd_types)
    or a function, either raising one line if run."""

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} was called, but flash-linear-attention is not installed: run Qwen3.5's "
                           "Gated DeltaNet layers as flashcp.titan.models.gated_deltanet's")  # fmt: skip

    if name.endswith("Function"):
        return type(name.rsplit(".", 1)[1], (torch.autograd.Function,),
                    {"forward": staticmethod(missing), "backward": staticmethod(missing)})  # fmt: skip
    return missing


@contextlib.contextmanager
def no_final_wait_alone() -> Iterator[None]:
    """While it is open, a world of one rank skips TorchTitan's end-of-training wait for the others."""
    # TorchTitan 0.3.0: `Trainer.train` ends with rank 0 sleeping 2 s "for other ranks to complete"
    # (the module's only sleep). With one rank there are none; every single-rank run paid 2 s.
    import torchtitan.trainer as titan_trainer

    if dist.is_initialized() and dist.get_world_size() > 1:
        yield
        return
    real = titan_trainer.time
    titan_trainer.time = types.SimpleNamespace(**{**vars(real), "sleep": lambda seconds: None})
    try:
        yield
    finally:
        titan_trainer.time = real


def _add_premade_microbatch_step() -> None:
    # torch 2.13: a pipeline schedule's `step` only splits a whole batch; TorchTitan 0.3.0's
    # `pp_forward_backward_step` hands it microbatches already split (`arg_mbs`, `kwarg_mbs`,
    # `target_mbs`, torch >= 2.14), each with its own kwargs (FlashCP's per-window CPStep). Those run
    # through the schedule's `_step_microbatches`, which takes exactly these lists on 2.13, after the
    # per-step resets `step` does first. Nothing is patched where `step` takes them already.
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    for cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        if "kwarg_mbs" in inspect.signature(cls.step).parameters:
            continue
        cls.step = _premade_microbatch_step(cls.step)


def _premade_microbatch_step(whole_batch_step: Any) -> Any:
    """`step` that also takes microbatches already split, as torch 2.14's does."""

    @functools.wraps(whole_batch_step)
    def step(self, *args: Any, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Any:  # fmt: skip
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return whole_batch_step(self, *args, losses=losses, return_outputs=return_outputs,
                                    loss_kwargs=loss_kwargs, **kwargs)  # fmt: skip
        if args or kwargs:
            raise TypeError("pipeline step: pass either a whole batch or arg_mbs / kwarg_mbs / target_mbs, not both")
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() computes gradients: not under torch.no_grad(); call eval() instead")
        stages = getattr(self, "_stages", None) or [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        last = [stage for stage in stages if stage.is_last]
        return self._merge_outputs(last[0].output_chunks) if last and return_outputs else None

    return step


def pipeline_problem() -> str | None:
    """Why this torch cannot run TorchTitan 0.3.0's pipeline schedules (None: it can): it builds stages
    with a `get_mesh` callback and steps schedules with loss keyword arguments, as torch 2.13 takes them
    (with `_add_premade_microbatch_step`) and 2.14 does itself; older releases are checked, not assumed."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if "get_mesh" not in inspect.signature(PipelineStage.__init__).parameters:
        return f"torch {torch.__version__}'s PipelineStage takes no get_mesh (torch 2.13 does)"
    if "loss_kwargs" not in inspect.signature(PipelineScheduleSingle._step_microbatches).parameters:
        return f"torch {torch.__version__}'s pipeline schedules pass no loss_kwargs (torch 2.13's do)"
    return None


def _available_accelerator() -> bool:
    return torch._utils._get_available_device_type() is not None


def _cpu_device_module() -> types.SimpleNamespace:
    """torch.cpu plus the calls TorchTitan's memory monitor makes, backed by the process RSS."""

    def memory_stats(device=None) -> dict[str, int]:
        peak = _rss_peak_bytes()
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    def get_device_properties(device=None) -> types.SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=total)

    calls = {name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")}
    # torch.cpu.current_device() returns the string "cpu"; the barrier TorchTitan issues after
    # step 1 passes it as a device id, which must be an int.
    calls["current_device"] = lambda: 0
    return types.SimpleNamespace(
        **calls,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=get_device_properties,
        memory_stats=memory_stats,
        reset_peak_memory_stats=_reset_rss_peak,
        empty_cache=lambda: None,
        memory=types.SimpleNamespace(),
    )


def _rss_peak_bytes() -> int:
    """Peak resident set size of this process (Linux VmHWM), or -1 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def _reset_rss_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0); harmless elsewhere.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def force_sum_reduction_on_gloo(model: torch.nn.Module) -> None:
    """FSDP2 on gloo: reduce with SUM instead of PREMUL_SUM, which gloo lacks (all torch versions).

    TorchTitan already sets the gradient divide factor to 1, so the numbers are identical.
    """
    if dist.get_backend() != "gloo":
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def default_spmd_backend() -> str:
    """TorchTitan 0.3.0's default `spmd_backend`, "spmd_types", needs torch >= 2.14 for meshes > 1."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return "spmd_types" if (major, minor) >= (2, 14) else "partial_dtensor"


def extra_fsdp_param_groups(state: Any) -> list:
    """An FSDP state's parameter groups after its first (a module sharded on two meshes, e.g. MoE
    experts under EP). torch 2.13 keeps them in `_fsdp_param_groups`; torch 2.11 has one group per
    module (the instance attribute `_fsdp_param_group`), so none."""
    return list(getattr(state, "_fsdp_param_groups", [])[1:])


def fsdp_one_group_property() -> property | None:
    """torch 2.13's `FSDPState._fsdp_param_group` property (it refuses a module with several groups),
    which the dry run's memory tracker swaps for a view of all groups; None on torch 2.11, where it
    is a plain instance attribute and a module has only one group."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    found = FSDPState.__dict__.get("_fsdp_param_group")
    return found if isinstance(found, property) else None


def mod_tracker_pre_hook_on_non_leaves(tracker: Any) -> Any:
    """torch 2.13's `ModTracker._fw_pre_hook` (torch.distributed._tools.mod_tracker, private; the dry
    run's memory tracker runs one) with its backward hook registered on the non-leaf inputs only.

    torch's registers `register_multi_grad_hook` on every input requiring grad; for a leaf its closure
    holds the leaf's AccumulateGrad node, which holds the leaf, from a hook stored on the leaf: a cycle
    through C++ that gc does not free, so each leaf input lived to the step's end. A chunked loss feeds
    its lm_head detached slices of the final norm's output, so that whole output (a rank's tokens x dim)
    stayed alive through the backward: the dry run counted it in every later peak (1 GiB at 1M tokens
    on 8 ranks, 4 GiB at 4M), where training frees it once the loss returns. A module whose inputs are
    all leaves leaves its backward when the backward ends, as torch's does without grad inputs."""
    import weakref

    from torch.autograd.graph import register_multi_grad_hook
    from torch.utils._pytree import tree_flatten

    def pre_hook(mod: torch.nn.Module, inputs: Any) -> None:
        if torch._dynamo.eval_frame._is_in_optimized_module():
            return
        name, w_mod = tracker._get_mod_name(mod), weakref.ref(mod)
        tracker._get_append_fn(w_mod, name, False)()
        if tracker._user_pre_fw_hook is not None:
            tracker._user_pre_fw_hook(mod, inputs)
        args, _ = tree_flatten(inputs)
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is not None]
        if not tracker.is_bw:
            if tensors:
                register_multi_grad_hook(tensors, tracker._get_pop_fn(w_mod, name, True))
            else:
                tracker._post_bw_callbacks_to_enqueue.append(tracker._get_pop_fn(w_mod, name, True))

    return pre_hook
