"""Head-group attention (flashcp.titan.models.head_groups) is TorchTitan's attention layer with FlashCP's
op: in float64 a decoder block whose attention runs over G = 1, 2 or 4 groups of KV heads and whose
norms, MLP and residual run over 3 sequence tiles gives the plain block's output and the gradients of
its input and of every weight within 1e-12 at CP 1, 2 and 4 with every KV exchange, and its forward
saves no tensor of all heads; a trainer with `head_groups = 2` trains the plain job's
losses (20 windows at CP 2 x FSDP 2 and CP 4 with full AC in the slow tier, eager and compiled), and a
compiled layer is one graph with the eager results; the job check refuses what it does not run, in one
line naming the key."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
from harness import tiny_job, train_on_pool_rank

import flashcp.titan  # noqa: F401  (TorchTitan shims before torchtitan)
from flashcp.attention import build_two_level_dispatch
from flashcp.attention.ring import build_ring_dispatch
from flashcp.dispatch import build_dispatch
from flashcp.plan import plan_shards
from flashcp.titan.config import ConfigError, validate
from flashcp.titan.models import attention
from flashcp.titan.models.attention import CPStep, flashcp_ropes
from flashcp.titan.models.head_groups import AUTO, group_count, HeadGroupedAttention, use_head_groups
from flashcp.titan.models.spec import model_spec
from flashcp.titan.models.tiled_block import TiledTransformerBlock, use_tiled_blocks
from torchtitan.models.common.rope import CosSinRoPE

DOC_LENS = (21, 3, 30, 10)  # 64 tokens: documents cut across ranks at CP 2 and 4
TOLERANCE = 1e-12  # absolute, float64: the output projection's and the tiles' summation order only
TILES = 3  # sequence tiles of the block's norms, MLP and residual (not dividing a rank's rows)
MODELS = {"llama3": {"name": "llama3"}, "qwen3": {"name": "qwen3", "head_dim": 12}}  # qwen3: QK-norm, own head_dim
COMMS = ("compact", "needed", "two_level", "ring")


def _rotate_in_dtype(config, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """TorchTitan's rotation of q and k computed in their dtype: its own rotates in float32, which turns the
    projections' 1e-16 differences of summation order into float32 roundings (6e-10 in float64 runs)."""
    rows = rows[None, :, None, :]

    def rotated(t: torch.Tensor) -> torch.Tensor:
        if rows.is_complex():
            pairs = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * rows).flatten(3)
        cos, sin = rows.to(t.dtype).split(t.shape[-1], dim=-1)
        return t * cos + CosSinRoPE._rotate_half(t) * sin

    return rotated(q), rotated(k)


@contextlib.contextmanager
def _float64_rope() -> Iterator[None]:
    saved, attention.rotate = attention.rotate, _rotate_in_dtype
    try:
        yield
    finally:
        attention.rotate = saved


def _blocks(name: str, groups: int, prefetch: bool = False) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    """(the plain decoder block, the same weights with its attention over `groups` head groups (each
    group's exchange launched ahead with `prefetch`) and its token-wise work over TILES sequence tiles,
    the model's RoPEs), float64."""
    model = {"flavor": "custom", "dim": 64, "n_layers": 1, "n_heads": 8, "n_kv_heads": 4, "multiple_of": 32,
             "vocab_size": 97} | MODELS[name]  # fmt: skip
    cfg = validate({"model": model, "flashcp": {"backend": "reference"}, "training": {"seq_len": sum(DOC_LENS)}})
    config = model_spec(cfg["model"], cfg["flashcp"], 97, sum(DOC_LENS)).model
    grouped = copy.deepcopy(config)
    use_head_groups(grouped, groups, prefetch)
    use_tiled_blocks(grouped, TILES)
    torch.manual_seed(0)
    plain = config.build()
    plain.init_states()
    ropes = flashcp_ropes(plain)
    plain_block, grouped_block = plain.layers["0"].double(), grouped.build().layers["0"].double()
    assert isinstance(grouped_block, TiledTransformerBlock)
    assert isinstance(grouped_block.attention, HeadGroupedAttention) == (groups != 1)  # 1: the plain attention
    assert set(grouped_block.state_dict()) == set(plain_block.state_dict())  # checkpoints load either way
    for p in plain_block.parameters():  # norm weights off 1, so their gradients are not trivial
        p.data.add_(0.1 * torch.randn_like(p))
    grouped_block.load_state_dict(plain_block.state_dict())
    return plain_block, grouped_block, ropes


def _dispatch(comm: str, cp: int, rank: int):
    plan = plan_shards(DOC_LENS, cp, "flashcp")
    if comm == "two_level":
        return build_two_level_dispatch(plan, rank, ranks_per_node=max(1, cp // 2))
    return build_ring_dispatch(plan, rank) if comm == "ring" else build_dispatch(plan, rank, comm)


def _run(layer: torch.nn.Module, ropes: dict, dispatch, group) -> tuple[list[torch.Tensor], list[tuple]]:
    """Output, input and weight gradients of a block on this rank's rows; the shapes forward saved."""
    gen = torch.Generator().manual_seed(1)
    x_all, g_all = torch.randn(2, 1, sum(DOC_LENS), 64, generator=gen, dtype=torch.float64)
    x, g = x_all[:, dispatch.token_index].clone().requires_grad_(), g_all[:, dispatch.token_index]
    saved: list[tuple] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    layer.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, CPStep.of(ropes, dispatch, group), dispatch.positions[None])
    (out * g).sum().backward()
    return [out.detach(), x.grad, *(p.grad for _, p in sorted(layer.named_parameters()))], saved


def compare_rank(rank: int, group, name: str, cp: int) -> dict[tuple[str, int], float]:
    """DistributedPool task (and the CP 1 case in process): max |grouped - plain| over the output and
    gradients, by (comm, groups, prefetch)."""
    worst = {}
    for groups, prefetch in ((1, False), (2, False), (4, False), (4, True)):
        plain, grouped, ropes = _blocks(name, groups, prefetch)
        for comm in COMMS[:-1] if prefetch else COMMS:  # the ring has no exchange to launch ahead
            dispatch = _dispatch(comm, cp, rank)
            with _float64_rope():
                want, _ = _run(plain, ropes, dispatch, group)
                got, saved = _run(grouped, ropes, dispatch, group)
            if groups != 1:  # no q, k, v or o of every head kept
                heads = (plain.attention.n_heads, plain.attention.n_kv_heads)
                assert not [s for s in saved if len(s) == 4 and s[2] in heads], saved
            worst[comm, groups, prefetch] = max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
    return worst


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_head_groups_equal_the_plain_layer(gloo_pool, name, cp):
    runs = [compare_rank(0, None, name, cp)] if cp == 1 else gloo_pool(4, sizes=(2, 4)).run(
        compare_rank, (name, cp), size=cp)  # fmt: skip
    worst = {case: max(run[case] for run in runs) for case in runs[0]}
    print(f"{name} CP {cp}, G = 1, 2, 4 (and 4 with prefetch), {', '.join(COMMS)}: max |grouped - plain| "
          f"{max(worst.values()):.1e}")  # fmt: skip
    assert max(worst.values()) <= TOLERANCE, worst


def prefetch_rank(rank: int, group, block_checkpoint: bool) -> tuple[dict[bool, str], dict[bool, list], int]:
    """DistributedPool task: with 4 groups at CP 2 (compact), the order of KV exchange launches (L) and kernel
    calls (K) in forward and backward, and the collectives' records, without and with prefetch; the
    exchanges launched ahead left registered afterwards. `block_checkpoint`: the block under full AC."""
    from flashcp.attention import collectives, cp, op
    from torch.utils.checkpoint import checkpoint

    events: list[str] = []

    def logged(name: str, fn):
        def call(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)

        return call

    orders, records = {}, {}
    for prefetch in (False, True):
        _, grouped, ropes = _blocks("llama3", 4, prefetch)
        dispatch = _dispatch("compact", 2, rank)
        step = CPStep.of(ropes, dispatch, group)
        x = torch.randn(1, dispatch.token_index.numel(), 64, dtype=torch.float64, requires_grad=True)
        saved = collectives.launch_exchange, cp._kernel
        collectives.launch_exchange, cp._kernel = logged("L", saved[0]), logged("K", saved[1])
        events.clear()
        try:
            with collectives.record_comm() as log, _float64_rope():
                if block_checkpoint:
                    out = checkpoint(grouped, x, step, dispatch.positions[None], use_reentrant=False)
                else:
                    out = grouped(x, step, dispatch.positions[None])
                events.append("|")
                out.sum().backward()
        finally:
            collectives.launch_exchange, cp._kernel = saved
        orders[prefetch] = "".join(events)
        records[prefetch] = sorted((r.op, r.pass_, r.sent_rows, r.recv_rows, r.row_bytes) for r in log)
    return orders, records, op.live_entries()[2]


@pytest.mark.parametrize("block_checkpoint", [False, True])
def test_prefetch_launches_each_groups_exchange_before_the_previous_groups_kernel(gloo_pool, block_checkpoint):
    """With `prefetch`, group g + 1's exchange (forward) and g - 1's (the recomputes of backward, last group
    first) are launched before group g's kernel, under the block's full AC too (its recompute reruns the
    forward); the collectives and their bytes are the same as without, and no exchange is left behind."""
    runs = gloo_pool(4, sizes=(2, 4)).run(prefetch_rank, (block_checkpoint,), size=2)
    for orders, records, left in runs:
        one = "LKLKLKLK"  # 4 groups: launch, kernel, launch, kernel, ...
        ahead = "LLKLKLKK"  # the next group's launch before each kernel but the last
        passes = 2 if block_checkpoint else 1  # in backward: the block's recompute, then the groups' recomputes
        assert orders[False] == one + "|" + one * passes, orders
        assert orders[True] == ahead + "|" + ahead * passes, orders
        assert records[True] == records[False] and len(records[False]) == 4 * (passes + 2), records
        assert left == 0


def test_automatic_groups_keep_one_groups_working_set_within_the_budget(monkeypatch):
    """head_groups = -1: the fewest groups dividing n_kv_heads whose q, k, v and o fit GROUP_BYTES."""
    from flashcp.titan.models import head_groups

    assert group_count(3, 10**6, 32, 8, 128, 2) == 3
    assert group_count(AUTO, 16384, 32, 8, 128, 2) == 1  # Llama 3 8B at 16K tokens a rank: 0.31 GiB
    assert group_count(AUTO, 131072, 32, 8, 128, 2) == 4  # at 128K: 2.5 GiB -> 4 groups of 0.63 GiB
    assert group_count(AUTO, 196608, 24, 6, 128, 2) == 3  # 2.8 GiB: 2 groups do not fit, 3 (dividing 6) do
    assert group_count(AUTO, 2**24, 32, 8, 128, 2) == 8  # never more groups than KV heads
    monkeypatch.setattr(head_groups, "GROUP_BYTES", 2 * 12 * 64 * 8 * 8 // 4)  # 64 tokens in 4 groups
    plain, grouped, ropes = _blocks("llama3", AUTO)
    plain, grouped = plain.attention, grouped.attention
    dispatch = _dispatch("compact", 1, 0)
    with _float64_rope():
        want, _ = _run(plain, ropes, dispatch, None)
        got, saved = _run(grouped, ropes, dispatch, None)
    assert max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)) <= TOLERANCE
    assert [s for s in saved if len(s) == 3] == [(1, 64, 64)] * 4  # each group's checkpoint keeps the input


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])  # 117 s
def test_a_compiled_grouped_layer_is_one_graph_with_the_eager_results(backend):
    """Compiled as `[compile] enable` compiles a block (inductor, one graph) the groups' checkpoints and
    FlashCP's op trace with `fullgraph=True` and give the eager layer's output and gradients."""
    _, grouped, ropes = _blocks("llama3", 2)
    grouped = grouped.attention
    dispatch = _dispatch("compact", 1, 0)
    torch._dynamo.reset()
    with _float64_rope():
        want, _ = _run(grouped, ropes, dispatch, None)
        got, _ = _run(torch.compile(grouped, backend=backend, fullgraph=True), ropes, dispatch, None)
    assert max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)) <= TOLERANCE


def test_a_group_count_not_dividing_the_kv_heads_is_refused():
    model = validate({"model": {"name": "llama3"}})
    config = model_spec(model["model"], model["flashcp"], 97, 64).model
    with pytest.raises(ValueError, match=r"^head_groups \(3\) must divide the model's 16 KV heads$"):
        use_head_groups(config, 3)


TRAIN_TOLERANCE = 1e-6  # relative, fp32 losses and gradient norms: summation order only


def _train_rank(rank: int, group, cfg: dict) -> tuple[dict, dict]:
    """DistributedPool task: a run's losses and gradient norms; a compiled run starts from no compiled
    code (the pool's workers are reused)."""
    if cfg["compile"]["enable"]:
        torch._dynamo.reset()
    norms: dict[int, float] = {}
    return train_on_pool_rank(rank, group, cfg, norms), norms


@pytest.mark.parametrize("cp,dp,ac,steps,compiled,prefetch", [
    (2, 2, "none", 4, False, False),
    (2, 2, "none", 4, False, True),
    pytest.param(2, 2, "none", 20, False, False, marks=pytest.mark.slow),  # 220 s on a loaded 2-core machine
    pytest.param(4, 1, "full", 20, False, False, marks=pytest.mark.slow),
    pytest.param(2, 2, "none", 20, False, True, marks=pytest.mark.slow),
    pytest.param(4, 1, "full", 20, False, True, marks=pytest.mark.slow),
    pytest.param(2, 2, "none", 20, True, False, marks=pytest.mark.slow),  # 264 s; measured 2.2e-7 (losses), 1.1e-7 (norms)
    pytest.param(4, 1, "full", 20, True, False, marks=pytest.mark.slow),  # 402 s; measured 1.1e-7, 1.3e-7
])  # fmt: skip
def test_a_job_with_head_groups_trains_the_plain_losses(tmp_path, gloo_pool, cp, dp, ac, steps, compiled, prefetch):
    """`[activation_checkpoint] head_groups = 2` (full AC: nested in the block's recompute) trains the
    plain job's losses and gradient norms (fp32; 20 windows in the slow tier), eager, eager with each
    group's exchange launched ahead (`head_group_prefetch`) and with `[compile] enable` (inductor; the
    plain job compiled too)."""
    def job(dump: str, groups: int) -> dict:
        return tiny_job(tmp_path / dump, training={"steps": steps},
                        parallelism={"context_parallel_degree": cp, "data_parallel_shard_degree": dp},
                        activation_checkpoint={"mode": ac, "head_groups": groups,
                                               "head_group_prefetch": prefetch and groups > 1},
                        compile={"enable": compiled, "components": ["model"]})  # fmt: skip

    pool = gloo_pool(4, sizes=(2, 4))
    plain, plain_norms = pool.run(_train_rank, (job("plain", 1),))[0]
    grouped, grouped_norms = pool.run(_train_rank, (job("grouped", 2),))[0]
    loss = max(abs(grouped[s] - plain[s]) / plain[s] for s in plain)
    norm = max(abs(grouped_norms[s] - plain_norms[s]) / plain_norms[s] for s in plain_norms)
    print(f"CP {cp} x FSDP {dp} AC {ac}{' compiled' * compiled}{' prefetch' * prefetch}, 2 head groups vs plain "
          f"over {steps} steps: loss {loss:.1e}, grad norm {norm:.1e} (relative)")  # fmt: skip
    assert sorted(grouped) == list(range(1, steps + 1)) and grouped[steps] < grouped[1]
    assert loss <= TRAIN_TOLERANCE and norm <= TRAIN_TOLERANCE, (grouped, plain)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"activation_checkpoint": {"head_groups": 0}}, r"^\[activation_checkpoint\] head_groups must be -1 "
                                                        r"\(automatic\) or >= 1, got 0$"),
        ({"activation_checkpoint": {"head_groups": 3}}, r"^\[activation_checkpoint\] head_groups \(3\) must divide "
                                                        r"the model's 2 KV heads$"),
        ({"activation_checkpoint": {"head_groups": 2}, "parallelism": {"tensor_parallel_degree": 2}},
         r"^\[activation_checkpoint\] head_groups = 2: not with \[parallelism\] tensor_parallel_degree > 1 "),
        ({"activation_checkpoint": {"head_groups": 2}, "model": {"attention": "flex"}},
         r"^\[activation_checkpoint\] head_groups = 2: not with \[model\] attention = 'flex' "),
        ({"activation_checkpoint": {"head_groups": 2}, "model": {"name": "gpt_oss", "flavor": "debugmodel"}},
         r"^\[activation_checkpoint\] head_groups = 2: not with a gpt_oss model "),
        ({"activation_checkpoint": {"head_groups": 2}, "model": {"name": "deepseek_v3", "flavor": "debugmodel"}},
         r"^\[activation_checkpoint\] head_groups = 2: not with a deepseek_v3 model "),
        ({"activation_checkpoint": {"head_group_prefetch": True}},
         r"^\[activation_checkpoint\] head_group_prefetch = true: not with head_groups = 1 "),
        ({"activation_checkpoint": {"head_groups": 2, "head_group_prefetch": True},
          "compile": {"enable": True, "components": ["model"]}},
         r"^\[activation_checkpoint\] head_group_prefetch = true: not with the model compiled "),
        ({"activation_checkpoint": {"head_groups": 2, "head_group_prefetch": True}, "flashcp": {"comm": "ring"}},
         r"^\[activation_checkpoint\] head_group_prefetch = true: not with \[flashcp\] comm = 'ring' "),
    ],
)
def test_the_job_check_refuses_what_head_groups_do_not_run(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        tiny_job(tmp_path, replace=("model",) if "name" in sections.get("model", {}) else (), **sections)


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_jobs_model_carries_head_group_prefetch(tmp_path, prefetch):
    from flashcp.titan.launch.job import trainer_config

    cfg = tiny_job(tmp_path, activation_checkpoint={"head_groups": 2, "head_group_prefetch": prefetch})
    layers = trainer_config(cfg).model_spec.model.layers
    assert {(type(layer.attention), layer.attention.prefetch) for layer in layers} == {
        (HeadGroupedAttention.Config, prefetch)}
