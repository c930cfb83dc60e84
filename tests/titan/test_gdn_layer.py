"""FlashCP's Gated DeltaNet layer (`flashcp.titan.models.gated_deltanet`) against transformers' Qwen3.5 layer.

transformers' torch fallback ignores cu_seqlens, so the oracle runs `Qwen3_5GatedDeltaNet` on each
document alone and concatenates. FlashCP's layer (TorchTitan's parameters, loaded from the HF
layer's as TorchTitan's adapter splits them) runs the packed window: at CP 1, then on a gloo pool at
CP 2 over layouts that cut documents (one cut inside a document shorter than the conv width). The
window holds a 1-token document and one shorter than the conv width, chunks of 4 tokens make the
longest documents span several, and 4 value heads share 2 key heads. Outputs and the gradients of
the input and of every parameter (conv weight, A_log, dt_bias included) agree within 1e-10 in
float64. The fallback hard-codes float32 (`.to(torch.float32)`, `.float()`), so the float64 oracle
reads both as "at least float32" while it runs (`at_least_float32`); unpatched, in float32, it
agrees within 5e-5 of each tensor's largest entry.
"""

from __future__ import annotations

import contextlib
import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from flashcp import plan_shards
from flashcp.attention.linear_dispatch import build_linear_dispatch
from flashcp.plan.linear import doc_pieces
from flashcp.plan.plan import Plan
from flashcp.titan.compat import import_qwen3_5
from flashcp.titan.models.gated_deltanet import flashcp_deltanet, LinearStep
from tests.test_linear_cp import short_pieces

DIM, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, WIDTH, CHUNK = 16, 2, 4, 4, 3, 4, 4
DOCS = [13, 1, 2, 9, 5]
TOL = 1e-10
HF_CONFIG = Qwen3_5TextConfig(
    hidden_size=DIM, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
    linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM, linear_conv_kernel_dim=WIDTH,
    num_hidden_layers=4, rms_norm_eps=1e-6, vocab_size=32,
)  # fmt: skip
SPLIT = [KEY_HEADS * KEY_DIM, KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM]  # HF's fused q / k / v rows
LAYOUTS = {
    "flashcp": lambda: plan_shards(DOCS, 2, "flashcp"),
    "contiguous halves (a cut inside the 2-token document)": lambda: plan_shards(DOCS, 2, "per_seq"),
    "pieces shorter than the conv width": lambda: short_pieces(2),
}


# transformers binds flash-linear-attention's (and causal-conv1d's) CUDA kernels in place of these
# at import when the packages are installed; the oracle is their torch reference on CPU.
HF_KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
              "causal_conv1d_update")  # fmt: skip


@contextlib.contextmanager
def torch_kernels(*modules: types.ModuleType):
    """transformers' Qwen3.5 module (or `modules`, e.g. Qwen3-Next's) on its torch kernels."""
    with pytest.MonkeyPatch.context() as mp:
        for module in modules or (modeling_qwen3_5,):
            for name in HF_KERNELS:
                if hasattr(module, name):
                    mp.setattr(module, name, inspect.unwrap(getattr(module, name)))
        yield


@contextlib.contextmanager
def at_least_float32(*modules: types.ModuleType):
    """`torch_kernels`, with the modules' float32 casts read as "at least float32" (float64 stays)."""
    torch64 = types.ModuleType("torch")
    torch64.__dict__.update(vars(torch))
    torch64.float32 = torch.float64
    with torch_kernels(*modules), pytest.MonkeyPatch.context() as mp:
        for module in modules or (modeling_qwen3_5,):
            mp.setattr(module, "torch", torch64)
        mp.setattr(torch.Tensor, "float", lambda t: t.to(torch.promote_types(t.dtype, torch.float32)))
        yield


def hf_layer(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """transformers' layer with random parameters (norm weight and dt_bias too, so that each matters)."""
    torch.manual_seed(seed)
    layer = modeling_qwen3_5.Qwen3_5GatedDeltaNet(HF_CONFIG, layer_idx=0).to(dtype)
    with torch.no_grad():
        layer.norm.weight.add_(0.3 * torch.randn_like(layer.norm.weight))
        layer.dt_bias.copy_(torch.randn_like(layer.dt_bias))
        layer.conv1d.weight.mul_(2.0)
    return layer


def titan_state(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF layer's tensors by TorchTitan's names (fused q / k / v and conv split, as its adapter)."""
    q, k, v = hf["in_proj_qkv.weight"].split(SPLIT)
    cq, ck, cv = hf["conv1d.weight"].split(SPLIT)
    rest = {n: hf[n] for n in ("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias",
                               "norm.weight", "out_proj.weight")}  # fmt: skip
    return {"in_proj_q.weight": q, "in_proj_k.weight": k, "in_proj_v.weight": v,
            "conv_q.weight": cq, "conv_k.weight": ck, "conv_v.weight": cv, **rest}  # fmt: skip


def window(dtype: torch.dtype, context: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's hidden states and the output's cotangent."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(context, DIM, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))


def oracle(dtype: torch.dtype, doc_lens: list[int], patched: bool):
    """transformers on each document alone: output, dx and TorchTitan-named parameter gradients."""
    layer = hf_layer(dtype)
    x, gy = window(dtype, sum(doc_lens))
    x.requires_grad_()
    with at_least_float32() if patched else torch_kernels():
        y = torch.cat([layer(doc[None])[0] for doc in x.split(doc_lens)])
    (y * gy).sum().backward()
    grads = titan_state({n: p.grad for n, p in layer.named_parameters()})
    return y.detach(), x.grad, grads


def flashcp_layer() -> torch.nn.Module:
    """FlashCP's layer from TorchTitan's Qwen3.5 builder at the test's sizes (parameters uninitialised)."""
    config = import_qwen3_5()._qwen35_deltanet_config(
        dim=DIM, n_key_heads=KEY_HEADS, n_value_heads=VALUE_HEADS, key_head_dim=KEY_DIM,
        value_head_dim=VALUE_DIM, layer_id=0, conv_kernel_size=WIDTH,
    )  # fmt: skip
    return flashcp_deltanet(config, chunk_size=CHUNK).build()


def run_flashcp(rank: int, group, plans: list[Plan], state: dict[str, torch.Tensor], dtype: torch.dtype):
    """Worker: FlashCP's layer on this rank's rows of each plan's window, forward and backward."""
    layer = flashcp_layer().to(dtype)
    layer.load_state_dict(state)
    out = []
    for plan in plans:
        layer.zero_grad()
        d = build_linear_dispatch(plan, rank, WIDTH)
        x, gy = (t[d.token_index] for t in window(dtype, plan.context))
        x.requires_grad_()
        y = layer(x[None], LinearStep(d, group))[0]
        (y * gy).sum().backward()
        out.append((d.token_index, y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
    return out


def gathered(per_rank: list, context: int):
    """Ranks' rows back in window order; parameter gradients summed over the ranks."""
    y, dx = (torch.zeros(context, DIM, dtype=per_rank[0][1].dtype) for _ in range(2))
    grads = {n: sum(r[3][n] for r in per_rank) for n in per_rank[0][3]}
    for index, y_r, dx_r, _ in per_rank:
        y[index], dx[index] = y_r, dx_r
    return y, dx, grads


def assert_close(what: str, got, want, tol: float, relative: bool = False) -> None:
    """Every tensor within `tol`, absolute or (`relative`) of the tensor's largest entry."""
    (y, dx, grads), (y_w, dx_w, grads_w) = got, want
    assert set(grads) == set(grads_w) and len(grads) == 13, sorted(grads)
    for name, a, b in [("y", y, y_w), ("dx", dx, dx_w)] + [(f"d{n}", grads[n], grads_w[n]) for n in grads]:
        error = (a - b).abs().max() / (b.abs().max() if relative else 1)
        assert a.shape == b.shape and error < tol, f"{what} {name}: {error:.3g}"


@pytest.fixture(scope="module")
def state64() -> dict[str, torch.Tensor]:
    return titan_state(hf_layer(torch.float64).state_dict())


def test_cp1_matches_transformers_per_document_in_float64(state64):
    plan = plan_shards(DOCS, 1, "per_doc")
    assert list(plan.doc_lens) == DOCS
    (result,) = run_flashcp(0, None, [plan], state64, torch.float64)
    assert_close("CP 1", gathered([result], plan.context), oracle(torch.float64, DOCS, patched=True), TOL)


def test_cp1_matches_unpatched_transformers_in_float32():
    state = titan_state(hf_layer(torch.float32).state_dict())
    plan = plan_shards(DOCS, 1, "per_doc")
    (result,) = run_flashcp(0, None, [plan], state, torch.float32)
    want = oracle(torch.float32, DOCS, patched=False)
    assert_close("CP 1 float32", gathered([result], plan.context), want, 5e-5, relative=True)


def test_cp2_matches_cp1_with_every_gradient(gloo_pool, state64):
    plans = [make() for make in LAYOUTS.values()]
    assert all(any(len(p) > 1 for p in doc_pieces(plan)) for plan in plans)  # every layout cuts a document
    per_rank = gloo_pool(2).run(run_flashcp, (plans, state64, torch.float64))
    for case, (layout, plan) in enumerate(zip(LAYOUTS, plans)):
        one_rank = plan_shards(list(plan.doc_lens), 1, "per_doc")
        (single,) = run_flashcp(0, None, [one_rank], state64, torch.float64)
        want = gathered([single], plan.context)
        assert_close(f"CP 2 {layout}", gathered([rank[case] for rank in per_rank], plan.context), want, TOL)


def test_wrong_step_is_refused_in_one_line():
    layer, x = flashcp_layer(), torch.zeros(1, 3, DIM)
    with pytest.raises(TypeError, match="LinearStep"):
        layer(x, None)
    with pytest.raises(ValueError, match="conv width 2"):
        layer(x, LinearStep(build_linear_dispatch(plan_shards([3], 1, "per_doc"), 0, conv_width=2), None))


# Run in a fresh interpreter with fla hidden (None in sys.modules: not importable, and find_spec says
# absent), so the stub path runs whether or not flash-linear-attention is installed here.
WITHOUT_FLA = """
import sys
import torch
sys.modules["fla"] = None
from flashcp.titan.compat import import_qwen3_5
model = import_qwen3_5().model
assert not any(m.split(".")[0] == "fla" for m in sys.modules), sorted(m for m in sys.modules if m.startswith("fla"))
for call, match in ((model._fla_chunk_gated_delta_rule, "flash-linear-attention is not installed"),
                    (lambda: model.ChunkGatedDeltaRuleFunction.apply(torch.zeros(1)), "chunk.ChunkGatedDeltaRuleFunction was called")):
    try:
        call()
    except RuntimeError as e:
        assert match in str(e), e
    else:
        raise AssertionError(f"{call} ran without fla")
print("ok")
"""


def test_qwen3_5_imports_without_fla_whose_stubs_raise_and_leave_no_module():
    run = subprocess.run([sys.executable, "-c", WITHOUT_FLA], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
