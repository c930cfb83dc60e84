"""fla's Gated DeltaNet kernel on CPU tensors under Triton's interpreter, against the torch reference.

    TRITON_INTERPRET=1 python tests/fla_interpret.py      # prints one JSON list of comparisons

Run by `tests/test_gdn_kernels.py` in a process of its own: Triton picks the interpreter when fla's
kernels are decorated, at fla's import, so the variable must be set before anything imports fla.
Two shims make Triton 3.9's interpreter run fla-core 0.6.0's kernels; they live here, not in
FlashCP, and touch nothing a GPU run uses:

- the autotuner benchmarks every config through the active GPU driver, of which the interpreter has
  none ("0 active drivers"): every config is given the same time, so the first one runs;
- `chunk_delta_h`'s state kernels call `i_t.to(tl.int64)` on a loop index, which compiled Triton
  makes a tensor and the interpreter leaves a Python int: that module's `range` yields ints with
  an identity `.to`.

Each comparison is float32 fla against the float64 reference: (case, tensor, error, scale), the
test holding error <= 1e-5 * max(1, scale).
"""

from __future__ import annotations

import builtins
import json
import os
import sys

import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("set TRITON_INTERPRET=1: fla's kernels run on CPU tensors only under Triton's interpreter")

from triton.runtime.autotuner import Autotuner  # noqa: E402

Autotuner.do_bench = property(lambda self: lambda fn, quantiles: [0.0] * len(quantiles))


class _Index(int):
    def to(self, dtype, **kwargs):
        return self


import fla.ops.common.chunk_delta_h as _chunk_delta_h  # noqa: E402

_chunk_delta_h.range = lambda *args: map(_Index, builtins.range(*args))

from flashcp import plan_shards  # noqa: E402
from flashcp.attention.gated_delta import affine_summary, gated_delta_recurrence  # noqa: E402
from flashcp.attention.gdn_kernels import _fla_run, gdn_kernel  # noqa: E402
from flashcp.gpucheck.gdn import layouts, run_op, slow_decays, TENSORS, window_inputs  # noqa: E402

CHUNK = 16  # fla's smallest: the documents below cross chunks with few tokens
LENS = [37, 1, 5, 16, 9]  # a 1-token document, pieces shorter than a chunk, one exactly a chunk
rows: list[dict] = []
cpu = torch.device("cpu")


def compare(case: str, names: tuple[str, ...], got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for name, a, b in zip(names, got, want):
        rows.append({"case": case, "tensor": name, "error": float((a.double() - b).abs().max()),
                     "scale": float(b.abs().max())})  # fmt: skip


def leaves(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def kernel_case() -> None:
    """Forward and backward of one varlen call with per-sequence initial states and final states."""
    gen = torch.Generator().manual_seed(0)
    t, h, dk, dv = sum(LENS), 2, 16, 8
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    inputs = [F.normalize(rand(t, h, dk), dim=-1) * dk**-0.5, F.normalize(rand(t, h, dk), dim=-1),
              rand(t, h, dv), -F.softplus(rand(t, h)) * slow_decays(h, cpu), torch.sigmoid(rand(t, h)),
              rand(len(LENS), h, dk, dv)]
    do, dfinal = rand(t, h, dv), rand(len(LENS), h, dk, dv)
    results = []
    for dtype, kernel in ((torch.float32, gdn_kernel("fla", inputs[0].float(), inputs[2].float(), CHUNK)),
                          (torch.float64, None)):  # fmt: skip
        xs = leaves(inputs, dtype)
        if kernel is None:
            o, final = gated_delta_recurrence(*xs[:5], LENS, xs[5])
        else:
            o, final = kernel(*xs[:5], LENS, xs[5], CHUNK)
        ((o.double() * do).sum() + (final.double() * dfinal).sum()).backward()
        results.append([o.detach(), final.detach()] + [x.grad for x in xs])
    compare("kernel", ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial"), *results)


def summary_case() -> None:
    """The middle pieces' [B | M] through fla (initial state [0 | I], values [v | 0])."""
    gen = torch.Generator().manual_seed(1)
    t, h, dk, dv = sum(LENS), 2, 16, 8
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    inputs = [F.normalize(rand(t, h, dk), dim=-1), rand(t, h, dv),
              -F.softplus(rand(t, h)) * slow_decays(h, cpu), torch.sigmoid(rand(t, h))]
    db, dm = rand(len(LENS), h, dk, dv), rand(len(LENS), h, dk, dk)
    results = []
    for dtype, kernel in ((torch.float32, _fla_run), (torch.float64, None)):
        xs = leaves(inputs, dtype)
        b, m = affine_summary(*xs, LENS, CHUNK, kernel)
        ((b.double() * db).sum() + (m.double() * dm).sum()).backward()
        results.append([b.detach(), m.detach()] + [x.grad for x in xs])
    compare("summary", ("B", "M", "dk", "dv", "dg", "dbeta"), *results)


def op_case() -> None:
    """The CP op with fla on simulated ranks against the unsharded float64 reference: per_seq's split
    at N = 2 of one document across both ranks twice (a first, a middle and a last piece: B and M
    summaries and halo rows cross ranks both ways) beside 1-token documents. One layout: each
    simulated pass reruns every rank's kernels, a minute under the interpreter."""
    plan = layouts([40], 2)["spanning + 1-token"]  # 40 tokens: per_seq's split needs a multiple of 2 N
    inputs = window_inputs(plan.context, (2, 16, 8), cpu, seed=2)
    truth = run_op(plan_shards(list(plan.doc_lens), 1, "whole_doc"), inputs, "reference", CHUNK)
    compare("op", TENSORS, run_op(plan, [t.float() for t in inputs], "fla", CHUNK), truth)


if __name__ == "__main__":
    kernel_case()
    summary_case()
    op_case()
    print(json.dumps(rows))
