"""`cp_varlen_attention` as a registered torch op: a compiled block traces it as one node.

    key = step_key(dispatch, group)              # once per window, outside compiled code
    out = cp_attention(q, k, v, key, backend, overlap=..., softmax_scale=..., sinks=...)

The op's work changes with every window: index tensors and Python ints (lengths, splits, the buffer
sizes) of the step's `Dispatch`, a process group, collectives. None of it may reach the compiler,
or every step would fail a guard and recompile, and a data-dependent shape would break the graph.
So `flashcp::cp_attention` takes q, k, v, the optional learned sinks, static settings (backend,
overlap, scale) and `key`, a 0-d int64 CPU tensor naming the step's `(dispatch, group)` in a
registry here: the compiler sees only a tensor input of fixed shape, whose value it never reads,
and the op's fake implementation returns a tensor shaped like q. The registration lives exactly as
long as the key tensor (a finalizer drops it), so a compiled backward that recomputes the op under
activation checkpointing still finds the step while anything holds the key, and nothing outlives
it. A sliding window comes with the dispatch (`dispatch.window`); sinks are an input like q, k, v,
and their gradient is this rank's share, which the trainer's FSDP over dp_shard x cp sums over the
CP group as for every replicated parameter.

Autograd without a second exchange or a recompute: when gradients are needed the forward runs
`cp_varlen_attention` eagerly under autograd inside the op (the KV exchange, the kernel and what
they save, exactly as in eager), keeps that graph in a second registry and returns its output and a
`handle` tensor naming it; the registered backward calls `flashcp::cp_attention_backward`, which
runs `torch.autograd.grad` on the kept graph (the kernel backward and the transposed collective)
for q, k, v and the sinks, and drops it. The graph is entered through gradient edges of a node that
saves nothing, so it holds no extra copy of k and v. The kept graph, like the handle, dies with the
handle tensor: under activation checkpointing (eager or compiled) the forward's handle is not
saved, so its graph is freed at once and the recompute builds the one the backward uses; under
`no_grad` (validation) no graph is built. Neither op reads device data on the host.

A compiled graph owns the buffers it passes to and gets from an op: once the op returns, a buffer
the graph no longer reads is free for reuse (inductor's memory planning writes a later kernel's
output into it). The kept graph reads q, k, v and the sinks (what the kernel saved) and may read
the output (flash-attention saves it) in the backward, so in compiled code (`compiled`, fixed at
trace time) the op enters the graph with its own copies of its inputs and returns a copy of its
output: without them, inductor wrote the output projection into a block's rotated q (heads x
head_dim = dim) and the backward used the overwritten values.
Eager code needs no copy: autograd's version counters reject a later in-place write.

`launch_exchange_ahead(k, v, key)` starts a call's KV exchange before the call (eager code: head
groups launch group g + 1's while g computes) and returns a handle tensor naming it in a third
registry; `cp_attention(..., exchange=handle)` consumes it inside the op (its kept graph then holds
the gather from that buffer, so the gradients are the op's own). A handle that is never consumed
releases its exchange when it dies.

`flashcp::cp_latent_attention` (`latent_attention(q, latent, k_pe, wkv_b, key, ...)`) is MLA's
latent exchange (`flashcp.attention.latent.cp_latent_attention`) on the same machinery: the same
step keys, the same kept graph (`_run_kept`, `_kept_grads`) and copies; its backward op returns dq,
dlatent, dk_pe and this rank's share of dwkv_b.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._C import DispatchKey
from torch.autograd.graph import get_gradient_edge

from flashcp.attention.collectives import KVExchange, launch_kv_exchange
from flashcp.attention.cp import cp_varlen_attention
from flashcp.attention.latent import cp_latent_attention
from flashcp.dispatch import Dispatch

_steps: dict[int, tuple[Dispatch, Any]] = {}  # key value -> (dispatch, group), while the key tensor lives
_graphs: dict[int, tuple[torch.Tensor, list]] = {}  # handle value -> (output, gradient edges of q, k, v[, sinks])
_exchanges: dict[int, KVExchange] = {}  # handle value -> a KV exchange launched ahead, until an op consumes it
_ids = itertools.count()
_AUTOGRAD_KEYS = (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther, DispatchKey.AutogradNestedTensor)


def _register(table: dict[int, Any], value: Any) -> torch.Tensor:
    """A fresh 0-d int64 CPU tensor naming `value` in `table` for as long as the tensor lives."""
    n = next(_ids)
    table[n] = value
    tensor = torch.tensor(n, dtype=torch.int64)
    weakref.finalize(tensor, table.pop, n, None)
    return tensor


def step_key(dispatch: Dispatch, group: Any = None) -> torch.Tensor:
    """The key under which `cp_attention` finds this step's dispatch and CP group (None when
    `cp_size == 1`, or any `Collectives`); keep it while the step's forward and backward run."""
    return _register(_steps, (dispatch, group))


def live_entries() -> tuple[int, int, int]:
    """Registered steps, kept forward graphs and exchanges launched ahead (tests check that nothing
    accumulates)."""
    return len(_steps), len(_graphs), len(_exchanges)


@contextmanager
def _autograd_inside_op() -> Iterator[None]:
    """Autograd recording inside an op's implementation.

    The dispatcher runs a custom op's implementation with the autograd keys excluded
    (`_AutoDispatchBelowAutograd`), so `enable_grad` alone records nothing there; this re-admits
    them for the block, as torch's own `torch._dynamo.decorators.leaf_function` does around the
    eager code it runs (torch/_higher_order_ops/invoke_leaf_function.py)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


class _Enter(torch.autograd.Function):
    """Aliases of the op's tensor inputs (copies when `copy`) that start an autograd graph; its node
    saves nothing (see the docstring)."""

    @staticmethod
    def forward(ctx, seed, copy, *tensors):
        return tuple(t.clone() if copy else t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(None for _ in grads))


def _step(key: torch.Tensor, op: str) -> tuple[Dispatch, Any]:
    """The (dispatch, group) a step key names."""
    n = int(key)
    if n not in _steps:
        raise RuntimeError(
            f"{op}: the step key was released before the op ran (keep the CPStep / step_key "
            "alive until the step's backward has run)"
        )
    return _steps[n]


def _run_kept(run, tensors: tuple[torch.Tensor, ...], record: bool, compiled: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """An op's forward: `run(*tensors)`, and when `record` its autograd graph kept under the
    returned handle for `_kept_grads` (a handle of -1 otherwise); copies in and out when
    `compiled` (see the docstring). Shared by every op of this file."""
    if not record:
        with torch.no_grad():
            return run(*tensors).contiguous(), torch.tensor(-1, dtype=torch.int64)
    with _autograd_inside_op():
        seed = tensors[0].new_zeros((), requires_grad=True)
        inputs = _Enter.apply(seed, compiled, *tensors)
        out = run(*inputs)
    handle = _register(_graphs, (out, [get_gradient_edge(t) for t in inputs]))
    out = out.detach()
    return (out.clone(memory_format=torch.contiguous_format) if compiled else out.contiguous()), handle


def _kept_grads(grad: torch.Tensor, handle: torch.Tensor, op: str) -> list[torch.Tensor]:
    """The gradients of the tensors `_run_kept` ran on, from the graph `handle` names (dropped)."""
    kept = _graphs.pop(int(handle), None)
    if kept is None:
        raise RuntimeError(f"{op} backward: the forward's graph is gone (a second backward through it?)")
    out, edges = kept
    with _autograd_inside_op():
        grads = torch.autograd.grad(out, edges, grad, materialize_grads=True)
    return [g.contiguous() for g in grads]


def launch_exchange_ahead(k: torch.Tensor, v: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Start the KV exchange of `k, v` (this rank's rows, `[T, Hkv, D]`) for the step `key` names,
    without waiting for it, and return a handle naming it for the `cp_attention` call that consumes it
    (`exchange=`; that call's k and v must carry these values). Eager code only: a compiled graph
    cannot hold the handle across its ops. The exchange lives as long as the handle."""
    if torch.compiler.is_compiling():
        raise RuntimeError("launch_exchange_ahead runs in eager code only (a compiled graph launches its own)")
    dispatch, group = _step(key, "launch_exchange_ahead")
    if dispatch.comm == "ring":
        raise ValueError("comm='ring' passes K/V blocks around the ring: there is no exchange to launch ahead")
    return _register(_exchanges, launch_kv_exchange(k, v, dispatch, group, async_op=True))


@torch.library.custom_op("flashcp::cp_attention", mutates_args=())
def _cp_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: torch.Tensor, sinks: torch.Tensor | None,
    exchange: torch.Tensor | None, backend: str, overlap: bool, scale: float | None, record: bool, compiled: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    dispatch, group = _step(key, "cp_attention")
    ahead = None if exchange is None else _exchanges.pop(int(exchange), None)
    if exchange is not None and ahead is None:
        raise RuntimeError("cp_attention: the exchange launched ahead was consumed or released (launch one per call)")

    def run(q, k, v, sinks=None):
        return cp_varlen_attention(q, k, v, dispatch, group, comm=dispatch.comm, backend=backend,
                                   softmax_scale=scale, overlap=overlap, window=dispatch.window,
                                   sinks=sinks, exchange=ahead)  # fmt: skip

    return _run_kept(run, (q, k, v, *(() if sinks is None else (sinks,))), record, compiled)


@_cp_attention.register_fake
def _(q, k, v, key, sinks, exchange, backend, overlap, scale, record, compiled):
    return torch.empty_like(q, memory_format=torch.contiguous_format), key.new_empty(())


@torch.library.custom_op("flashcp::cp_attention_backward", mutates_args=())
def _cp_attention_backward(
    grad: torch.Tensor, handle: torch.Tensor, kv_shape: list[int], sinks_shape: list[int] | None,
    sinks_dtype: torch.dtype | None,
) -> list[torch.Tensor]:  # fmt: skip
    """dq, dk, dv, and dsinks when the forward had sinks."""
    return _kept_grads(grad, handle, "cp_attention")


@_cp_attention_backward.register_fake
def _(grad, handle, kv_shape, sinks_shape, sinks_dtype):
    grads = [torch.empty_like(grad, memory_format=torch.contiguous_format), grad.new_empty(kv_shape),
             grad.new_empty(kv_shape)]  # fmt: skip
    return grads if sinks_shape is None else [*grads, grad.new_empty(sinks_shape, dtype=sinks_dtype)]


def _setup_context(ctx, inputs, output) -> None:
    sinks = inputs[4]
    ctx.kv_shape = list(inputs[1].shape)
    ctx.sinks_meta = (None, None) if sinks is None else (list(sinks.shape), sinks.dtype)
    ctx.save_for_backward(output[1])  # saved, not kept on ctx: checkpointing may then drop it


def _backward(ctx, grad, _grad_handle):
    (handle,) = ctx.saved_tensors
    grads = torch.ops.flashcp.cp_attention_backward(grad, handle, ctx.kv_shape, *ctx.sinks_meta)
    dsinks = grads[3] if len(grads) == 4 else None
    return grads[0], grads[1], grads[2], None, dsinks, None, None, None, None, None, None


_cp_attention.register_autograd(_backward, setup_context=_setup_context)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key: torch.Tensor,
    backend: str = "auto",
    *,
    overlap: bool = False,
    softmax_scale: float | None = None,
    sinks: torch.Tensor | None = None,
    exchange: torch.Tensor | None = None,
) -> torch.Tensor:
    """`cp_varlen_attention(q, k, v, dispatch, group, ..., window=dispatch.window, sinks=sinks)` of the
    step `key = step_key(dispatch, group)` names, as one opaque op that torch.compile keeps in its
    graph (same results, same gradients; the sinks' is this rank's share). `exchange`: the handle of
    this call's KV exchange from `launch_exchange_ahead` (eager code), consumed here."""
    tensors = (q, k, v) if sinks is None else (q, k, v, sinks)
    record = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    scale = None if softmax_scale is None else float(softmax_scale)
    compiled = torch.compiler.is_compiling()
    return torch.ops.flashcp.cp_attention(q, k, v, key, sinks, exchange, backend, overlap, scale, record,
                                          compiled)[0]  # fmt: skip


@torch.library.custom_op("flashcp::cp_latent_attention", mutates_args=())
def _cp_latent_attention(
    q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, wkv_b: torch.Tensor, key: torch.Tensor,
    backend: str, overlap: bool, scale: float | None, record: bool, compiled: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    dispatch, group = _step(key, "cp_latent_attention")

    def run(q, latent, k_pe, wkv_b):
        return cp_latent_attention(q, latent, k_pe, wkv_b, dispatch, group, comm=dispatch.comm, backend=backend,
                                   softmax_scale=scale, overlap=overlap)  # fmt: skip

    return _run_kept(run, (q, latent, k_pe, wkv_b), record, compiled)


@_cp_latent_attention.register_fake
def _(q, latent, k_pe, wkv_b, key, backend, overlap, scale, record, compiled):
    heads = q.shape[1]
    v_dim = wkv_b.shape[0] // heads - (q.shape[2] - k_pe.shape[1])
    return q.new_empty((q.shape[0], heads, v_dim)), key.new_empty(())


@torch.library.custom_op("flashcp::cp_latent_attention_backward", mutates_args=())
def _cp_latent_attention_backward(
    grad: torch.Tensor, handle: torch.Tensor, q_shape: list[int], latent_shape: list[int], k_pe_shape: list[int],
    wkv_b_shape: list[int], q_dtype: torch.dtype, latent_dtype: torch.dtype, wkv_b_dtype: torch.dtype,
) -> list[torch.Tensor]:  # fmt: skip
    """dq, dlatent, dk_pe, dwkv_b (this rank's share: the up-projection of its key rows)."""
    return _kept_grads(grad, handle, "cp_latent_attention")


@_cp_latent_attention_backward.register_fake
def _(grad, handle, q_shape, latent_shape, k_pe_shape, wkv_b_shape, q_dtype, latent_dtype, wkv_b_dtype):
    shapes, dtypes = (q_shape, latent_shape, k_pe_shape, wkv_b_shape), (q_dtype, latent_dtype, latent_dtype, wkv_b_dtype)
    return [grad.new_empty(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]


def _latent_setup_context(ctx, inputs, output) -> None:
    q, latent, _, wkv_b = inputs[:4]
    ctx.meta = (*(list(t.shape) for t in inputs[:4]), q.dtype, latent.dtype, wkv_b.dtype)
    ctx.save_for_backward(output[1])


def _latent_backward(ctx, grad, _grad_handle):
    (handle,) = ctx.saved_tensors
    grads = torch.ops.flashcp.cp_latent_attention_backward(grad, handle, *ctx.meta)
    return *grads, None, None, None, None, None, None


_cp_latent_attention.register_autograd(_latent_backward, setup_context=_latent_setup_context)


def latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    wkv_b: torch.Tensor,
    key: torch.Tensor,
    backend: str = "auto",
    *,
    overlap: bool = False,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """`cp_latent_attention(q, latent, k_pe, wkv_b, dispatch, group, comm=dispatch.comm, ...)` of the
    step `key = step_key(dispatch, group)` names, as one opaque op like `cp_attention` (same results,
    same gradients; wkv_b's is this rank's share, summed over the CP group by FSDP)."""
    record = torch.is_grad_enabled() and any(t.requires_grad for t in (q, latent, k_pe, wkv_b))
    scale = None if softmax_scale is None else float(softmax_scale)
    compiled = torch.compiler.is_compiling()
    return torch.ops.flashcp.cp_latent_attention(q, latent, k_pe, wkv_b, key, backend, overlap, scale, record,
                                                 compiled)[0]
