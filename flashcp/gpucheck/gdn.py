"""Section 7: the Gated DeltaNet CP op (Qwen3.5's linear layers) on N ranks simulated on one device.

`cp_causal_conv1d` then `cp_gated_delta` run forward and backward on every rank of a plan through
`flashcp.attention.simulate.run_ranks` (the real op: summaries, halo rows and their transposed
exchanges, collectives answered in process), with flash-linear-attention's kernel on CUDA and the
torch reference on a CPU (`flashcp.attention.gdn_kernels`). Plans: FlashCP's and Per-Doc's on a
sampled window, and a contiguous (per_seq) split of one document spanning every rank twice beside
1-token documents, at N in {2, 4, 8}, float32 and bfloat16. Compared: y and o, and the gradients of
x, the conv weight, q, k, v, g and beta, assembled in window order.

The truth is the same two ops unsharded (a 1-rank plan: every document whole, no exchange) with the
reference kernel in float64 on the same rounded inputs; the yardstick is the checked kernel
unsharded in the checked dtype. Sharded passes when it is at most `FACTOR` times as far from the
truth as the yardstick, plus N rounding steps at the tensor's scale (per-rank conv weight gradients
summed, one rounding each; summaries folded in float32). On a GPU the middle pieces' [B | M]
summaries come from fla too (`affine_summary`), so every kernel call of the op is fla's. A timing
row per kernel compares fla with the reference on one packed window at Qwen3.5's head shape
(`sizes.gdn_time_tokens`, `gdn_time_heads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashcp import plan_shards
from flashcp.attention.gdn_kernels import fla_import_problem, gdn_kernel
from flashcp.attention.linear_cp import cp_causal_conv1d, cp_gated_delta
from flashcp.attention.linear_dispatch import build_linear_dispatch
from flashcp.attention.simulate import run_ranks
from flashcp.data import length_sampler, pack_windows
from flashcp.gpucheck.report import Budget, Report, Section
from flashcp.gpucheck.sizes import Sizes
from flashcp.gpucheck.timing import Timer
from flashcp.plan.linear import doc_pieces
from flashcp.plan.plan import Plan

FACTOR = 2.0
WIDTH = 4  # Qwen3.5's conv_kernel_size
CHANNELS = 8
DTYPES = (torch.float32, torch.bfloat16)
TENSORS = ("y", "o", "dx", "dconv_weight", "dq", "dk", "dv", "dg", "dbeta")
COLUMNS = ["layout", "cp", "backend", "dtype", "tensor", "error", "single_device_error", "tolerance", "ok",
           "documents", "cut_documents"]  # fmt: skip
TIME_COLUMNS = ["backend", "dtype", "tokens", "documents", "heads", "d_k", "d_v", "fwd_ms", "fwd_bwd_ms"]


def layouts(doc_lens: list[int], n: int) -> dict[str, Plan]:
    """The plans checked at N = n: FlashCP's and Per-Doc's on the sampled window, and one document
    cut across every rank (per_seq's contiguous split) beside 1-token documents."""
    c = sum(doc_lens)
    spanning = [c - 8, 1, 3, 1, 2, 1]
    return {"flashcp": plan_shards(doc_lens, n, "flashcp"), "per_doc": plan_shards(doc_lens, n, "per_doc"),
            "spanning + 1-token": plan_shards(spanning, n, "per_seq")}  # fmt: skip


def window_inputs(c: int, heads: tuple[int, int, int], device: torch.device, seed: int) -> list[torch.Tensor]:
    """x, conv weight, q (L2-normalised, scaled), k (L2-normalised), v, g, beta, dy, do: float64.

    The log-decays g are small (heads from 1e-3 to 1e-1 per token, as trained Gated DeltaNet heads
    keep state over hundreds of tokens): with g of order 1 a state is forgotten within a few tokens
    and a wrong summary from a predecessor would go unseen."""
    h, dk, dv = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float64)  # noqa: E731
    return [
        rand(c, CHANNELS), rand(CHANNELS, WIDTH) / 2,
        F.normalize(rand(c, h, dk), dim=-1) * dk**-0.5, F.normalize(rand(c, h, dk), dim=-1),
        rand(c, h, dv), -F.softplus(rand(c, h)) * slow_decays(h, device), torch.sigmoid(rand(c, h)),
        rand(c, CHANNELS), rand(c, h, dv),
    ]  # fmt: skip


def slow_decays(heads: int, device: torch.device) -> torch.Tensor:
    """Per-head scales of the log-decay, 1e-3 to 1e-1."""
    return torch.logspace(-3, -1, heads, dtype=torch.float64, device=device)


def run_op(plan: Plan, inputs: list[torch.Tensor], backend: str, chunk_size: int = 64) -> list[torch.Tensor]:
    """Outputs and gradients (`TENSORS`) of the conv and the gated delta op on every rank of `plan`,
    in window order (the conv weight's gradient summed over ranks, in float32 at least)."""
    device = inputs[0].device
    dispatches = [build_linear_dispatch(plan, r, WIDTH).map(lambda t: t.to(device)) for r in range(plan.cp_size)]

    def program(rank: int, group) -> list[torch.Tensor]:
        d = dispatches[rank]
        x, w, q, k, v, g, beta, dy, do = (t if i == 1 else t.index_select(0, d.token_index)
                                          for i, t in enumerate(inputs))  # fmt: skip
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, q, k, v, g, beta)]
        y = cp_causal_conv1d(leaves[0], leaves[1], d, group)
        o = cp_gated_delta(*leaves[2:], d, group, chunk_size=chunk_size, backend=backend)
        torch.autograd.backward([y, o], [dy, do.to(o.dtype)])
        return [y.detach(), o.detach()] + [t.grad for t in leaves]

    results = run_ranks(plan.cp_size, program)
    wide = torch.promote_types(inputs[0].dtype, torch.float32)
    x, w, q, k, v, g, beta, _, do = inputs
    whole = [torch.zeros_like(t, dtype=wide) for t in (x, do, x, w, q, k, v, g, beta)]
    for d, local in zip(dispatches, results):
        for i, (dst, src) in enumerate(zip(whole, local)):
            if i == 3:  # the conv weight: each rank holds its share of the gradient
                dst += src
            else:
                dst[d.token_index] = src.to(wide)
    return whole


def run(report: Report, sec: Section, device: torch.device, sizes: Sizes, budget: Budget,
        backends: list[str]) -> None:  # fmt: skip
    table = report.table("gdn", COLUMNS)
    backend = "reference"
    if device.type == "cuda":
        problem = fla_import_problem()
        if problem is None:
            backend = "fla"
        else:
            sec.failures.append(f"fla: {problem}; the op was checked with the reference kernel instead")
    c = sizes.gdn_context
    window = pack_windows(length_sampler("wlbllm", seed=0), c, 1)[0]
    spanning_docs = list(layouts(window, 1)["spanning + 1-token"].doc_lens)
    inputs = {tuple(docs): window_inputs(c, sizes.gdn_heads, device, seed)
              for seed, docs in enumerate((window, spanning_docs))}  # fmt: skip
    checked = 0
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        single = {}  # documents -> rounded inputs, the truth on them, the unsharded kernel's errors
        for docs, full in inputs.items():
            whole = plan_shards(list(docs), 1, "whole_doc")
            rounded = [t.to(dtype) for t in full]
            truth = run_op(whole, [t.double() for t in rounded], "reference")
            errors = [_err(a, b) for a, b in zip(run_op(whole, rounded, backend), truth)]
            single[docs] = (rounded, truth, errors)
        for n in sizes.gdn_cp_sizes:
            for layout, plan in layouts(window, n).items():
                if budget.spent():
                    sec.status = "failed" if sec.failures else "cut short"
                    sec.lines.append(f"- budget spent after {checked} (layout, N, dtype) runs")
                    return
                rounded, truth, single_err = single[plan.doc_lens]
                got = run_op(plan, rounded, backend)
                cut = sum(1 for pieces in doc_pieces(plan) if len(pieces) > 1)
                bad = []
                for tensor, a, e, s_err in zip(TENSORS, got, truth, single_err):
                    err = _err(a, e)
                    tol = FACTOR * s_err + n * torch.finfo(dtype).eps * float(e.abs().max())
                    table.add(layout=layout, cp=n, backend=backend, dtype=name, tensor=tensor, error=err,
                              single_device_error=s_err, tolerance=tol, ok=err <= tol,
                              documents=len(plan.doc_lens), cut_documents=cut)  # fmt: skip
                    if err > tol:
                        bad.append(f"{tensor} {err:.3g} > {tol:.3g}")
                checked += 1
                if bad:
                    sec.failures.append(f"{layout} N={n} {backend} {name}: " + ", ".join(bad))
                print(f"gdn {layout} N={n} {name}: {'ok' if not bad else 'FAILED'}", flush=True)
    verdict = f"every one within {FACTOR}x the single-device error" if not sec.failures else \
        f"{len(sec.failures)} failed"
    sec.lines.append(f"- {checked} (layout, N, dtype) runs with the {backend} kernel, C = {c}, "
                     f"heads / d_k / d_v {sizes.gdn_heads}: {verdict}")
    _time(report, sec, device, sizes, budget)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _time(report: Report, sec: Section, device: torch.device, sizes: Sizes, budget: Budget) -> None:
    """fwd and fwd+bwd of each kernel on one packed window in bf16 (fla on CUDA only)."""
    tokens, (h, dk, dv) = sizes.gdn_time_tokens, sizes.gdn_time_heads
    table = report.table("gdn_timing", TIME_COLUMNS)
    docs = pack_windows(length_sampler("wlbllm", seed=1), tokens, 1)[0]
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    q, k = (F.normalize(rand(tokens, h, dk), dim=-1).to(dtype) for _ in "qk")
    v, do = (rand(tokens, h, dv).to(dtype) for _ in "vo")
    g = -F.softplus(rand(tokens, h)) * slow_decays(h, device).float()
    beta = torch.sigmoid(rand(tokens, h)).to(dtype)
    timer = Timer(device, sizes.repeats)
    for backend in (("fla", "reference") if device.type == "cuda" and fla_import_problem() is None
                    else ("reference",)):  # fmt: skip
        if budget.spent():
            sec.lines.append(f"- timing of {backend}: budget spent")
            return
        kernel = gdn_kernel(backend, q, v)
        leaves = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
        fwd = timer(lambda: kernel(*leaves, docs))
        fwd_bwd = timer(lambda: kernel(*leaves, docs)[0].backward(do))
        table.add(backend=backend, dtype="bfloat16", tokens=tokens, documents=len(docs), heads=h, d_k=dk,
                  d_v=dv, fwd_ms=fwd, fwd_bwd_ms=fwd_bwd)  # fmt: skip
        sec.lines.append(f"- {backend}: {fwd:.3g} ms forward, {fwd_bwd:.3g} ms forward+backward "
                         f"({tokens} tokens in {len(docs)} documents, {h} heads, d_k {dk}, d_v {dv}, bf16)")
