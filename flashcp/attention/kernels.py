"""One varlen attention interface over three interchangeable backends.

    out = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

`q [Tq, Hq, D]`, `k [Tk, Hkv, D]` and `v [Tk, Hkv, Dv]` pack S sequences back to back, delimited by the int32
prefix sums `cu_seqlens_q / cu_seqlens_k [S+1]`. Sequence i's queries attend to its keys only.
With `causal=True` the mask is aligned to the bottom right: query j of a sequence with Lq queries
and Lk >= Lq keys sees keys 0 .. j + Lk - Lq. This is exactly what a context-parallel shard
needs: its keys are its document prefix followed by its own tokens, so every query sees the whole
prefix plus the causal part of the shard. GQA: Hq must be a multiple of Hkv; query head h uses
key/value head h // (Hq / Hkv). The output is `[Tq, Hq, Dv]`: V's head dim may differ from Q's
and K's (MLA); the flash backends take one head dim, so they run on zero-padded inputs.

Backends (all differentiable through autograd, all with the same semantics):
- "flash_attn": `flash_attn.flash_attn_varlen_func` (CUDA, fp16/bf16, head dim <= 256);
- "torch": `torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16, head dim % 8 == 0, <= 256);
- "reference": plain PyTorch, any device and dtype (float64 included): the CPU path and the
  oracle of the tests (`flashcp.attention.reference`: tiles of 128 x 512 with an online softmax
  and a recomputing backward, so its memory is O(block x block) per step and its work follows
  the attended pairs).
"auto" takes the first of these that accepts the inputs. Asking for a specific backend that
cannot run raises `BackendUnavailable` naming the reason.

`window=W` is a sliding window in Hugging Face's convention (`sliding_window`: a query sees its
last W keys, itself included), which is FlashAttention's `window_size = (W - 1, 0)`; every backend
takes it (the run functions get `window=` only when it is set).

A ring of blockwise calls (`flashcp.attention.ring`) needs two more entries: a forward that also
returns each query row's log-sum-exp [Hq, Tq], and a backward that takes the merged output and
LSE of all blocks (`resolve_lse_backend(name, q, k)`: a backend's `run_lse` and `run_backward`,
with `run`'s arguments; no autograd, the ring is its own).
The reference kernel has both. On GPUs the "torch" backend runs them: the public
`varlen_attn(..., return_aux=AuxRequest(lse=True))` for the forward, and for the backward the aten
op that API's own backward calls, `torch.ops.aten._flash_attention_backward`, because the public
API's backward ignores any gradient of the LSE (a merge through autograd would be silently wrong).
Its schema -- (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
dropout_p, is_causal, rng_state, unused, *, scale, window_size_left, window_size_right) -- was
checked in torch 2.13 (the installed op's schema and `torch/nn/attention/varlen.py`'s
`_varlen_attn_backward`) and torch 2.11 (its `varlen.py` makes the same call); the first call
checks the schema's argument names and refuses, naming them, if a torch changed it.
flash-attn's own varlen backward is not wired (not installed on our GPU machine).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from flashcp.attention.reference import reference_attention, reference_attention_backward, reference_attention_lse
from flashcp.plan.window import check_window

_HALF = (torch.float16, torch.bfloat16)


class BackendUnavailable(RuntimeError):
    """The requested attention backend cannot run these inputs (the message says why)."""


@dataclass(frozen=True)
class Backend:
    """`reject(q, k)` returns why the backend cannot run these tensors, or None if it can."""

    name: str
    reject: Callable[[torch.Tensor, torch.Tensor], str | None]
    run: Callable[..., torch.Tensor]
    run_lse: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # forward with the LSE
    run_backward: Callable[..., tuple[torch.Tensor, ...]] | None = None  # backward from out and LSE


def _reject_half_cuda(q: torch.Tensor, name: str) -> str | None:
    if not q.is_cuda:
        return f"{name} needs CUDA tensors, got device {q.device}"
    if q.dtype not in _HALF:
        return f"{name} supports float16/bfloat16 only, got {q.dtype}"
    if q.shape[-1] > 256:
        return f"{name} supports head dim <= 256, got {q.shape[-1]}"
    return None


# --- flash_attn ------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _flash_attn_import_error() -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install flash-attn)"
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except ImportError as e:  # e.g. built against another torch
        return f"flash-attn is installed but does not import: {e}"
    return None


def _flash_attn_reject(q: torch.Tensor, k: torch.Tensor) -> str | None:
    return _flash_attn_import_error() or _reject_half_cuda(q, "flash_attn")


def _flash_attn_run(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    from flash_attn import flash_attn_varlen_func

    # flash-attn >= 2.1 aligns the causal mask to the bottom right and handles GQA natively;
    # its window_size arrived in 2.3.
    extra = {} if window is None else {"window_size": _window_size(causal, window)}
    return flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=causal, **extra
    )


def _window_size(causal: bool, window: int | None) -> tuple[int, int]:
    """FlashAttention's (left, right) window: HF's sliding_window W is (W - 1, 0); (-1, 0) is
    causal attention aligned to the bottom right, (-1, -1) no mask."""
    if window is not None:
        return window - 1, 0
    return (-1, 0) if causal else (-1, -1)


# --- torch varlen_attn -----------------------------------------------------------------------


@lru_cache(maxsize=1)
def _torch_varlen_params() -> frozenset[str] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def _torch_version_problem() -> str | None:
    params = _torch_varlen_params()
    if params is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    # torch 2.10 only took `is_causal`; `scale` and `window_size` arrived in 2.11.
    if not {"scale", "window_size"} <= params:
        return f"torch {torch.__version__} varlen_attn lacks scale/window_size (needs torch >= 2.11)"
    return None


def _torch_reject(q: torch.Tensor, k: torch.Tensor) -> str | None:
    reason = _torch_version_problem() or _reject_half_cuda(q, "torch varlen_attn")
    if reason is None and q.shape[-1] % 8:
        reason = f"torch varlen_attn needs head dim divisible by 8, got {q.shape[-1]}"
    if reason is None and _capability(q.device.index) < (8, 0):
        reason = "torch varlen_attn (FlashAttention-2) needs an sm80+ GPU"
    return reason


@lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _torch_run(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    from torch.nn.attention.varlen import varlen_attn

    # GQA without copies: every torch since 2.11 hands K/V with fewer heads straight to aten's
    # FlashAttention-2 (`_flash_attention_forward/_backward`), which shares each KV head among its
    # query group and sums the group's dK/dV. torch >= 2.12 only asks for `enable_gqa=True` to
    # skip a heads-equal check; torch 2.11 has neither flag nor check. `python -m flashcp.gpucheck`
    # compares this path with the reference on every GPU it runs on ("native GQA" in its report).
    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] and "enable_gqa" in _torch_varlen_params() else {}
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=_window_size(causal, window),
                       **kwargs)  # fmt: skip


def _torch_run_lse(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] and "enable_gqa" in _torch_varlen_params() else {}
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=_window_size(causal, window),
                           return_aux=AuxRequest(lse=True), **kwargs)  # fmt: skip
    return out, lse


_FLASH_BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
                        "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused", "scale",
                        "window_size_left", "window_size_right")  # fmt: skip


@lru_cache(maxsize=1)
def _flash_backward_schema_problem() -> str | None:
    names = tuple(a.name for a in torch.ops.aten._flash_attention_backward.default._schema.arguments)
    if names != _FLASH_BACKWARD_ARGS:
        return f"torch {torch.__version__}'s aten._flash_attention_backward takes ({', '.join(names)})"
    return None


def _torch_run_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    problem = _flash_backward_schema_problem()
    if problem is not None:
        raise BackendUnavailable(f"the GPU backward from an output and LSE (ring, sinks) expects "
                                 f"({', '.join(_FLASH_BACKWARD_ARGS)}); {problem}")  # fmt: skip
    # dropout 0: the philox state is never read (torch's varlen_attn passes zeros too)
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    left, right = _window_size(causal, window)
    # is_causal as torch's varlen_attn sets it (only for (-1, 0)); a window is FA2's local mask.
    return torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, (left, right) == (-1, 0),
        rng, unused,
        scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip


# --- reference -------------------------------------------------------------------------------


def _reference_run(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    return reference_attention(q, k, v, cu_q, cu_k, causal, scale, window=window)


def _reference_run_lse(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window=None):
    return reference_attention_lse(q, k, v, cu_q, cu_k, causal, scale, window)


def _reference_run_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale,
                            window=None):  # fmt: skip
    return reference_attention_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, causal, scale, window)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("flash_attn", _flash_attn_reject, _flash_attn_run),
        Backend("torch", _torch_reject, _torch_run, _torch_run_lse, _torch_run_backward),
        Backend("reference", lambda q, k: None, _reference_run, _reference_run_lse, _reference_run_backward),
    )
}


INSTALL_HINTS = {
    "flash_attn": "flash-attn ships prebuilt wheels only for torch <= 2.10; for newer torch build it "
    "against the installed one: pip install flash-attn --no-build-isolation (needs nvcc; see "
    'docs/training.md, "Ranks, kernels, logs")',
    "torch": "torch's varlen_attn needs torch >= 2.11 and an sm80+ GPU (A100, H100 or newer)",
}


def gpu_backend_problem(name: str, device: int | None = None) -> str | None:
    """Why backend `name` cannot run on GPU `device` of this machine (whatever the inputs), or None.

    The pre-launch check calls this before any rank starts, so a job that names a backend the
    machine lacks fails in a second instead of at its first attention call, after the model is
    built."""
    if name == "flash_attn":
        reason = _flash_attn_import_error()
    elif name == "torch":
        reason = _torch_version_problem()
        if reason is None and _capability(device) < (8, 0):
            reason = "torch varlen_attn (FlashAttention-2) needs an sm80+ GPU"
    else:
        reason = None
    return None if reason is None else f"{reason}; {INSTALL_HINTS[name]}"


def resolve_backend(name: str, q: torch.Tensor, k: torch.Tensor) -> Backend:
    """The backend `name` ("auto" picks the first that accepts the inputs) or a clear error."""
    if name == "auto":  # "reference" accepts everything, so this always finds one
        backend = next(b for b in BACKENDS.values() if b.reject(q, k) is None)
        if backend.name == "reference" and q.is_cuda:
            _warn_slow_cuda(str(q.dtype))
        return backend
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose auto or one of {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    reason = backend.reject(q, k)
    if reason is not None:
        raise BackendUnavailable(f"attention backend {name!r} unavailable: {reason}")
    return backend


def resolve_lse_backend(
    name: str, q: torch.Tensor, k: torch.Tensor, purpose: str = "blockwise attention"
) -> Backend:
    """`resolve_backend` among the backends with a forward that returns the LSE and a backward
    from a given output and LSE (what `purpose` needs: blockwise attention, sinks)."""
    if name == "auto":
        backend = next(b for b in BACKENDS.values() if b.run_lse is not None and b.reject(q, k) is None)
        if backend.name == "reference" and q.is_cuda:
            _warn_slow_cuda(str(q.dtype))
        return backend
    if name in BACKENDS and BACKENDS[name].run_lse is None:
        have = ", ".join(b.name for b in BACKENDS.values() if b.run_lse is not None)
        raise BackendUnavailable(f"attention backend {name!r} has no forward with LSE and backward from it "
                                 f"({purpose} runs on {have})")  # fmt: skip
    return resolve_backend(name, q, k)


@lru_cache(maxsize=None)
def _warn_slow_cuda(dtype: str) -> None:
    warnings.warn(
        f"no flash attention backend accepts {dtype} CUDA tensors; using the slow reference kernel",
        stacklevel=3,
    )


def window_args(window: int | None, causal: bool = True) -> dict[str, int]:
    """The keyword a backend's run functions get for `window` (none for full attention, so a
    backend without windows keeps working), after refusing a bad window in one line."""
    check_window(window)
    if window is None:
        return {}
    if not causal:
        raise ValueError(f"window={window} is a causal sliding window: it needs causal=True")
    return {"window": window}


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim], got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same tokens and heads: {k.shape} vs {v.shape}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head dim {q.shape[2]} != k head dim {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.dim() != 1:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
            "must both be [num_sequences + 1]"
        )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    window: int | None = None,
) -> torch.Tensor:
    """Attention of packed variable-length sequences (see the module docstring); returns [Tq, Hq, Dv]."""
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    extra = window_args(window, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    chosen = resolve_backend(backend, q, k)
    dv = v.shape[-1]
    if chosen.name != "reference" and dv != q.shape[-1]:
        q, k, v = _one_head_dim(q, k, v)
    out = chosen.run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, **extra)
    return out if out.shape[-1] == dv else out[..., :dv]


def _one_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v zero-padded to one head dim, the larger of QK's and V's.

    FlashAttention-2 (flash-attn 2.x, and aten's `_flash_attention_forward` behind torch's
    varlen_attn, checked on torch 2.11-2.13: its fake returns `empty_like(query)`) takes a single
    head dim, while MLA has 192 for Q and K and 128 for V. Zero columns change no score and no
    kept output column, so the result is exact; the cost is V, the output and dO at 192 wide and
    1.2x the kernel's matmul FLOPs (`flashcp.costmodel.kernel.call_counts`, `v_head_dim`)."""
    d = max(q.shape[-1], v.shape[-1])
    return tuple(torch.nn.functional.pad(t, (0, d - t.shape[-1])) for t in (q, k, v))
