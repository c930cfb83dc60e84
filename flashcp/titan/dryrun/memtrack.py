"""One rank's peak memory by category: torch's FSDP2 tracker plus FlashCP's and the loss's share.

torch's `FSDPMemTracker` (torch.distributed._tools; private API, checked on torch 2.13) follows
every tensor storage of an FSDP2 model through one step and classifies it as sharded / unsharded
parameter, gradient, optimizer state, buffer or activation; under fake tensors this costs no
memory. It cannot say which activations belong to FlashCP's attention or to the loss, the two
terms a long context makes large, so this subclass also labels the storages created while a
`region` is open and, at each new peak, sums the labelled ones still counted as activations.

It also leaves out DTensor's sharding propagation. For every DTensor op (FSDP2's parameters and
gradients are DTensors) torch runs the op once more on global-shape fake tensors to learn the
output's shape, under the active fake mode. On a GPU that costs nothing; here the active fake mode
is the dry run's own, so torch's tracker (which skips only a fake mode other than the one it was
entered under) counted those tensors as activations: gradient clipping's one foreach op over all
gradients then "allocated" an fp32 copy of the whole unsharded model (30 GiB for Llama 3 8B).

Under expert parallelism TorchTitan's FSDP gives a block two parameter groups, the experts' on
their own mesh (ep x efsdp), which torch's tracker refuses (it reads `FSDPState._fsdp_param_group`,
one group per module). While tracking, that property answers a `_Groups` view of all of a module's
groups (their parameters together; the first group's backward hooks), and the other groups'
backward hooks are wrapped here as the tracker wraps the first's, so the experts' parameters,
gradients, gathers and reduce-scatters are classified like the rest.

At each new peak it also keeps the largest live storages (`TOP` of them): the aten op that created
each (recorded by the dispatch below) and the innermost module then running, named at the end by
parameter, gradient or optimizer state where the storage is one (`peak_tensors`).

Storages created inside `host()` (the offloaded layer inputs, which on a GPU live in pinned host
memory) are not the GPU's: they are left out of the peak and their own peak is `peak_host`. So are,
with FSDP's CPU offload (`offloaded`: `[training] enable_cpu_offload`), the sharded parameters, their
gradients and the optimizer states, which FSDP2's `CPUOffloadPolicy` keeps on the host (the fake
tensors are all on "cpu" here, so they are told apart by the tracker's classification); the gathered
parameters and the unsharded gradients stay the GPU's. `peak_host_by_category` splits the host peak.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType as Ref
from torch.distributed.fsdp import FSDPModule
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils.weak import WeakIdKeyDictionary

from flashcp.titan.compat import extra_fsdp_param_groups, fsdp_one_group_property, mod_tracker_pre_hook_on_non_leaves

GROUPS = {
    "parameters": (Ref.SHARDED_PARAM, Ref.UNSHARDED_PARAM, Ref.ALL_GATHER),
    "gradients": (Ref.SHARDED_GRAD, Ref.UNSHARDED_GRAD, Ref.REDUCE_SCATTER),
    "optimizer_states": (Ref.OPT,),
    "model_buffers": (Ref.BUFFER,),
    "activations": (Ref.ACT, Ref.TEMP, Ref.INP),
}
_TRANSIENT = (Ref.ACT, Ref.TEMP)
CPU_OFFLOADED = {"parameters": Ref.SHARDED_PARAM, "gradients": Ref.SHARDED_GRAD, "optimizer_states": Ref.OPT}
TOP = 8  # the largest live storages kept at the peak


class CategoryTracker(FSDPMemTracker):
    """`FSDPMemTracker` whose peak also splits activations by the region that created them."""

    def __init__(self, mod: torch.nn.Module, optm: torch.optim.Optimizer | None = None,
                 offloaded: bool = False) -> None:  # fmt: skip
        super().__init__(mod, optm)
        self._on_host = tuple(CPU_OFFLOADED.values()) if offloaded else ()  # FSDP's CPU offload: host refs
        self._labels: list[str] = []
        self._labelled: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> label
        self._peak_labelled: dict[str, int] = {}
        self._propagating = 0  # > 0 inside DTensor's sharding propagation: nothing is allocated there
        self._propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        self._host_depth = 0  # > 0 inside `host()`
        self._host: WeakIdKeyDictionary = WeakIdKeyDictionary()  # host storage -> bytes
        self.peak_host = 0  # bytes
        self.peak_host_by_category: dict[str, int] = {}  # at the host's peak: layer_inputs and CPU_OFFLOADED's
        self._extra_groups: list[tuple[Any, Any, Any]] = []  # (group, its pre_backward, its post_backward)
        self._op = ""  # the aten op being dispatched
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> (op, module, shape, dtype, label)
        self._peak_top: list[tuple[int, Any, Any, tuple]] = []  # (bytes, reftype, storage weakref, _made's)
        # torch's module tracker kept leaf inputs alive to the step's end (see the shim)
        self._mod_tracker._fw_pre_hook = mod_tracker_pre_hook_on_non_leaves(self._mod_tracker)

    def __enter__(self) -> CategoryTracker:
        if self._depth == 0:
            ShardingPropagator._propagate_tensor_meta_non_cached = self._untracked_propagation()
            if _ONE_GROUP is not None:
                FSDPState._fsdp_param_group = _GROUPS_VIEW
        return super().__enter__()

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        if self._depth == 0:
            ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate
            if _ONE_GROUP is not None:
                FSDPState._fsdp_param_group = _ONE_GROUP

    def _instrument_fsdp_module(self) -> None:
        """torch's instrumentation (the first group of each module), then the other groups' backward hooks."""
        super()._instrument_fsdp_module()
        for module in self._root_mod.modules():
            if isinstance(module, FSDPModule):
                for group in extra_fsdp_param_groups(module._get_fsdp_state()):
                    self._extra_groups.append((group, group.pre_backward, group.post_backward))
                    group.pre_backward = self._fsdp_param_group_pre_backward(module, group.pre_backward)
                    group.post_backward = self._fsdp_param_group_post_backward(module, group.post_backward)

    def _deregister_module_and_optimizer_hooks(self) -> None:
        super()._deregister_module_and_optimizer_hooks()
        for group, pre_backward, post_backward in self._extra_groups:
            group.pre_backward, group.post_backward = pre_backward, post_backward
        self._extra_groups.clear()

    def _untracked_propagation(self) -> Callable[[ShardingPropagator, Any], Any]:
        """torch's propagation (a function of the propagator and the op's schema), its tensors untracked."""

        def propagate(propagator: ShardingPropagator, op_schema: Any) -> Any:
            self._propagating += 1
            try:
                return self._propagate(propagator, op_schema)
            finally:
                self._propagating -= 1

        return propagate

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Ops of DTensor's shape propagation run on the fake mode below, unseen (see the module doc)."""
        if self._propagating:
            return func(*args, **(kwargs or {}))
        outer, self._op = self._op, str(func.overloadpacket.__name__)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._op = outer

    def push(self, label: str) -> None:
        """Label the storages created from now until the matching `pop` (the innermost label wins)."""
        self._labels.append(label)

    def pop(self) -> None:
        self._labels.pop()

    @contextlib.contextmanager
    def region(self, label: str) -> Iterator[None]:
        self.push(label)
        try:
            yield
        finally:
            self.pop()

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """Storages created here are host memory: counted in `peak_host`, not in the GPU's peak."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    def _track(self, reftype, t: torch.Tensor) -> None:
        if self._host_depth:
            for st in get_untyped_storages(t):
                self._host[st] = st.nbytes()
            self._update_host_peak()
            return
        new = [st for st in get_untyped_storages(t) if st not in self._WINFO]
        super()._track(reftype, t)
        made = (self._op, self._module(), tuple(t.shape), str(t.dtype).removeprefix("torch."),
                self._labels[-1] if self._labels else "")
        for st in new:
            self._made[st] = made
            if self._labels:
                self._labelled[st] = self._labels[-1]

    def _module(self) -> str:
        """The innermost module running (the longest of ModTracker's parents), with its pass."""
        parents = [p for p in self._mod_tracker.parents if p != "Global"]
        if not parents:
            return ""
        inner = max(parents, key=len).partition(".")[2] or "model"  # ModTracker names the root by its class
        inner = inner.replace("_checkpoint_wrapped_module.", "")  # as the parameters' names read
        return inner + (" backward" if self._mod_tracker.is_bw else "")

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_pre_forward):
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_pre_forward)

        def pre_forward(*args, **kwargs):
            # Only the peak is used here, not per-module statistics: a module called again in one
            # forward (a chunked loss's lm_head, once per slice) is not a new iteration, which the
            # parent class would refuse.
            if not self._mod_tracker.is_bw:
                self.memory_tracking.pop(fsdp_mod, None)
            return inner(*args, **kwargs)

        return pre_forward

    def _update_host_peak(self) -> None:
        now = {"layer_inputs": sum(self._host.values())}
        for name, ref in CPU_OFFLOADED.items():
            if ref in self._on_host:
                now[name] = sum(snap.get(ref, 0) for snap in self._curr_mem_snap.values())
        if sum(now.values()) > self.peak_host or not self.peak_host_by_category:
            self.peak_host, self.peak_host_by_category = sum(now.values()), now

    def _update_peak_stats(self, peak_state) -> None:
        """torch's peak, less what is on the host (per-module peaks, unused here, are then not kept)."""
        before = dict(self._peak_mem)
        if self._on_host:
            for dev, snap in self._curr_mem_snap.items():
                on_gpu = snap[_TOTAL_KEY] - sum(snap.get(ref, 0) for ref in self._on_host)
                if self._peak_mem.get(dev, 0) < on_gpu:
                    self._peak_mem[dev], self._peak_mem_snap[dev] = on_gpu, dict(snap)
            self._update_host_peak()
        else:
            super()._update_peak_stats(peak_state)
        if self._peak_mem != before:
            self._peak_labelled = self._labelled_bytes()
            self._peak_top = self._largest()

    def _largest(self) -> list[tuple[int, Any, Any, tuple]]:
        """The `TOP` largest live storages now, each with what `_made` knows of it."""
        top = heapq.nlargest(TOP, self._WINFO.items(), key=lambda kv: kv[1][0].mem_consumed)
        return [(w.mem_consumed, w.reftype, w_st, self._made.get(st, ("", "", (), "", ""))) for st, (w, w_st) in top]

    def _names(self) -> dict[int, tuple[str, tuple, str]]:
        """id of a storage -> (its parameter, gradient or optimizer state name, local shape, dtype), of
        those alive now."""
        names: dict[int, tuple[str, tuple, str]] = {}

        def add(name: str, t: torch.Tensor) -> None:
            local = getattr(t, "_local_tensor", t)  # a DTensor's shard
            for st in get_untyped_storages(t):
                names[id(st)] = (name, tuple(local.shape), str(local.dtype).removeprefix("torch."))

        params = {}
        for fqn, p in self._root_mod.named_parameters():
            params[p] = fqn
            add(fqn, p)
            if p.grad is not None:
                add(f"{fqn}.grad", p.grad)
        if self._optm is not None:
            for p, state in self._optm.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        add(f"{params.get(p, '?')}.{key}", value)
        return names

    def peak_tensors(self) -> list[dict[str, Any]]:
        """The largest storages live at the peak: name (a parameter's, gradient's or optimizer state's
        where one still holds it, else the kind and the module that made it), shape, dtype, bytes, op."""
        names = self._names()
        out = []
        for nbytes, reftype, w_st, (op, module, shape, dtype, label) in self._peak_top:
            st = w_st()
            kind = str(getattr(reftype, "value", reftype)).lower()
            known = names.get(id(st)) if st is not None else None
            if known is not None:
                name, shape, dtype = known
            else:
                name = f"{kind} ({', '.join(x for x in (label, module) if x) or 'before the step'})"
            out.append({"name": name, "kind": kind, "shape": list(shape), "dtype": dtype, "bytes": nbytes, "op": op})
        return out

    def _labelled_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for st, label in self._labelled.items():
            winfo = self._WINFO.get(st, (None, None))[0]
            if winfo is not None and winfo.reftype in _TRANSIENT:
                out[label] = out.get(label, 0) + winfo.mem_consumed
        return out

    def peak_by_category(self) -> tuple[int, dict[str, int]]:
        """(peak bytes, bytes per category at that moment); labelled regions are their own categories."""
        if not self._peak_mem:
            return 0, {}
        device = max(self._peak_mem, key=self._peak_mem.get)
        snap = self._peak_mem_snap[device]
        out = {name: sum(snap.get(ref, 0) for ref in refs if ref not in self._on_host)
               for name, refs in GROUPS.items()}  # fmt: skip
        for label, size in self._peak_labelled.items():
            out[label] = size
            out["activations"] -= size
        return self._peak_mem[device], out


class _Groups:
    """All FSDP parameter groups of one module, as torch's tracker reads one: `fsdp_params` of them all,
    `pre_backward` / `post_backward` the first's (the others are wrapped by `CategoryTracker`)."""

    def __init__(self, groups: list) -> None:
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "fsdp_params", [p for g in groups for p in g.fsdp_params])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.groups[0], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.groups[0], name, value)


_ONE_GROUP = fsdp_one_group_property()  # torch 2.13's property: refuses a module with several groups
_GROUPS_VIEW = property(lambda state: (_Groups(state._fsdp_param_groups) if len(state._fsdp_param_groups) > 1
                                       else _ONE_GROUP.fget(state)))  # fmt: skip
