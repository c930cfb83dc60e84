"""Section 2: the whole CP op, forward and backward, on N ranks simulated on one device.

`flashcp.attention.simulate` runs every rank of a CP group in this process, through the real
op (dispatch, KV exchange, gathers, kernel, transposed exchange) with the collectives answered
in process; the ring (`comm = "ring"`) too, on the backends with its kernels (the LSE forward and
the backward from the merged output: torch's, through aten's FlashAttention-2 backward, and the
reference). Each (window, N, strategy, comm mode) result is assembled in window order and
compared with single-device attention: the float32 reference kernel on the same inputs is the
truth, and the CP op may be at most `FACTOR` times as far from it as the same backend on one
device, plus N rounding steps at the tensor's scale: a key row attended by shards on several
ranks gets its dK / dV partial sums added in the half dtype (scatter-add, reduce-scatter), one
rounding per contributing rank at most. Beyond that, sharding must not cost accuracy.
"""

from __future__ import annotations

import torch

from flashcp import plan_shards
from flashcp.attention.kernels import BACKENDS, reference_attention, varlen_attention
from flashcp.attention.simulate import simulate_cp_attention
from flashcp.data import length_sampler, pack_windows
from flashcp.dispatch import COMM_MODES
from flashcp.gpucheck.report import Budget, Report, Section
from flashcp.gpucheck.sizes import Sizes
from flashcp.plan import STRATEGIES

FACTOR = 2.0
DATASETS = ("wlbllm", "pile")
ILP_OPTIONS = dict(target_imbalance=2.0, time_limit=5.0)  # its cuts are what is checked, not its optimum
TENSORS = ("out", "dq", "dk", "dv")
COLUMNS = ["dataset", "cp", "strategy", "comm", "overlap", "backend", "dtype", "tensor", "error",
           "single_device_error", "tolerance", "ok", "documents", "planned_imbalance"]  # fmt: skip


def _grads(fn, q, k, v, grad) -> list[torch.Tensor]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


def run(report: Report, sec: Section, device: torch.device, sizes: Sizes, budget: Budget,
        backends: list[str]) -> None:  # fmt: skip
    table = report.table("cp", COLUMNS)
    hq, hkv, d = sizes.cp_heads
    dtype = torch.bfloat16
    c = sizes.cp_context
    windows = {ds: pack_windows(length_sampler(ds, seed=0), c, 1)[0] for ds in DATASETS}
    gen = torch.Generator(device=device).manual_seed(0)
    q, g = (torch.randn(c, hq, d, generator=gen, device=device).to(dtype) for _ in "qg")
    k, v = (torch.randn(c, hkv, d, generator=gen, device=device).to(dtype) for _ in "kv")
    checked = 0
    for ds, doc_lens in windows.items():
        cu = torch.tensor([0, *doc_lens]).cumsum(0).to(device=device, dtype=torch.int32)
        exact = _grads(lambda q, k, v: reference_attention(q, k, v, cu, cu, compute_dtype=torch.float32), q, k, v, g)
        ulp = [torch.finfo(dtype).eps * float(e.abs().max()) for e in exact]
        for backend in backends:
            single = _grads(lambda q, k, v: varlen_attention(q, k, v, cu, cu, max(doc_lens), max(doc_lens),
                                                              backend=backend), q, k, v, g)  # fmt: skip
            single_err = [float((a - b).abs().max()) for a, b in zip(single, exact)]
            for n in sizes.cp_sizes:
                for strategy in STRATEGIES:
                    if strategy == "ilp" and (ds, n) != (DATASETS[0], sizes.cp_sizes[0]):
                        continue  # one ILP plan (seconds of solver time) covers its arbitrary cuts
                    if budget.spent():
                        sec.status = "failed" if sec.failures else "cut short"
                        sec.lines.append(f"- budget spent after {checked} (strategy, comm) runs")
                        return
                    try:
                        plan = plan_shards(doc_lens, n, strategy, **(ILP_OPTIONS if strategy == "ilp" else {}))
                    except ImportError as e:  # scipy, for the MILP only: a bare GPU machine has torch + numpy
                        sec.lines.append(f"- {ds} N={n} {strategy}: skipped, {e.name or 'scipy'} is not installed "
                                         "(pip install scipy checks the ILP plan's cuts too)")
                        continue
                    except RuntimeError as e:  # the MILP found no plan within its time limit
                        sec.lines.append(f"- {ds} N={n} {strategy}: no plan ({e})")
                        continue
                    imbalance = plan.metrics()["imbalance"]
                    runs = [(comm, False) for comm in COMM_MODES] + ([("compact", True)] if strategy == "flashcp" else [])
                    if BACKENDS[backend].run_lse is not None:  # the ring's kernels: the LSE and its backward
                        runs.append(("ring", False))
                    for comm, overlap in runs:
                        got = simulate_cp_attention(plan, comm, q, k, v, g, backend=backend, overlap=overlap)
                        bad = []
                        for name, a, e, s_err, step in zip(TENSORS, got, exact, single_err, ulp):
                            err = float((a.float() - e).abs().max())
                            tol = FACTOR * s_err + n * step
                            table.add(dataset=ds, cp=n, strategy=strategy, comm=comm, overlap=overlap, backend=backend,
                                      dtype="bfloat16", tensor=name, error=err, single_device_error=s_err,
                                      tolerance=tol, ok=err <= tol, documents=len(doc_lens),
                                      planned_imbalance=imbalance)  # fmt: skip
                            if err > tol:
                                bad.append(f"{name} {err:.3g} > {tol:.3g}")
                        checked += 1
                        if bad:
                            sec.failures.append(f"{ds} N={n} {strategy}/{comm} overlap={overlap} {backend}: "
                                                + ", ".join(bad))
                    print(f"{ds} N={n} {strategy}: {len(runs)} comm modes checked", flush=True)
            sec.lines.append(f"- {ds} window ({len(doc_lens)} documents, C = {c}), {backend}: single-device error "
                             + ", ".join(f"{t} {e:.3g}" for t, e in zip(TENSORS, single_err)))
    sec.lines.append(f"- {checked} (window, N, strategy, comm) runs, every one within {FACTOR}x the "
                     "single-device error" if not sec.failures else f"- {checked} runs, {len(sec.failures)} failed")
