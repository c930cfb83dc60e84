"""The varlen attention interface: the reference kernel against a dense oracle, backend choice.

The dense oracle below shares nothing with the reference kernel: it builds the whole
[Tq, Tk] mask of the packed problem from first principles and runs one softmax over it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.attention import BackendUnavailable, varlen_attention
from flashcp.attention.kernels import BACKENDS, resolve_backend


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)


def dense_attention(q, k, v, q_lens, k_lens, causal=True, scale=None):
    """softmax(q k^T * scale + mask) v over the whole packed problem, float64."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    seq_q = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    seq_k = torch.repeat_interleave(torch.arange(len(k_lens)), torch.tensor(k_lens))
    pos_q = torch.cat([torch.arange(n) for n in q_lens])
    pos_k = torch.cat([torch.arange(n) for n in k_lens])
    # Bottom-right alignment: query j of (Lq, Lk) sits at key position j + Lk - Lq.
    shift = (torch.tensor(k_lens) - torch.tensor(q_lens))[seq_q]
    mask = seq_q[:, None] == seq_k[None, :]
    if causal:
        mask &= pos_k[None, :] <= (pos_q + shift)[:, None]
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, vv)


def _problem(q_lens, k_lens, hq, hkv, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(sum(k_lens), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(k_lens), hkv, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _grads(fn, q, k, v, weight):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    (out.double() * weight).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@st.composite
def varlen_problems(draw):
    n = draw(st.integers(1, 5))
    q_lens = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    # Keys: a (possibly empty) prefix before each query sequence, as a CP shard sees.
    k_lens = [lq + draw(st.integers(0, 10)) for lq in q_lens]
    hkv = draw(st.sampled_from([1, 2]))
    hq = hkv * draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([1, 4, 8]))
    causal = draw(st.booleans())
    scale = draw(st.sampled_from([None, 0.3]))
    return q_lens, k_lens, hq, hkv, d, causal, scale


@settings(max_examples=60, deadline=None)
@given(varlen_problems())
def test_reference_matches_dense_attention(problem):
    q_lens, k_lens, hq, hkv, d, causal, scale = problem
    q, k, v = _problem(q_lens, k_lens, hq, hkv, d)
    weight = torch.randn(sum(q_lens), hq, d, dtype=torch.float64)

    def ref(q, k, v):
        return varlen_attention(
            q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens),
            causal=causal, softmax_scale=scale, backend="reference",
        )  # fmt: skip

    got = _grads(ref, q, k, v, weight)
    want = _grads(lambda q, k, v: dense_attention(q, k, v, q_lens, k_lens, causal, scale), q, k, v, weight)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def _sdpa(q, k, v, q_lens, k_lens, scale=None):
    """torch's scaled_dot_product_attention (math path, float64) under the packed problem's
    document mask with bottom-right causal alignment, as one [Tq, Tk] boolean mask."""
    seq_q = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    seq_k = torch.repeat_interleave(torch.arange(len(k_lens)), torch.tensor(k_lens))
    pos_q = torch.cat([torch.arange(n) for n in q_lens]) + (torch.tensor(k_lens) - torch.tensor(q_lens))[seq_q]
    pos_k = torch.cat([torch.arange(n) for n in k_lens])
    mask = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    return out.transpose(0, 1)


@pytest.mark.parametrize("dims", [(24, 16), (12, 20), (3, 8)], ids=["qk>v (MLA)", "qk<v", "qk 3, v 8"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["MHA", "GQA"])
def test_reference_with_another_v_head_dim_matches_sdpa(dims, heads, monkeypatch):
    """V may be narrower or wider than Q and K (MLA: 192 / 128): output and gradients equal
    torch's SDPA in float64, with tiles of a few rows so that every path of the kernel runs."""
    from flashcp.attention import reference

    monkeypatch.setattr(reference, "BLOCK_Q", 5)
    monkeypatch.setattr(reference, "BLOCK_K", 7)
    (dqk, dv), (hq, hkv) = dims, heads
    q_lens, k_lens = [9, 1, 23], [30, 1, 23]  # a shard with a prefix, a 1-token document, a whole one
    q, k, _ = _problem(q_lens, k_lens, hq, hkv, dqk)
    v = torch.randn(sum(k_lens), hkv, dv, dtype=torch.float64)
    weight = torch.randn(sum(q_lens), hq, dv, dtype=torch.float64)

    def ref(q, k, v):
        return varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), 23, 30, backend="reference")

    got = _grads(ref, q, k, v, weight)
    want = _grads(lambda q, k, v: _sdpa(q, k, v, q_lens, k_lens), q, k, v, weight)
    assert got[0].shape == (sum(q_lens), hq, dv)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_flash_backends_get_one_head_dim(monkeypatch):
    """A backend that takes one head dim (FlashAttention-2) gets Q, K, V zero-padded to the larger
    one and its output cut back to V's: the same result and gradients as the unpadded kernel."""
    from flashcp.attention import kernels

    seen = []

    def one_dim_run(q, k, v, *args):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return kernels._reference_run(q, k, v, *args)

    monkeypatch.setitem(kernels.BACKENDS, "torch", kernels.Backend("torch", lambda q, k: None, one_dim_run))
    q_lens, k_lens = [6, 1, 11], [15, 1, 11]
    q, k, _ = _problem(q_lens, k_lens, 4, 4, 12)
    v = torch.randn(sum(k_lens), 4, 8, dtype=torch.float64)
    weight = torch.randn(sum(q_lens), 4, 8, dtype=torch.float64)

    def run(backend):
        return lambda q, k, v: varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), 11, 15, backend=backend)

    got, want = _grads(run("torch"), q, k, v, weight), _grads(run("reference"), q, k, v, weight)
    assert seen == [(12, 12, 12)] and got[0].shape == want[0].shape == (sum(q_lens), 4, 8)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=name)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_sequences_longer_than_a_query_block(causal):
    """Sequences spanning several reference query blocks (and a few rows more or fewer keys)."""
    q_lens, k_lens = [1100, 3, 700], [1500, 3, 650]
    q, k, v = _problem(q_lens, k_lens, 2, 1, 4)
    weight = torch.randn(sum(q_lens), 2, 4, dtype=torch.float64)

    def ref(q, k, v):
        return varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), 1100, 1500, causal=causal)

    got = _grads(ref, q, k, v, weight)
    want = _grads(lambda q, k, v: dense_attention(q, k, v, q_lens, k_lens, causal), q, k, v, weight)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_shard_with_prefix_equals_rows_of_whole_document():
    """The CP property: a query shard over (prefix + itself) reproduces the document's rows."""
    length, start, size = 37, 11, 9
    q, k, v = _problem([length], [length], 4, 2, 8)
    whole = varlen_attention(q, k, v, _cu([length]), _cu([length]), length, length)
    end = start + size
    shard = varlen_attention(q[start:end], k[:end], v[:end], _cu([size]), _cu([end]), size, end)
    torch.testing.assert_close(shard, whole[start:end], rtol=1e-12, atol=1e-12)


def test_query_without_visible_key_gives_zero_and_finite_grads():
    # 5 queries over 3 keys, causal bottom-right: the first two queries see nothing.
    q, k, v = (t.requires_grad_() for t in _problem([5], [3], 2, 1, 4))
    out = varlen_attention(q, k, v, _cu([5]), _cu([3]), 5, 3)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[:2], torch.zeros_like(q.grad[:2]))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_reference_low_precision(dtype, tol):
    """Low-precision inputs are computed in float32 and returned in their own dtype."""
    q_lens, k_lens = [7, 3, 12], [9, 3, 20]
    q, k, v = _problem(q_lens, k_lens, 4, 2, 16, dtype=dtype)
    out = varlen_attention(q, k, v, _cu(q_lens), _cu(k_lens), 12, 20)
    assert out.dtype == dtype
    want = dense_attention(q, k, v, q_lens, k_lens)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_auto_backend_on_cpu_is_reference():
    q, k, _ = _problem([4], [4], 2, 2, 8, dtype=torch.bfloat16)
    assert resolve_backend("auto", q, k).name == "reference"


@pytest.mark.parametrize("name, reason", [("flash_attn", "flash"), ("torch", "CUDA")])
def test_unavailable_backend_says_why(name, reason):
    q, k, _ = _problem([4], [4], 2, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailable, match=reason):
        resolve_backend(name, q, k)


def test_bad_inputs_are_named():
    q, k, v = _problem([4], [4], 3, 2, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        varlen_attention(q, k, v, _cu([4]), _cu([4]), 4, 4)
    q, k, v = _problem([4], [4], 2, 2, 8)
    with pytest.raises(ValueError, match="dtypes differ"):
        varlen_attention(q, k.float(), v, _cu([4]), _cu([4]), 4, 4)
    with pytest.raises(ValueError, match="unknown attention backend"):
        varlen_attention(q, k, v, _cu([4]), _cu([4]), 4, 4, backend="triton")


@pytest.mark.parametrize("has_flag", [False, True], ids=["torch-2.11", "torch-2.12+"])
def test_torch_backend_passes_kv_heads_through(monkeypatch, has_flag):
    """GQA reaches torch's varlen_attn with Hkv heads (no repeated K/V): 4x less KV for Llama 3 8B."""
    import torch.nn.attention.varlen as varlen_module

    from flashcp.attention import kernels

    seen = {}

    def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, **kwargs):
        seen.update(k_heads=k.shape[1], v_heads=v.shape[1], window=window_size, **kwargs)
        return q.new_zeros(q.shape)

    params = {"query", "key", "value", "scale", "window_size"} | ({"enable_gqa"} if has_flag else set())
    monkeypatch.setattr(varlen_module, "varlen_attn", fake_varlen_attn)
    monkeypatch.setattr(kernels, "_torch_varlen_params", lambda: frozenset(params))
    q, k, v = _problem([5, 3], [9, 3], 8, 2, 16, dtype=torch.bfloat16)
    kernels.BACKENDS["torch"].run(q, k, v, _cu([5, 3]), _cu([9, 3]), 5, 9, True, 0.25)
    assert (seen["k_heads"], seen["v_heads"], seen["window"]) == (2, 2, (-1, 0))
    assert seen.get("enable_gqa", False) is has_flag


_gpu_backends = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason=f"{name} backend needs a CUDA GPU (none visible)"
        ),
    )
    for name in BACKENDS
    if name != "reference"
]


@pytest.mark.parametrize("name", _gpu_backends)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_backend_matches_reference(name, dtype):
    q_lens, k_lens, hq, hkv, d = [100, 7, 300], [164, 7, 300], 8, 2, 64
    q, k, v = (t.cuda() for t in _problem(q_lens, k_lens, hq, hkv, d, dtype=dtype))
    cu_q, cu_k = _cu(q_lens).cuda(), _cu(k_lens).cuda()
    try:
        resolve_backend(name, q, k)
    except BackendUnavailable as e:
        pytest.skip(str(e))
    weight = torch.randn(sum(q_lens), hq, d, dtype=torch.float64, device="cuda")

    def run(backend):
        return lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, 300, 300, backend=backend)

    got = _grads(run(name), q, k, v, weight)
    want = _grads(run("reference"), q, k, v, weight)
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=3e-2, atol=3e-2, msg=label)
