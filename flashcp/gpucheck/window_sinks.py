"""Section 3: sliding windows with learned sinks (gpt-oss), forward and backward, against FlexAttention.

What is checked is the engine's `sink_attention(..., window=W)` (flashcp.attention.sinks: the kernel's
output and LSE corrected for the sink; backward = the kernel's backward from them plus the sink's
closed form) on every backend that takes sinks, in float32 and bfloat16: out, dq, dk, dv and dsinks,
on packed windows with 1-token documents, documents shorter than W and far longer, W = 1, W as long
as the longest document, no window, and a CP shard (more keys than queries, bottom-right). W follows
Hugging Face (a query sees its last W keys, itself included). Two implementations stand beside it:

- the truth: dense masked attention in float64 with the sink as one more softmax column, on the same
  rounded inputs and device (`dense_sink_attention`, plain torch and autograd, a document at a time).
  It shares no code with the engine's window tiles or sink correction: a wrong one cannot hide in both;
- FlexAttention (`torch.nn.attention.flex_attention`) with a document + sliding-window mask_mod, its
  LSE (`return_aux=AuxRequest(lse=True)`, torch >= 2.9) and the sink applied to that in plain torch,
  autograd running through the LSE (flex's backward takes its gradient). Flex has no direct sink.
  It runs uncompiled (its math implementation behind the same API: the mask's and the LSE's
  semantics, with no Triton kernel to build per shape), and not on a CPU, where flex refuses a
  backward: there the engine is checked against the truth only, and the summary says so.

Tolerances as in section 1, measured: the same attention computed densely in the input dtype is the
yardstick, in two forms (a plain softmax, and the kernels' own algorithm, `flash_form`), and an
implementation passes when it is at most `FACTOR` times as far from the truth as the worse of them,
plus a floor of rounding steps (`_rounding`): one step of the dtype and 1 + |LSE| float32 steps
(each probability is recomputed as exp(score - LSE) in float32), at one scale for out, dq, dk and
dv, since a gradient that cancels to small values (dq, dk where a probability near 1 faces its sink,
at W = 1) still carries the rounding of the products it cancelled; dsinks, a sum over tokens of
terms rounded apart, at the root sum of squares of their magnitudes. Both the flash form and the
floor are needed: the kernels' backward takes rowsum(dout * out) from the output rounded to the
dtype, and on the few heads of dsinks two implementations' errors differ by more than `FACTOR`.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Callable, Iterator

import torch

from flashcp.attention.kernels import BackendUnavailable, resolve_lse_backend
from flashcp.attention.sinks import sink_attention
from flashcp.gpucheck.exactness import FACTOR as KERNEL_FACTOR, _cu, _max_err, _name
from flashcp.gpucheck.report import Budget, Report, Section
from flashcp.gpucheck.sizes import Sizes

FACTOR = {**KERNEL_FACTOR, "dsinks": 3.0}
DTYPES = (torch.float32, torch.bfloat16)
ENGINE = ("torch", "flash_attn", "reference")  # the backends asked for sinks; those that refuse say why
COLUMNS = ["implementation", "dtype", "case", "window", "tensor", "against", "error", "yardstick", "tolerance",
           "ok", "documents", "q_tokens", "k_tokens"]  # fmt: skip

Case = tuple[str, list[int], list[int], int | None]  # name, q_lens, k_lens, window
Attention = Callable[..., torch.Tensor]  # (q, k, v, sinks) -> out


def cases(sizes: Sizes, seed: int = 0) -> list[Case]:
    """The fixed edge cases, then random mixes of short, window-long and long documents and shards."""
    m, w = sizes.ws_tokens, sizes.ws_window
    mixed = [1, w // 2, 1, w - 1, w + 1]
    mixed.append(m - sum(mixed))  # far longer than W
    shard_q, shard_k = [w // 2, 1, m // 4], [m // 2, w + 1, m // 2]
    fixed: list[Case] = [
        ("1-token documents, shorter than W and far longer", mixed, mixed, w),
        ("W = 1", [1, 5, m // 2], [1, 5, m // 2], 1),
        ("W = the longest document", [1, m // 8, m // 2], [1, m // 8, m // 2], m // 2),
        ("no window (full causal)", [m // 4, 1, m // 2], [m // 4, 1, m // 2], None),
        ("a CP shard: more keys than queries", shard_q, shard_k, w),
    ]
    rng = random.Random(seed)
    mixes: list[Case] = []
    for i in range(sizes.ws_mixes):
        q_lens = [rng.choice([1, rng.randint(1, w), rng.randint(w, 4 * w)]) for _ in range(rng.randint(1, 8))]
        while len(q_lens) > 1 and sum(q_lens) > m:
            q_lens.pop()
        k_lens = [lq + (rng.randint(1, 2 * w) if rng.random() < 0.3 else 0) for lq in q_lens]
        mixes.append((f"mix {i}", q_lens, k_lens, rng.choice([1, w, 2 * w, None])))
    return fixed + mixes


def _logits(q: torch.Tensor, k: torch.Tensor, sinks: torch.Tensor, q_lens: list[int], k_lens: list[int],
            window: int | None) -> Iterator[torch.Tensor]:  # fmt: skip
    """Per document, `[H, Lq, Lk + 1]`: the scores masked to each query's last `window` causal keys
    (bottom-right), then the sink's column."""
    group, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    q0 = k0 = 0
    for lq, lk in zip(q_lens, k_lens):
        keys = k[k0:k0 + lk].repeat_interleave(group, 1).transpose(0, 1)
        scores = q[q0:q0 + lq].transpose(0, 1) @ keys.transpose(1, 2) * scale
        last = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # each query's last visible key
        key = torch.arange(lk, device=q.device)[None, :]
        scores = scores.masked_fill((key > last) | (last - key >= (window or lk)), -math.inf)
        yield torch.cat([scores, sinks.to(q.dtype)[:, None, None].expand(-1, lq, 1)], -1)
        q0, k0 = q0 + lq, k0 + lk


def dense_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                         q_lens: list[int], k_lens: list[int], window: int | None) -> torch.Tensor:  # fmt: skip
    """The truth (in float64) and the yardstick (in the input dtype): one document at a time, the
    softmax over its masked scores and the sink's column, the column then dropped."""
    group, outs, k0 = q.shape[1] // k.shape[1], [], 0
    for logits, lk in zip(_logits(q, k, sinks, q_lens, k_lens, window), k_lens):
        values = v[k0:k0 + lk].repeat_interleave(group, 1).transpose(0, 1)
        outs.append((logits.softmax(-1)[..., :-1] @ values).transpose(0, 1))
        k0 += lk
    return torch.cat(outs)


def flash_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, grad: torch.Tensor,
               q_lens: list[int], k_lens: list[int], window: int | None) -> list[torch.Tensor]:  # fmt: skip
    """The yardstick's second form, the kernels' own algorithm done densely in the inputs' dtype (the
    LSE and row sums in at least float32): out from exp(logits - LSE), and the backward from that
    rounded out, delta = rowsum(dout * out), dS = P (dP - delta), dsinks = -sum exp(sink - LSE) delta.
    Its rounding (that delta cancelling against dP) is what a correct kernel carries too. Returns
    out, dq, dk, dv, dsinks in float64."""
    group, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    stat = torch.promote_types(q.dtype, torch.float32)
    out, dq = torch.empty_like(q, dtype=torch.float64), torch.empty_like(q, dtype=torch.float64)
    dk, dv = (torch.zeros(*t.shape, dtype=torch.float64, device=q.device) for t in (k, v))
    dsinks = torch.zeros(q.shape[1], dtype=stat, device=q.device)
    q0 = k0 = 0
    for logits, lq, lk in zip(_logits(q, k, sinks, q_lens, k_lens, window), q_lens, k_lens):
        rows, cols = slice(q0, q0 + lq), slice(k0, k0 + lk)
        queries, dout = q[rows].transpose(0, 1), grad[rows].transpose(0, 1)
        keys, values = (t[cols].repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        lse = logits.to(stat).logsumexp(-1, keepdim=True)
        probs = (logits[..., :-1].to(stat) - lse).exp().to(q.dtype)
        o = probs @ values
        delta = (o.to(stat) * dout.to(stat)).sum(-1, keepdim=True)
        ds = probs * (dout @ values.transpose(1, 2) - delta.to(q.dtype)) * scale
        dsinks -= (torch.exp(sinks.to(stat)[:, None] - lse[..., 0]) * delta[..., 0]).sum(1)
        out[rows], dq[rows] = o.transpose(0, 1).double(), (ds @ keys).transpose(0, 1).double()
        for acc, grads in ((dk, ds.transpose(1, 2) @ queries), (dv, probs.transpose(1, 2) @ dout)):
            acc[cols] = grads.double().unflatten(0, (k.shape[1], group)).sum(1).transpose(0, 1)
        q0, k0 = q0 + lq, k0 + lk
    return [out, dq, dk, dv, dsinks.double()]


def add_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """`out [T, H, D]` of a softmax whose log-sum-exp is `lse [H, T]`, with exp(sinks) added to every
    row's denominator; differentiable in all three (through `lse` too)."""
    lse = lse.float()
    weight = torch.exp(lse - torch.logaddexp(lse, sinks.float()[:, None]))
    return (out.float() * weight.T[..., None]).to(out.dtype)


def flex_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                        q_lens: list[int], k_lens: list[int], window: int | None) -> torch.Tensor:  # fmt: skip
    """FlexAttention with a document + sliding-window mask_mod, the sink applied to its LSE."""
    # Imported here: flex's first use loads TorchDynamo (seconds), which a CPU run never needs.
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    dev = q.device
    ql, kl = torch.tensor(q_lens, device=dev), torch.tensor(k_lens, device=dev)
    cu_q, cu_k = (torch.cat([lens.new_zeros(1), lens.cumsum(0)]) for lens in (ql, kl))
    doc_q = torch.repeat_interleave(torch.arange(len(q_lens), device=dev), ql)
    doc_k = torch.repeat_interleave(torch.arange(len(k_lens), device=dev), kl)
    # Query t of document s (bottom-right) sees keys up to cu_k[s] + (k_len - q_len) + t, the last `span`.
    last = torch.arange(q.shape[0], device=dev) - cu_q[doc_q] + cu_k[doc_q] + (kl - ql)[doc_q]
    span = torch.tensor(window or k.shape[0], device=dev)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_q[q_idx] == doc_k[kv_idx]) & (kv_idx <= last[q_idx]) & (last[q_idx] - kv_idx < span)

    mask = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[0], device=dev)
    with warnings.catch_warnings():  # uncompiled on purpose (module docstring)
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        out, aux = flex_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=mask,
                                  enable_gqa=q.shape[1] != k.shape[1], return_aux=AuxRequest(lse=True))  # fmt: skip
    return add_sink(out[0].transpose(0, 1), aux.lse[0], sinks)


def _run(fn: Attention, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    """out, dq, dk, dv, dsinks in float64."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach().double(), *(t.grad.double() for t in leaves)]


def _rounding(exact: list[torch.Tensor], grad: torch.Tensor, truth: list[torch.Tensor], q_lens: list[int],
              k_lens: list[int], window: int | None, dtype: torch.dtype) -> tuple[float, list[float]]:  # fmt: skip
    """The tolerance's floor as rounding steps and a scale per tensor (module docstring), from the
    float64 inputs and truth: one step of `dtype` plus 1 + |LSE| of float32; out, dq, dk and dv at
    their common scale; dsinks at its own or at the root sum of squares of its terms' magnitudes,
    exp(sink - LSE) * sum |out * dout| per token, whichever is larger."""
    q, k, _, sinks = exact
    lse = torch.cat([x.logsumexp(-1) for x in _logits(q, k, sinks, q_lens, k_lens, window)], 1)
    terms = torch.exp(sinks[:, None] - lse) * (truth[0] * grad).abs().sum(-1).T
    steps = torch.finfo(dtype).eps + torch.finfo(torch.float32).eps * (1 + float(lse.abs().max()))
    per_token = max(float(t.abs().max()) for t in truth[:4])
    dsinks = max(float(truth[4].abs().max()), float(terms.square().sum(1).sqrt().max()))
    return steps, [per_token] * 4 + [dsinks]


def _implementations(device: torch.device, dtype: torch.dtype, sizes: Sizes, sec: Section) -> list[str]:
    """The engine's backends that take sinks on `dtype` here (each refusal a summary line), and flex."""
    hq, hkv, d = sizes.ws_heads
    probe_q, probe_k = (torch.zeros(1, h, d, device=device, dtype=dtype) for h in (hq, hkv))
    names = []
    for name in ENGINE:
        try:
            names.append(resolve_lse_backend(name, probe_q, probe_k, purpose="sinks").name)
        except BackendUnavailable as e:
            sec.lines.append(f"- {name} {_name(dtype)}: refused: {e}")
    if device.type == "cpu":
        sec.lines.append(f"- flex {_name(dtype)}: not run: FlexAttention refuses a backward on CPU "
                         f"(torch {torch.__version__}); the engine is checked against the float64 truth only")
    else:
        names.append("flex")
    return names


def check_case(case: Case, dtype: torch.dtype, names: list[str], sizes: Sizes, device: torch.device,
               gen: torch.Generator) -> list[dict]:  # fmt: skip
    """One case in one dtype: every implementation's error per tensor against the truth (and the
    engine's against flex where flex ran), with its tolerance."""
    _, q_lens, k_lens, window = case
    hq, hkv, d = sizes.ws_heads
    q, k, v, grad = (torch.randn(sum(lens), h, d, generator=gen, device=device).to(dtype)
                     for lens, h in ((q_lens, hq), (k_lens, hkv), (k_lens, hkv), (q_lens, hq)))  # fmt: skip
    sinks = (3 * torch.randn(hq, generator=gen, device=device)).to(dtype)  # from negligible to dominant
    inputs = [q, k, v, sinks]
    cu_q, cu_k = _cu(q_lens, device), _cu(k_lens, device)

    def engine(backend: str) -> Attention:
        shape = (cu_q, cu_k, max(q_lens), max(k_lens))
        return lambda q, k, v, s: sink_attention(q, k, v, s, *shape, backend=backend, window=window)

    def oracle(fn: Callable[..., torch.Tensor]) -> Attention:
        return lambda q, k, v, s: fn(q, k, v, s, q_lens, k_lens, window)

    exact = [t.double() for t in inputs]
    truth = _run(oracle(dense_sink_attention), exact, grad.double())
    softmax = _run(oracle(dense_sink_attention), inputs, grad)
    with torch.no_grad():
        flash = flash_form(*inputs, grad, q_lens, k_lens, window)
        for tensor, a, b in zip(FACTOR, flash_form(*exact, grad.double(), q_lens, k_lens, window), truth):
            if _max_err(a, b) > 1e-9 * max(1.0, float(b.abs().max())):  # else it would widen every tolerance
                raise RuntimeError(f"the yardstick's flash form is wrong: its float64 {tensor} is "
                                   f"{_max_err(a, b):.3g} off the truth")  # fmt: skip
        steps, scales = _rounding(exact, grad.double(), truth, q_lens, k_lens, window, dtype)
    got = {name: _run(oracle(flex_sink_attention) if name == "flex" else engine(name), inputs, grad)
           for name in names}  # fmt: skip
    rows = []
    for i, tensor in enumerate(FACTOR):
        ystick = max(_max_err(softmax[i], truth[i]), _max_err(flash[i], truth[i]))
        tol = FACTOR[tensor] * ystick + steps * scales[i]
        for name, result in got.items():
            err = _max_err(result[i], truth[i])
            rows.append({"implementation": name, "tensor": tensor, "against": "float64", "error": err,
                         "yardstick": ystick, "tolerance": tol, "ok": err <= tol})  # fmt: skip
            if name != "flex" and "flex" in got:  # both within tol of the truth: within 2 tol of each other
                err = _max_err(result[i], got["flex"][i])
                rows.append({"implementation": name, "tensor": tensor, "against": "flex", "error": err,
                             "yardstick": ystick, "tolerance": 2 * tol, "ok": err <= 2 * tol})  # fmt: skip
    return rows


def run(report: Report, sec: Section, device: torch.device, sizes: Sizes, budget: Budget,
        backends: list[str]) -> None:  # fmt: skip
    """Every case in float32, then in bfloat16. `backends` (the fast kernels) is not used: every backend of
    `ENGINE` is asked for sinks, so a refusal (flash_attn has no LSE backward, torch no float32) is said."""
    table = report.table("window_sinks", COLUMNS)
    all_cases = cases(sizes)
    done = 0
    for dtype in DTYPES:
        names = _implementations(device, dtype, sizes, sec)
        gen = torch.Generator(device=device).manual_seed(0)
        worst: dict[tuple[str, str], dict[str, float]] = {}
        for case in all_cases:
            if budget.spent():
                sec.status = "failed" if sec.failures else "cut short"
                sec.lines.append(f"- budget spent after {done} cases")
                return
            name, q_lens, k_lens, window = case
            for row in check_case(case, dtype, names, sizes, device, gen):
                table.add(dtype=_name(dtype), case=name, window=window or "none", documents=len(q_lens),
                          q_tokens=sum(q_lens), k_tokens=sum(k_lens), **row)  # fmt: skip
                ratios = worst.setdefault((row["implementation"], row["against"]), dict.fromkeys(FACTOR, 0.0))
                ratios[row["tensor"]] = max(ratios[row["tensor"]], row["error"] / max(row["tolerance"], 1e-30))
                if not row["ok"]:
                    sec.failures.append(f"{row['implementation']} {_name(dtype)} {name} (W = {window}) "
                                        f"{row['tensor']} against {row['against']}: error {row['error']:.3g} > "
                                        f"tolerance {row['tolerance']:.3g}")  # fmt: skip
            done += 1
        for (impl, against), ratios in worst.items():
            verdict = "all within tolerance" if max(ratios.values()) <= 1 else "FAILURES"
            line = (f"- {impl} {_name(dtype)} against {against}: {len(all_cases)} cases, {verdict}; worst "
                    "error / tolerance " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
            sec.lines.append(line)
            print(line[2:], flush=True)
