"""Section 1: is every backend's attention, forward and backward, as exact as half precision allows?

Each case runs a backend on fp16 / bf16 inputs and compares out, dq, dk and dv with the reference
kernel in float32 on the same (rounded) inputs. What "exact enough" means is measured, not
assumed, the way FlashAttention's own tests do it: the same reference computed in the half
dtype sets the yardstick, and a backend passes when its error is at most `FACTOR` times that
yardstick's error (plus one rounding step at the output's scale, for cases the yardstick gets
exactly right, such as 1-token documents).

Cases: equal-length documents, shards with more keys than queries (bottom-right causal), 1-token
documents and queries, and random shard mixes; GQA ratios 1, 4 and 8. For GQA the torch backend
passes the KV heads through without copies (see flashcp.attention.kernels); this section also
compares that native path with explicitly repeated KV heads, which is the answer to "is native
GQA exact here".
"""

from __future__ import annotations

import random

import torch

from flashcp.attention.kernels import reference_attention, varlen_attention
from flashcp.gpucheck.report import Budget, Report, Section
from flashcp.gpucheck.sizes import Sizes

FACTOR = {"out": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
DTYPES = (torch.float16, torch.bfloat16)
GQA_RATIOS = (1, 4, 8)
COLUMNS = ["backend", "dtype", "gqa", "case", "tensor", "error", "yardstick", "tolerance", "ok",
           "sequences", "q_tokens", "k_tokens"]  # fmt: skip


def cases(sizes: Sizes, seed: int = 0) -> list[tuple[str, list[int], list[int]]]:
    """(name, q_lens, k_lens): the fixed edge cases, then random shard mixes."""
    m = sizes.exact_max_tokens
    fixed = [
        ("equal lengths", [m // 2, m // 4], [m // 2, m // 4]),
        ("more keys than queries", [m // 8, 7, m // 4], [m // 2, 7, m // 2]),
        ("1-token documents", [1] * 16, [1] * 16),
        ("1-token queries after prefixes", [1, 1, 1, 3], [1, m // 4, 9, 3]),
    ]
    rng = random.Random(seed)
    mixes = []
    for i in range(sizes.exact_mixes):
        n = rng.randint(1, 12)
        q_lens = [rng.choice([1, rng.randint(1, max(1, m // n))]) for _ in range(n)]
        k_lens = [lq + (0 if rng.random() < 0.4 else rng.randint(1, m)) for lq in q_lens]
        mixes.append((f"mix {i}", q_lens, k_lens))
    return fixed + mixes


def _cu(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def _run(fn, q, k, v, grad) -> list[torch.Tensor]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad)
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def check_case(backend: str, dtype: torch.dtype, ratio: int, q_lens: list[int], k_lens: list[int],
               sizes: Sizes, device: torch.device, gen: torch.Generator) -> list[dict]:  # fmt: skip
    """One case: the backend's error per tensor against the float32 reference, with its tolerance."""
    hkv, d = sizes.exact_kv_heads, sizes.exact_head_dim
    hq = hkv * ratio
    q, k, v = (
        torch.randn(sum(lens), h, d, generator=gen, device=device).to(dtype)
        for lens, h in ((q_lens, hq), (k_lens, hkv), (k_lens, hkv))
    )
    grad = torch.randn(sum(q_lens), hq, d, generator=gen, device=device).to(dtype)
    cu_q, cu_k = _cu(q_lens, device), _cu(k_lens, device)

    def reference(compute):
        return lambda q, k, v: reference_attention(q, k, v, cu_q, cu_k, compute_dtype=compute)

    exact = _run(reference(torch.float32), q, k, v, grad)
    yard = _run(reference(dtype), q, k, v, grad)
    got = _run(lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), backend=backend),
               q, k, v, grad)  # fmt: skip
    rows = []
    for name, e, y, g in zip(FACTOR, exact, yard, got):
        floor = torch.finfo(dtype).eps * float(e.abs().max()) if e.numel() else 0.0
        err, ystick = _max_err(g, e), _max_err(y, e)
        tol = FACTOR[name] * ystick + floor
        rows.append({"tensor": name, "error": err, "yardstick": ystick, "tolerance": tol, "ok": err <= tol})
    return rows


def native_gqa_difference(backend: str, dtype: torch.dtype, ratio: int, sizes: Sizes,
                          device: torch.device) -> float:  # fmt: skip
    """Largest difference (out, dq, dk, dv) between KV heads passed through and repeated per query
    head (dk / dv of the repeated path summed back over each group)."""
    gen = torch.Generator(device=device).manual_seed(1)
    q_lens, k_lens = [97, 1, 300], [161, 1, 300]
    hkv, d = sizes.exact_kv_heads, sizes.exact_head_dim
    q = torch.randn(sum(q_lens), hkv * ratio, d, generator=gen, device=device).to(dtype)
    k, v = (torch.randn(sum(k_lens), hkv, d, generator=gen, device=device).to(dtype) for _ in "kv")
    grad = torch.randn_like(q)
    cu_q, cu_k = _cu(q_lens, device), _cu(k_lens, device)

    def call(q, k, v):
        return varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), backend=backend)

    native = _run(call, q, k, v, grad)
    rep = _run(lambda q, k, v: call(q, k.repeat_interleave(ratio, 1), v.repeat_interleave(ratio, 1)), q, k, v, grad)
    return max(_max_err(a, b) for a, b in zip(native, rep))


def run(report: Report, sec: Section, device: torch.device, sizes: Sizes, budget: Budget,
        backends: list[str]) -> None:  # fmt: skip
    table = report.table("exactness", COLUMNS)
    all_cases = cases(sizes)
    done = 0
    for backend in backends:
        for dtype in DTYPES:
            for ratio in GQA_RATIOS:
                if budget.spent():
                    sec.status = "failed" if sec.failures else "cut short"
                    sec.lines.append(f"- budget spent after {done} cases")
                    return
                gen = torch.Generator(device=device).manual_seed(ratio)
                worst = {name: 0.0 for name in FACTOR}
                failed_before = len(sec.failures)
                for name, q_lens, k_lens in all_cases:
                    for row in check_case(backend, dtype, ratio, q_lens, k_lens, sizes, device, gen):
                        table.add(backend=backend, dtype=_name(dtype), gqa=ratio, case=name,
                                  sequences=len(q_lens), q_tokens=sum(q_lens), k_tokens=sum(k_lens), **row)
                        worst[row["tensor"]] = max(worst[row["tensor"]], row["error"] / max(row["tolerance"], 1e-30))
                        if not row["ok"]:
                            sec.failures.append(f"{backend} {dtype} GQA {ratio} {name} {row['tensor']}: error "
                                                f"{row['error']:.3g} > tolerance {row['tolerance']:.3g}")
                    done += 1
                verdict = "all within tolerance" if len(sec.failures) == failed_before else "FAILURES"
                line = (f"- {backend} {_name(dtype)} GQA {ratio}: {len(all_cases)} cases, {verdict}; worst error / "
                        "tolerance " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))
                if ratio > 1 and backend != "reference":
                    diff = native_gqa_difference(backend, dtype, ratio, sizes, device)
                    line += f"; native GQA vs repeated KV heads: max difference {diff:.3g}"
                sec.lines.append(line)
                print(line[2:], flush=True)
