"""Which kernel runs the gated delta rule's local pieces: flash-linear-attention's on GPUs, torch's elsewhere.

    kernel = gdn_kernel("auto", q, v, chunk_size)      # once per op call
    o, final = kernel(q, k, v, g, beta, seq_lens, initial_state, chunk_size)

Both kernels have `chunk_gated_delta`'s contract (`flashcp.attention.gated_delta`: q, k [T, H, d_k],
v [T, H, d_v], g, beta [T, H], one optional initial state per sequence [N, H, d_k, d_v]; the output
in q's dtype, the final states in float32 or float64), so the CP op and `affine_summary` take either.

- "fla": `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (package fla-core, pinned 0.6.0 in the
  `gpu` extra; Triton, so CUDA tensors, or any device under Triton's interpreter `TRITON_INTERPRET=1`,
  which is how the CPU tests run it). The sequences go in as `cu_seqlens` (with its host copy, so
  no device sync), the initial states as its per-sequence `initial_state [N, H, K, V]`, and
  `output_final_state` returns the final ones, both float32. `scale=1` and its l2norm / sigmoid /
  gate flags off: FlashCP's caller has normalised and scaled q and k and computed g and beta, as
  for the reference. q, k and beta run in v's dtype (a bf16 model's activations, as TorchTitan's
  Qwen3.5 feeds fla), g in float32; its float32 dots are Triton's default TF32. fla also takes
  fewer key heads than value heads (GVA); this contract repeats key heads beforehand. The middle
  pieces' `[B | M]` summaries are one more call of the same kernel (`affine_summary`: values
  `[v | 0]` from the initial state `[0 | I]`, V = d_v + d_k wide). That is exact, not an
  approximation: the rule multiplies the state on the left and adds each value column into its own
  state column, and fla computes each block of V columns apart from the others, so the identity
  columns come out as M and the value columns as B (float32 under the interpreter: about 1e-7 of
  the tensors' scale from the float64 reference, `tests/test_gdn_kernels.py`).
- "reference": `chunk_gated_delta`, plain torch, any device and dtype (float64 included).

"auto" takes fla when it accepts the inputs, else the reference (with a warning on CUDA, where the
reference is slow). Naming a backend that cannot run the inputs raises `BackendUnavailable` in one
line saying why: a GDN layer asked for fla on CPU tensors, without fla installed, in float64, with
d_k > 256 or a chunk size other than 16, 32 or 64.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache

import torch

from flashcp.attention.gated_delta import _check, chunk_gated_delta
from flashcp.attention.kernels import BackendUnavailable

GDN_BACKENDS = ("fla", "reference")
FLA_PIN = "fla-core==0.6.0"
_FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLA_CHUNKS = (16, 32, 64)
_FLA_MAX_DK = 256  # fla's state kernels hold d_k in four 64-wide blocks
_FLA_PARAMS = {"initial_state", "output_final_state", "cu_seqlens", "cu_seqlens_cpu", "scale"}

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@lru_cache(maxsize=1)
def fla_import_problem() -> str | None:
    """Why fla's gated delta kernel cannot be imported here, or None."""
    if importlib.util.find_spec("fla") is None:
        return f"flash-linear-attention is not installed (pip install {FLA_PIN}, the `gpu` extra)"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # ImportError, or a triton too old for its kernels
        return f"flash-linear-attention is installed but does not import: {type(e).__name__}: {e}"
    missing = _FLA_PARAMS - set(inspect.signature(chunk_gated_delta_rule).parameters)
    if missing:
        return (f"fla's chunk_gated_delta_rule lacks {', '.join(sorted(missing))} "
                f"(FlashCP needs {FLA_PIN} or a compatible version)")  # fmt: skip
    return None


def _fla_reject(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> str | None:
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return f"fla's Triton kernels need CUDA tensors, got device {q.device}"
    if v.dtype not in _FLA_DTYPES or q.dtype not in _FLA_DTYPES:
        return f"fla takes float32, bfloat16 or float16, got q {q.dtype}, v {v.dtype}"
    if q.shape[-1] > _FLA_MAX_DK:
        return f"fla takes a key head dim <= {_FLA_MAX_DK}, got {q.shape[-1]}"
    if chunk_size not in _FLA_CHUNKS:
        return f"fla takes chunk_size 16, 32 or 64, got {chunk_size}"
    return fla_import_problem()


def _fla_run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    seq_lens: Sequence[int], initial_state: torch.Tensor | None = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    _check(q, k, v, g, beta, seq_lens, initial_state)
    if not seq_lens:  # a rank may hold no piece of a kind: nothing to launch
        return chunk_gated_delta(q, k, v, g, beta, seq_lens, initial_state, chunk_size)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    dtype = v.dtype
    cu_cpu = torch.tensor([0, *seq_lens]).cumsum(0)
    state = None if initial_state is None else initial_state.float()
    o, final = chunk_gated_delta_rule(
        q.to(dtype)[None], k.to(dtype)[None], v[None], g.float()[None], beta.to(dtype)[None],
        scale=1.0, initial_state=state, output_final_state=True,
        cu_seqlens=cu_cpu.to(q.device, non_blocking=True), cu_seqlens_cpu=cu_cpu, chunk_size=chunk_size,
    )  # fmt: skip
    return o[0].to(q.dtype), final


def gdn_kernel(name: str, q: torch.Tensor, v: torch.Tensor, chunk_size: int = 64) -> Kernel:
    """The kernel of backend `name` ("auto": fla if it accepts the inputs) or a one-line error."""
    if name not in ("auto", *GDN_BACKENDS):
        choices = ", ".join(GDN_BACKENDS)
        raise ValueError(f"unknown Gated DeltaNet backend {name!r}; choose auto or one of {choices}")
    if name == "reference":
        return chunk_gated_delta
    reason = _fla_reject(q, v, chunk_size)
    if reason is None:
        return _fla_run
    if name == "fla":
        raise BackendUnavailable(f"Gated DeltaNet backend 'fla' unavailable: {reason}")
    if q.is_cuda:
        _warn_slow_cuda(reason)
    return chunk_gated_delta


@lru_cache(maxsize=None)
def _warn_slow_cuda(reason: str) -> None:
    warnings.warn(f"Gated DeltaNet on CUDA runs the slow torch reference kernel: {reason}", stacklevel=3)
