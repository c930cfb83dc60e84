"""The cost model: table parsing, the kernel tile model and its fit, collective pricing, systems.

Synthetic tables are generated here from known bandwidths / coefficients, so every check compares
the model with an independently computed answer; the shared measured tables are parsed when the
checkout has them (the test says why it skips otherwise).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.costmodel import AttentionShape, CommModel, CostModel, MemoryCosts, ProfileError, load_cost_model
from flashcp.costmodel.comm import collective_ms
from flashcp.costmodel.kernel import KernelModel, PassCost, call_counts, fit_kernel_model, fit_pass
from flashcp.costmodel.model import ring_calls
from flashcp.costmodel.profiles import (
    KernelSample,
    load_collective_tables,
    load_kernel_samples,
    parse_collective_csv,
    kernel_csv_labels,
    parse_kernel_csv,
    parse_nccl_tests,
    parse_per_doc_csv,
)
from flashcp.plan.plan import Plan, Shard, validate

ROOT = Path(__file__).resolve().parents[1]
SHARED_PROFILES = ROOT.parent / "shared" / "data" / "gpu_profiles"


def nccl_text(op: str, n: int, rows: list[tuple[int, float]], header: bool = True) -> str:
    """nccl-tests stdout for (size, busbw) rows, with times and algbw derived consistently."""
    redop = "none" if op == "all_gather" else "sum"
    lines = [f"$ nccl-tests/{op}_perf -b 8M -e 8G -f 2 -d half -g {n}"] if header else []
    lines += [f"# nThread 1 nGpus {n} minBytes 8 maxBytes 8 step: 2(factor)", "#"]
    lines += [f"#  Rank  {r} Group  0 Pid    1 on   host device  {r} [0000:00:00] GPU" for r in range(n)]
    lines += ["#       size         count      type   redop    root     time   algbw   busbw #wrong"]
    for size, busbw in rows:
        algbw = busbw * n / (n - 1)
        us = size / (algbw * 1e3)
        cols = f"{us:.2f}  {algbw:.2f}  {busbw:.2f}  0"
        lines.append(f"  {size:>10d}  {size // 2:>10d}  half  {redop}  -1  {cols}  {cols}")
    lines += ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 1.0", "#"]
    return "\n".join(lines) + "\n"


SYNTH_ROWS = [(8 << 20, 100.0), (16 << 20, 170.0), (64 << 20, 280.0), (512 << 20, 350.0), (4 << 30, 365.0)]


@lru_cache(maxsize=1)
def synthetic_comm(ns=(2, 4, 8)) -> CommModel:
    ops = ("all_gather", "reduce_scatter")
    tables = [parse_nccl_tests(nccl_text(op, n, SYNTH_ROWS), f"{op}{n}") for op in ops for n in ns]
    return CommModel(tables)


TRUE_FWD = PassCost(launch_ms=0.012, cta_ms=5e-5, tile_ms=2.5e-5, half_ctas=60.0)


def synthetic_kernel_samples(with_bwd: bool = False) -> list[KernelSample]:
    """Calls timed by a known PassCost (and a backward 3x the forward) over varied shapes."""
    out = []
    for length in (256, 1024, 4096, 16384, 65536):
        for cp in (1, 2, 8):
            for heads in (8, 64):
                q, k = length // cp, int((0.5 + 0.5 / cp) * length)
                n_cta, n_tiles = call_counts([q], [k], heads)
                fwd = TRUE_FWD.time_ms(n_cta, n_tiles)
                bwd = TRUE_FWD.scaled(3.0).time_ms(n_cta, n_tiles) if with_bwd else None
                out.append(KernelSample((q,), (k,), heads, 128, fwd, None if bwd is None else fwd + bwd))
    return out


@lru_cache(maxsize=1)
def synthetic_model() -> CostModel:
    kernel, _ = fit_kernel_model(synthetic_kernel_samples())
    return CostModel(kernel, synthetic_comm())


def make_plan(doc_lens, ranks) -> Plan:
    plan = Plan(tuple(doc_lens), len(ranks), tuple(tuple(Shard(*s) for s in r) for r in ranks), "hand", {})
    validate(plan)
    return plan


# --- parsing ---------------------------------------------------------------------------------


def test_shared_tables_parse():
    if not SHARED_PROFILES.is_dir():
        pytest.skip(f"shared GPU profiles not in this checkout ({SHARED_PROFILES} missing)")
    tables = load_collective_tables([SHARED_PROFILES])
    assert sorted((t.op, t.n_ranks) for t in tables) == [
        (op, n) for op in ("all_gather", "reduce_scatter") for n in (2, 4, 8)
    ]
    for t in tables:
        assert t.sizes[0] == 8 << 20 and t.sizes[-1] == 8 << 30 and len(t.sizes) == 11
        assert 50 < t.busbw.max() < 900  # GB/s on NVLink
    samples = load_kernel_samples([SHARED_PROFILES])
    assert len(samples) == 176
    one = next(s for s in samples if s.q_lens == (65536,) and s.heads == 64)
    assert one.k_lens == (65536,) and one.fwd_ms > 100
    model, reports = load_cost_model([SHARED_PROFILES], [SHARED_PROFILES])
    # Large calls are where the model is used; there the fit must be close.
    assert reports["fwd"].summary(min_ctas=2048)["rms"] < 0.1


def test_nccl_tests_parse_matches_header_and_columns():
    table = parse_nccl_tests(nccl_text("reduce_scatter", 4, SYNTH_ROWS), "x")
    assert (table.op, table.n_ranks) == ("reduce_scatter", 4)
    np.testing.assert_array_equal(table.sizes, [s for s, _ in SYNTH_ROWS])
    np.testing.assert_allclose(table.busbw, [b for _, b in SYNTH_ROWS])
    # Without the command line the op comes from the redop column.
    bare = parse_nccl_tests(nccl_text("all_gather", 8, SYNTH_ROWS, header=False), "y")
    assert (bare.op, bare.n_ranks) == ("all_gather", 8)


def test_comm_time_equals_bytes_over_algbw_at_table_points():
    comm = synthetic_comm()
    for n in (2, 4, 8):
        for size, busbw in SYNTH_ROWS:
            algbw = busbw * n / (n - 1) * 1e9
            expect_ms = size / algbw * 1e3
            assert comm.all_gather_ms(size / n, n) == pytest.approx(expect_ms, rel=1e-9)
            assert comm.reduce_scatter_ms(size / n, n) == pytest.approx(expect_ms, rel=1e-9)
            # One ring step moves a neighbour's chunk: size / N bytes at the bus bandwidth.
            assert comm.ring_step_ms(size / n, n) == pytest.approx(size / n / (busbw * 1e9) * 1e3, rel=1e-9)


def test_comm_time_matches_measured_times_in_the_shared_tables():
    if not SHARED_PROFILES.is_dir():
        pytest.skip(f"shared GPU profiles not in this checkout ({SHARED_PROFILES} missing)")
    for path in SHARED_PROFILES.glob("nccl_*.txt"):
        table = parse_nccl_tests(path.read_text(), str(path))
        rows = [ln.split() for ln in path.read_text().splitlines() if ln.strip()[:1].isdigit()]
        measured_us = [float(r[5]) for r in rows]
        modelled_us = [collective_ms(table, s) * 1e3 for s in table.sizes]
        np.testing.assert_allclose(modelled_us, measured_us, rtol=0.01)  # busbw is printed to 4 digits


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(1.0, 3e10), min_size=2, max_size=8), st.sampled_from([2, 4, 8]))
def test_comm_time_is_monotone_in_bytes(sizes, n):
    comm = synthetic_comm()
    sizes = sorted(sizes)
    for op in (comm.all_gather_ms, comm.reduce_scatter_ms, comm.all_to_all_ms, comm.ring_step_ms):
        times = [op(s, n) for s in sizes]
        assert all(a <= b + 1e-12 for a, b in zip(times, times[1:]))
        assert all(t >= 0 for t in times)
    assert comm.all_gather_ms(0, n) == 0.0 and comm.all_to_all_ms(0, n) == 0.0


def test_user_collective_csv_accepted():
    rows = ["op,n_ranks,size_bytes,busbw_gbps"]
    rows += [f"{op},8,{s},{b / 2}" for op in ("all_gather", "reduce_scatter") for s, b in SYNTH_ROWS]
    tables = parse_collective_csv("\n".join(rows), "user.csv")
    comm = CommModel(tables)
    size, busbw = SYNTH_ROWS[2]
    assert comm.all_gather_ms(size / 8, 8) == pytest.approx(size / (busbw / 2 * 8 / 7 * 1e9) * 1e3)
    with pytest.raises(ProfileError, match="no all_gather table for 4 ranks"):
        comm.all_gather_ms(1e6, 4)


def test_user_tables_loaded_from_a_directory(tmp_path):
    (tmp_path / "ag.txt").write_text(nccl_text("all_gather", 8, SYNTH_ROWS))
    (tmp_path / "rs.txt").write_text(nccl_text("reduce_scatter", 8, SYNTH_ROWS))
    rows = ["heads,head_dim,q_lens,k_lens,fwd_ms,fwd_bwd_ms"]
    rows += [f"{s.heads},128,{s.q_lens[0]},{s.k_lens[0]},{s.fwd_ms},{s.fwd_bwd_ms}"
             for s in synthetic_kernel_samples(with_bwd=True)]
    (tmp_path / "rank_attention.csv").write_text("\n".join(rows))
    model, reports = load_cost_model([tmp_path], [tmp_path])
    assert set(reports) == {"fwd", "bwd"}  # measured fwd+bwd times give the backward its own fit
    for cost, true in ((model.kernel.fwd, TRUE_FWD), (model.kernel.bwd, TRUE_FWD.scaled(3.0))):
        assert cost.tile_ms == pytest.approx(true.tile_ms, rel=1e-3)
        assert cost.cta_ms == pytest.approx(true.cta_ms, rel=1e-2)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("op,n_ranks,size_bytes\nall_gather,8,100", "missing column"),
        ("op,n_ranks,size_bytes,busbw_gbps\nall_gather,8,100,-3", "must be positive"),
        ("op,n_ranks,size_bytes,busbw_gbps\nall_gather,8,100,3\nall_gather,8,100,4", "strictly increasing"),
        ("op,n_ranks,size_bytes,busbw_gbps\nbroadcast,8,100,3\nbroadcast,8,200,3", "unknown collective"),
        ("op,n_ranks,size_bytes,busbw_gbps\nall_gather,1,100,3\nall_gather,1,200,3", "n_ranks >= 2"),
        ("op,n_ranks,size_bytes,busbw_gbps\nall_gather,8,lots,3", "not a float"),
        ("op,n_ranks,size_bytes,busbw_gbps\n", "no data rows"),
    ],
)
def test_bad_collective_csv_rejected(text, problem):
    with pytest.raises(ProfileError, match=problem):
        parse_collective_csv(text, "bad.csv")


def test_bad_nccl_output_rejected():
    good = nccl_text("all_gather", 8, SYNTH_ROWS)
    with pytest.raises(ProfileError, match="not an nccl-tests result row"):
        parse_nccl_tests(good.replace("# Out of bounds", "garbage line\n# Out of bounds"), "bad.txt")
    with pytest.raises(ProfileError, match="no nccl-tests result rows"):
        parse_nccl_tests("\n".join(ln for ln in good.splitlines() if ln.startswith(("#", "$"))), "empty.txt")


@pytest.mark.parametrize(
    "text, problem",
    [
        ("L,cp,tp\n64,1,1", "missing column"),
        ("L,cp,tp,duration_per_doc\n64,1,3,0.1", "does not divide"),
        ("L,cp,tp,duration_per_doc\n4,8,1,0.1", "shorter than cp"),
        ("L,cp,tp,duration_per_doc\n64,1,1,nan", "must be positive"),
    ],
)
def test_bad_per_doc_profile_rejected(text, problem):
    with pytest.raises(ProfileError, match=problem):
        parse_per_doc_csv(text, "bad.csv")


def test_bad_kernel_table_rejected(tmp_path):
    with pytest.raises(ProfileError, match="same number of sequences"):
        parse_kernel_csv("heads,q_lens,k_lens,fwd_ms\n8,1 2,3,0.1", "bad.csv")
    with pytest.raises(ProfileError, match="k_len >= q_len"):
        parse_kernel_csv("heads,q_lens,k_lens,fwd_ms\n8,5,3,0.1", "bad.csv")
    for fwd_bwd in ("0.1", "0.2"):  # a backward of no time would divide the relative-error fit by 0
        with pytest.raises(ProfileError, match="not above fwd_ms"):
            parse_kernel_csv(f"heads,q_lens,k_lens,fwd_ms,fwd_bwd_ms\n8,5,5,0.2,{fwd_bwd}", "bad.csv")
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ProfileError, match="not a kernel table"):
        load_kernel_samples([tmp_path / "x.csv"])
    with pytest.raises(ProfileError, match="does not exist"):
        load_collective_tables([tmp_path / "missing"])


# --- kernel model ----------------------------------------------------------------------------


def brute_force_counts(q_lens, k_lens, heads, causal, bq, bk):
    """Enumerate every (query block, key block) tile a FlashAttention kernel visits."""
    ctas = tiles = 0
    for q, k in zip(q_lens, k_lens):
        if q == 0 or k == 0:
            continue
        for qb in range(0, q, bq):
            ctas += 1
            last_row = min(qb + bq, q) - 1
            visible = k - q + last_row + 1 if causal else k  # keys the block's last row sees
            tiles += -(-visible // bk)
    return heads * ctas, heads * tiles


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 3000)), min_size=1, max_size=6),
    st.integers(1, 4),
    st.booleans(),
    st.sampled_from([(128, 128), (128, 64), (64, 64), (128, 32)]),
)
def test_tile_counts_match_enumeration(seqs, heads, causal, blocks):
    q_lens = [q for q, _ in seqs]
    k_lens = [q + p if causal else p for q, p in seqs]  # causal needs k >= q
    got = call_counts(q_lens, k_lens, heads, causal, *blocks)
    assert got == brute_force_counts(q_lens, k_lens, heads, causal, *blocks)


def test_fit_recovers_known_coefficients():
    cost = fit_pass(*np.array([(*call_counts(s.q_lens, s.k_lens, s.heads), s.fwd_ms)
                               for s in synthetic_kernel_samples()]).T)
    assert cost.tile_ms == pytest.approx(TRUE_FWD.tile_ms, rel=1e-3)
    assert cost.cta_ms == pytest.approx(TRUE_FWD.cta_ms, rel=1e-2)
    assert cost.launch_ms == pytest.approx(TRUE_FWD.launch_ms, rel=1e-2)
    assert cost.half_ctas == pytest.approx(TRUE_FWD.half_ctas, rel=2e-2)


def test_fit_rejects_too_few_or_degenerate_samples():
    with pytest.raises(ProfileError, match="at least 4"):
        fit_pass([1, 2], [1, 2], [1, 2])
    with pytest.raises(ProfileError, match="same tiles per block"):
        fit_pass([1, 2, 4, 8], [3, 6, 12, 24], [1, 2, 3, 4])
    with pytest.raises(ProfileError, match="positive time"):  # the fit divides by the times
        fit_pass([1, 2, 4, 8], [3, 7, 12, 30], [1, 0, 3, 4])
    with pytest.raises(ProfileError, match="no kernel samples"):
        fit_kernel_model([])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40000), st.integers(0, 40000), st.integers(1, 64), st.integers(1, 2000))
def test_kernel_time_grows_with_shard_prefix_and_heads(s, p, heads, extra):
    kernel = synthetic_model().kernel
    t = kernel.forward_ms([s], [p + s], heads)
    assert kernel.forward_ms([s + extra], [p + s + extra], heads) >= t
    assert kernel.forward_ms([s], [p + s + extra], heads) >= t
    assert kernel.forward_ms([s], [p + s], heads + 1) >= t
    assert kernel.backward_ms([s], [p + s], heads) > t


def per_doc_call(doc_len: int, doc_count: int, chunks: int) -> tuple[list[int], list[int]]:
    """One varlen call over `doc_count` documents each cut into `chunks` (q, prefix + q) shards."""
    bounds = [doc_len * c // chunks for c in range(chunks + 1)]
    q = [b - a for a, b in zip(bounds, bounds[1:])]
    return q * doc_count, bounds[1:] * doc_count


def test_short_unaligned_shards_cost_more_than_whole_documents():
    """Same work, finer shards: partly filled tiles and extra blocks make it slower."""
    kernel = synthetic_model().kernel
    whole = kernel.forward_ms([3000] * 40, [3000] * 40, 32)
    assert kernel.forward_ms(*per_doc_call(3000, 40, 16), 32) > 1.05 * whole


def test_block_aligned_splits_cost_the_same_in_one_call():
    """Cutting at tile boundaries adds no tiles and no blocks to a single varlen call."""
    kernel = synthetic_model().kernel
    whole = kernel.forward_ms([8192] * 16, [8192] * 16, 32)
    assert kernel.forward_ms(*per_doc_call(8192, 16, 16), 32) == pytest.approx(whole)


# --- systems ---------------------------------------------------------------------------------


def test_whole_document_plan_has_zero_compact_and_needed_comm():
    plan = make_plan([4096, 4096, 2048, 2048, 4096], [[(0, 0, 4096)], [(1, 0, 4096)],
                                                     [(2, 0, 2048), (3, 0, 2048)], [(4, 0, 4096)]])
    model, shape = synthetic_model(), AttentionShape(heads=16)
    for comm in ("compact", "needed"):
        t = model.collective_step(plan, comm, shape)
        assert t.comm_fwd == 0.0 and t.comm_bwd == 0.0
    full = model.collective_step(plan, "full", shape)
    assert full.comm_fwd > 0 and full.comm_bwd > 0
    assert full.training > model.collective_step(plan, "compact", shape).training


def test_compact_comm_is_the_all_gather_of_the_largest_send():
    # rank 0 sends its non-last shards (3000 + 1000 tokens); rank 1 holds only last shards.
    plan = make_plan([5000, 3000], [[(0, 0, 3000), (1, 0, 1000)], [(0, 3000, 2000), (1, 1000, 2000)]])
    model, shape = synthetic_model(), AttentionShape(heads=8, head_dim=128)
    t = model.collective_step(plan, "compact", shape)
    assert t.comm_fwd == pytest.approx(model.comm.all_gather_ms(4000 * shape.kv_row_bytes, 2))
    assert t.comm_bwd == pytest.approx(model.comm.reduce_scatter_ms(4000 * shape.kv_row_bytes, 2))


def test_mla_exchanges_latent_rows_and_pays_the_padded_kernel_and_up_projection():
    """MLA (Moonlight's 16 heads, 192 / 128, latent 512 + 64): the exchange moves 576-value rows,
    the kernel is priced at head dim 192 (V padded), and the key rows beyond the local ones cost
    their up-projection (forward 2 x 512 x 16 x 256 FLOPs a row, twice that backward) and their
    K/V writes; against the same shape exchanging K/V only the comm and those terms differ."""
    plan = make_plan([5000, 3000], [[(0, 0, 3000), (1, 0, 1000)], [(0, 3000, 2000), (1, 1000, 2000)]])
    model = synthetic_model()
    kv = AttentionShape(heads=16, head_dim=192, v_head_dim=128)
    mla = AttentionShape(heads=16, head_dim=192, v_head_dim=128, kv_lora_rank=512, rope_dim=64)
    assert (kv.kv_row_bytes, mla.exchange_row_bytes, kv.exchange_row_bytes) == (16 * 320 * 2, 576 * 2, 16 * 320 * 2)
    a, b = model.collective_step(plan, "compact", kv), model.collective_step(plan, "compact", mla)
    assert b.comm_fwd == pytest.approx(model.comm.all_gather_ms(4000 * 576 * 2, 2))
    assert b.comm_bwd == pytest.approx(model.comm.reduce_scatter_ms(4000 * 576 * 2, 2))
    assert (a.attn_fwd, a.attn_bwd) == (b.attn_fwd, b.attn_bwd)
    padded = AttentionShape(heads=16, head_dim=192)
    assert model.rank_attention_ms(plan, kv) == model.rank_attention_ms(plan, padded)
    # rank 1 holds the 4000 tokens with 3000 + 1000 prefix rows from rank 0: the slowest in both
    mem, key_rows = model.memory, [4000, 8000]
    extra = 2 * 512 * 16 * 256 * (key_rows[1] - 4000) / (mem.gemm_tflops * 1e12) * 1e3
    moved = 2 * (4000 + 0 + key_rows[1])  # local + sent + key rows, read and written
    want_fwd = mem.ms(moved * 576 * 2) + extra + mem.ms(kv.kv_row_bytes * key_rows[1])
    assert b.other_fwd == pytest.approx(want_fwd)
    assert a.other_fwd == pytest.approx(mem.ms(moved * kv.kv_row_bytes))


def test_overlap_hides_the_all_gather_behind_local_only_shards():
    # Rank 0: document 0 whole (local-only) + the tail of document 1 (needs rank 1's head).
    # Rank 1: only shards that start their documents, so it has nothing to overlap.
    plan = make_plan([6000, 4000, 6000], [[(0, 0, 6000), (1, 2000, 2000)], [(1, 0, 2000), (2, 0, 6000)]])
    model, shape = synthetic_model(), AttentionShape(heads=16)
    plain = model.collective_step(plan, "compact", shape)
    over = model.collective_step(plan, "compact", shape, overlap=True)
    k, ag = model.kernel, model.comm.all_gather_ms(2000 * shape.kv_row_bytes, 2)
    copy = model.memory.ms(2 * shape.kv_row_bytes * 18000)  # both ranks: 8000 local + send + keys
    extra = model.memory.ms(6 * shape.q_row_bytes * 8000)  # gathers of q and the two outputs
    rank0 = max(ag, k.forward_ms([6000], [6000], 16)) + k.forward_ms([2000], [4000], 16) + copy + extra
    rank1 = ag + k.forward_ms([2000, 6000], [2000, 6000], 16) + copy
    assert over.inference == pytest.approx(max(rank0, rank1))
    assert plain.inference == pytest.approx(ag + max(plain.per_rank_fwd) + copy)
    assert over.comm_bwd == plain.comm_bwd  # the backward is not overlapped


def test_slowest_rank_sets_the_attention_time():
    plan = make_plan([6000, 2000], [[(0, 0, 4000)], [(0, 4000, 2000), (1, 0, 2000)]])
    model = synthetic_model()
    t = model.collective_step(plan, "full", AttentionShape(heads=8))
    assert t.attn_fwd == max(t.per_rank_fwd) and t.per_rank_fwd[1] > t.per_rank_fwd[0]
    parts = {k: v for k, v in t.as_dict().items() if k not in ("inference", "training")}
    assert t.training == pytest.approx(sum(parts.values()))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=12), st.sampled_from([2, 3, 4, 8]))
def test_ring_steps_cover_exactly_the_causal_attention(doc_lens, n):
    """Summed over steps and ranks, the blockwise calls score every causal pair exactly once."""
    doc_lens[-1] += -sum(doc_lens) % n  # the layouts are plans: every rank holds C / N tokens
    for layout in ("ring", "zigzag"):
        scores = 0
        for step in ring_calls(tuple(doc_lens), n, layout):
            for q, k, causal in step:
                if causal:
                    scores += int(np.sum(q * (k - q) + q * (q + 1) // 2))
                else:
                    scores += int(np.sum(q * k))
        assert scores == sum(d * (d + 1) // 2 for d in doc_lens)


def test_zigzag_balances_a_long_document_better_than_ring():
    model, shape = synthetic_model(), AttentionShape(heads=32)
    ring = model.ring_step((65536,), 8, "ring", shape)
    zigzag = model.ring_step((65536,), 8, "zigzag", shape)
    assert zigzag.attn_fwd < 0.75 * ring.attn_fwd
    assert max(zigzag.per_rank_fwd) / min(zigzag.per_rank_fwd) < 1.1
    assert ring.training > ring.inference > 0


def test_merge_and_copy_costs_follow_memory_bandwidth():
    plan = make_plan([4096] * 4, [[(0, 0, 4096)], [(1, 0, 4096)], [(2, 0, 4096)], [(3, 0, 4096)]])
    shape = AttentionShape(heads=8)
    fast = synthetic_model()
    slow = CostModel(fast.kernel, fast.comm, MemoryCosts(hbm_gbps=1300.0))
    assert slow.collective_step(plan, "full", shape).other_fwd == pytest.approx(
        2 * fast.collective_step(plan, "full", shape).other_fwd)
    assert slow.ring_step(plan.doc_lens, 4, "zigzag", shape).other_fwd == pytest.approx(
        2 * fast.ring_step(plan.doc_lens, 4, "zigzag", shape).other_fwd)


def test_unknown_system_and_missing_plan_are_clear_errors():
    model = synthetic_model()
    plan = make_plan([8], [[(0, 0, 4)], [(0, 4, 4)]])
    with pytest.raises(ValueError, match="unknown system"):
        model.step("magic", AttentionShape(), {"per_seq": plan})
    with pytest.raises(KeyError, match="needs a 'flashcp' plan"):
        model.step("flashcp", AttentionShape(), {"per_seq": plan})
    with pytest.raises(ValueError, match="block_q 96 must be a multiple"):
        KernelModel(TRUE_FWD, TRUE_FWD, block_q=96, block_k=64)


# --- re-fitting to a GPU check's output -------------------------------------------------------


@lru_cache(maxsize=1)
def bench():
    """benchmarks/costmodel.py as a module (benchmarks/ is no package), to run refit in-process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("costmodel_bench", ROOT / "benchmarks" / "costmodel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed_call(q_lens, k_lens, heads: int, slow: float = 1.0) -> KernelSample:
    """A call timed by `slow` x the known TRUE_FWD, its backward 3x the forward."""
    n_cta, n_tiles = call_counts(q_lens, k_lens, heads)
    fwd = slow * TRUE_FWD.time_ms(n_cta, n_tiles)
    return KernelSample(tuple(q_lens), tuple(k_lens), heads, 128, fwd, 4 * fwd)


def gpucheck_calls(torch_slow: float = 1.0) -> list[tuple[str, str, KernelSample]]:
    """(section, backend, call) rows shaped like gpucheck's: each rank of a C = 128K plan (whole
    documents plus a Per-Doc shard with a rank-dependent prefix), and a sweep of shard lengths,
    whole documents vs Per-Doc chunks; the torch backend `torch_slow` x slower."""
    rows = []
    for backend, slow in (("flash_attn", 1.0), ("torch", torch_slow)):
        for heads in (16, 32):
            for n in (4, 8):
                share = 131072 // n
                for r in range(n):
                    q, k = [share // 2] + [share // 8] * 4, [share // 2 + r * share] + [share // 8] * 4
                    rows.append(("critical_path", backend, timed_call(q, k, heads, slow)))
        for length in (128, 512, 2048, 8192):
            whole = [length] * (16384 // length)
            rows.append(("efficiency", backend, timed_call(whole, whole, 32, slow)))
            chunks = per_doc_call(length * 8, max(16384 // length // 8, 1), 8)
            rows.append(("efficiency", backend, timed_call(*chunks, 32, slow)))
    return rows


def write_gpucheck(folder: Path, rows: list[tuple[str, str, KernelSample]]) -> Path:
    """A gpucheck --out folder: kernel_calls.csv in the columns gpucheck writes, and env.json."""
    import csv

    from flashcp.gpucheck.timing import KERNEL_CALL_COLUMNS

    folder.mkdir()
    with (folder / "kernel_calls.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, KERNEL_CALL_COLUMNS)
        writer.writeheader()
        for section, backend, s in rows:
            lens = {"q_lens": " ".join(map(str, s.q_lens)), "k_lens": " ".join(map(str, s.k_lens))}
            writer.writerow({"section": section, "backend": backend, "dtype": "bfloat16", "heads": s.heads,
                             "kv_heads": s.heads, "head_dim": s.head_dim, **lens, "fwd_ms": s.fwd_ms,
                             "fwd_bwd_ms": s.fwd_bwd_ms})  # fmt: skip
    (folder / "env.json").write_text('{"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"}')
    return folder


def run_refit(check: Path, kernel: Path) -> dict:
    """`costmodel.py refit --gpucheck check --kernel kernel` in-process; the JSON it wrote."""
    bench().main(["refit", "--gpucheck", str(check), "--kernel", str(kernel)])
    return json.loads((check / "costmodel_refit.json").read_text())


def test_refit_reads_the_check_a_gpu_lease_packed(tmp_path):
    """A GPU lease's OUTDIR holds the check as gpucheck.tar.gz (flashcp.gpucheck.lease.pack): refit on
    OUTDIR unpacks it beside it and fits the same calls as on the check's own folder."""
    import tarfile

    check = write_gpucheck(tmp_path / "gpucheck", gpucheck_calls())
    lease = tmp_path / "lease"
    lease.mkdir()
    with tarfile.open(lease / "gpucheck.tar.gz", "w:gz") as tar:
        tar.add(check, arcname="gpucheck")
    calibration = tmp_path / "calibration.csv"
    calibration.write_text("heads,q_lens,k_lens,fwd_ms\n" + "\n".join(
        f"{s.heads},{s.q_lens[0]},{s.k_lens[0]},{s.fwd_ms}" for s in synthetic_kernel_samples()))  # fmt: skip
    bench().main(["refit", "--gpucheck", str(lease), "--kernel", str(calibration)])
    packed = json.loads((lease / "gpucheck" / "costmodel_refit.json").read_text())
    direct = run_refit(check, calibration)
    assert packed["calls"] == direct["calls"] == 64
    assert packed["refit_kernel"] == direct["refit_kernel"]


def test_refit_recovers_the_kernel_that_timed_the_calls(tmp_path, capsys):
    """Calls timed by a known model: the refit must reproduce them, unseen calls included, and the
    calibration (a table timed 2x slower, forward only) must show exactly that offset."""
    check = write_gpucheck(tmp_path / "check", gpucheck_calls())
    doubled = PassCost(2 * TRUE_FWD.launch_ms, 2 * TRUE_FWD.cta_ms, 2 * TRUE_FWD.tile_ms, TRUE_FWD.half_ctas)
    rows = ["heads,q_lens,k_lens,fwd_ms"] + [f"{s.heads},{s.q_lens[0]},{s.k_lens[0]},"
                                             f"{doubled.time_ms(*call_counts(s.q_lens, s.k_lens, s.heads))}"
                                             for s in synthetic_kernel_samples()]  # fmt: skip
    (tmp_path / "calibration.csv").write_text("\n".join(rows))
    result = run_refit(check, tmp_path / "calibration.csv")
    assert result["device"] == "NVIDIA H100 80GB HBM3" and result["calls"] == 64
    assert result["counts"]["section"] == {"critical_path": 48, "efficiency": 16}
    assert {k for k in result["refit"]} == {"all", "section=critical_path", "section=efficiency",
                                             "backend=flash_attn", "backend=torch"}
    for group in result["refit"].values():
        for kind in ("fwd", "fwd_bwd"):
            assert group[kind]["max"] < 0.01
    assert result["refit_kernel"]["fwd"]["tile_ms"] == pytest.approx(TRUE_FWD.tile_ms, rel=1e-2)
    assert result["cross_validation"]["5-fold"]["fwd"]["rms"] < 0.02
    assert result["cross_validation"]["section=critical_path held out"]["fwd_bwd"]["rms"] < 0.05
    shipped = result["calibration"]["residuals"]["all"]
    assert shipped["fwd"]["bias"] == pytest.approx(np.log(2), abs=0.01)
    # no measured backward: 2.5x the forward, against the truth's 3x at half the speed
    assert shipped["fwd_bwd"]["bias"] == pytest.approx(np.log(2 * 3.5 / 4), abs=0.01)
    out = capsys.readouterr().out
    assert "re-fitted    section=efficiency" in out and "calibration  all" in out


def test_refit_residuals_are_grouped_by_backend(tmp_path):
    """One backend 1.5x slower: one model fits both in between, so each backend's own bias shows it
    (the faster one over-predicted); without the calibration tables the refit still reports,
    saying why it compared nothing."""
    check = write_gpucheck(tmp_path / "check", gpucheck_calls(torch_slow=1.5))
    result = run_refit(check, tmp_path / "no_profiles")
    fast, slow = (result["refit"][f"backend={b}"]["fwd"]["bias"] for b in ("flash_attn", "torch"))
    assert fast > 0.1 and slow < -0.1 and fast - slow == pytest.approx(np.log(1.5), abs=0.01)
    assert result["refit"]["backend=torch"]["fwd"]["n"] == 32
    assert "no_profiles does not exist" in result["calibration"]["skipped"]


def test_kernel_csv_labels_follow_the_parsed_rows():
    """Labels must pair with the right samples, also where the parser skips an empty row."""
    text = "section,heads,q_lens,k_lens,fwd_ms\na,8,64,64,0.1\n,,,,\nb,8,128,256,0.2\n"
    samples = parse_kernel_csv(text, "t.csv")
    labels = kernel_csv_labels(text, "t.csv", ("section",))
    assert [(lab["section"], s.q_lens) for lab, s in zip(labels, samples)] == [("a", (64,)), ("b", (128,))]
    assert len(labels) == len(samples)


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda d: (d / "kernel_calls.csv").unlink(), "kernel_calls.csv not found"),
        (lambda d: rewrite(d, spoil_first_fwd_ms), "kernel_calls.csv:2: column fwd_ms has 'fast'"),
        (lambda d: rewrite(d, lambda t: t.replace("section,", "part,", 1)), "missing column(s) section"),
        (lambda d: rewrite(d, lambda t: t.splitlines()[0]), "kernel_calls.csv: no data rows"),
        (lambda d: rewrite(d, lambda t: "\n".join(t.splitlines()[:3])), "kernel_calls.csv: cannot fit"),
        (lambda d: (d / "env.json").write_text("{device"), "env.json: not JSON"),
    ],
)
def test_refit_names_a_missing_or_malformed_file(tmp_path, edit, problem):
    check = write_gpucheck(tmp_path / "check", gpucheck_calls())
    edit(check)
    with pytest.raises(SystemExit) as exit_:
        run_refit(check, tmp_path / "no_profiles")
    assert str(exit_.value).startswith(f"error: {check}") and problem in str(exit_.value)
    assert not (check / "costmodel_refit.json").exists()


def rewrite(folder: Path, change) -> None:
    table = folder / "kernel_calls.csv"
    table.write_text(change(table.read_text()))


def spoil_first_fwd_ms(text: str) -> str:
    header, first, *rest = text.splitlines()
    cells = first.split(",")
    cells[header.split(",").index("fwd_ms")] = "fast"
    return "\n".join([header, ",".join(cells), *rest])
