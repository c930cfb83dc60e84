"""Context-parallel Gated DeltaNet on spawned gloo ranks equals the single-process float64 recurrence.

Each case runs `cp_causal_conv1d` and `cp_gated_delta` forward and backward on every rank of a
plan, maps the rows back through `token_index` and compares outputs and the gradients of every
input (x and the conv weight; q, k, v, g, beta) with the token-by-token recurrence and torch's
conv1d over the whole window, one sequence per document: within 1e-10 absolute in float64
(observed ~1e-15). The same runs log what the exchanges send (`record_comm`), which must equal
`flashcp.plan.linear.linear_comm`'s prediction, and the backward must send it back transposed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashcp import plan_shards
from flashcp.attention import record_comm
from flashcp.attention.gated_delta import gated_delta_recurrence
from flashcp.attention.linear_cp import cp_causal_conv1d, cp_gated_delta
from flashcp.attention.simulate import run_ranks
from flashcp.attention.linear_dispatch import build_linear_dispatch
from flashcp.plan.linear import composers, doc_pieces, linear_comm, state_all_gather_bytes, summary_values
from flashcp.plan.plan import normalize, Plan, Shard, validate

HEADS, DK, DV, CHANNELS, WIDTH, CHUNK = 2, 3, 2, 3, 4, 3
TOL = 1e-10


def manual(doc_lens: list[int], ranks: list[list[tuple[int, int, int]]]) -> Plan:
    plan = Plan(tuple(doc_lens), len(ranks), normalize([[Shard(*s) for s in r] for r in ranks]), "manual")
    validate(plan)
    return plan


def contiguous(doc_lens: list[int], cp_size: int) -> Plan:
    """The window cut into N equal contiguous parts, whatever the documents (the usual CP split)."""
    per, ranks, pos = sum(doc_lens) // cp_size, [[] for _ in range(cp_size)], 0
    for d, length in enumerate(doc_lens):
        for t in range(length):
            ranks[(pos + t) // per].append((d, t, 1))
        pos += length
    return manual(doc_lens, ranks)


def whole_documents(n: int) -> Plan:
    return manual([5, 3] * n, [[(2 * r, 0, 5), (2 * r + 1, 0, 3)] for r in range(n)])


def short_pieces(n: int) -> Plan:
    """A 7-token document in pieces of 2, 1, 1 and 3 tokens (the last one's conv taps reach three
    ranks at CP 4), a 1-token document, a 2-token one cut in two, fillers."""
    ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    owners = [0, 1, 0, 1] if n == 2 else [0, 1, 2, 3]
    for owner, (start, length) in zip(owners, [(0, 2), (2, 1), (3, 1), (4, 3)]):
        ranks[owner].append((0, start, length))
    ranks[0] += [(1, 0, 1), (2, 1, 1)]
    ranks[n - 1].append((2, 0, 1))
    for r in range(1, n - 1):
        ranks[r].append((2 + r, 0, 3))
    return manual([7, 1, 2] + [3] * (n - 2), ranks)


LAYOUTS = {
    "whole documents only": whole_documents,
    "head-tail cuts (per_doc)": lambda n: plan_shards([13, 7, 5, 11, 3, 1], n, "per_doc"),
    "flashcp": lambda n: plan_shards([29, 3, 1, 2, 5, 4, 12], n, "flashcp"),
    "a document spanning every rank": lambda n: plan_shards([12 * n + 1, 4 * n - 1], n, "per_seq"),
    "a document ending at a rank boundary": lambda n: contiguous([4, 4 * n - 4, 1, 2, 4 * n - 3], n),
    "pieces shorter than the conv width": short_pieces,
}


def window_inputs(context: int, seed: int) -> list[torch.Tensor]:
    """x, conv weight, q, k, v, g, beta of the whole window and the output weights, float64."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return [
        rand(context, CHANNELS), rand(CHANNELS, WIDTH),
        F.normalize(rand(context, HEADS, DK), dim=-1) * DK**-0.5,
        F.normalize(rand(context, HEADS, DK), dim=-1),
        rand(context, HEADS, DV), -F.softplus(rand(context, HEADS)), torch.sigmoid(rand(context, HEADS)),
        rand(context, CHANNELS), rand(context, HEADS, DV),
    ]  # fmt: skip


def run_case(rank: int, group, plan: Plan, seed: int):
    """Worker: conv and gated delta forward and backward on this rank's rows, with the comm logs."""
    d = build_linear_dispatch(plan, rank, WIDTH)
    x, w, q, k, v, g, beta, gy, go = window_inputs(plan.context, seed)
    x, q, k, v, g, beta, gy, go = (t[d.token_index].clone() for t in (x, q, k, v, g, beta, gy, go))
    leaves = [t.requires_grad_() for t in (x, w, q, k, v, g, beta)]
    with record_comm() as halo_log:
        y = cp_causal_conv1d(x, w, d, group)
        (y * gy).sum().backward()
    with record_comm() as state_log:
        o = cp_gated_delta(q, k, v, g, beta, d, group, chunk_size=CHUNK)
        (o * go).sum().backward()
    return d.token_index, [y.detach(), o.detach()] + [t.grad for t in leaves], list(halo_log), list(state_log)


def run_cases(rank: int, group, plans: list[Plan]):
    return [run_case(rank, group, plan, seed) for seed, plan in enumerate(plans)]


def oracle(plan: Plan, seed: int) -> list[torch.Tensor]:
    """Per-document conv1d and the token recurrence over the whole window: outputs and gradients."""
    x, w, q, k, v, g, beta, gy, go = window_inputs(plan.context, seed)
    leaves = [t.requires_grad_() for t in (x, w, q, k, v, g, beta)]
    y = torch.cat([
        F.conv1d(doc.T[None], w[:, None], padding=WIDTH - 1, groups=CHANNELS)[0, :, : len(doc)].T
        for doc in x.split(plan.doc_lens)
    ])  # fmt: skip
    o, _ = gated_delta_recurrence(q, k, v, g, beta, plan.doc_lens)
    ((y * gy).sum() + (o * go).sum()).backward()
    return [y.detach(), o.detach()] + [t.grad for t in leaves]


NAMES = ("y", "o", "dx", "dconv_weight", "dq", "dk", "dv", "dg", "dbeta")


@pytest.fixture(scope="module")
def pool(gloo_pool):
    return gloo_pool(4, sizes=(2, 4))


@pytest.mark.parametrize("cp_size", [2, 4])
def test_matches_single_process_recurrence_and_sends_the_predicted_bytes(pool, cp_size):
    """Every layout in one call of the pool (spawned ranks answer slowly on a loaded machine)."""
    plans = [make(cp_size) for make in LAYOUTS.values()]
    results = pool.run(run_cases, (plans,), size=cp_size)
    for case, (layout, plan) in enumerate(zip(LAYOUTS, plans)):
        check_case(f"{layout} N={cp_size}", plan, case, [rank[case] for rank in results])


def check_case(what: str, plan: Plan, seed: int, per_rank: list) -> None:
    want = oracle(plan, seed)
    got = [torch.zeros_like(t) for t in want]
    for idx, local, _, _ in per_rank:
        for full, part, name in zip(got, local, NAMES):
            if name == "dconv_weight":  # a parameter: each rank holds its share of the gradient
                full += part
            else:
                full[idx] = part
    for name, a, b in zip(NAMES, got, want):
        assert (a - b).abs().max() < TOL, f"{what} {name}: {(a - b).abs().max():.3g}"

    predicted = linear_comm(plan, HEADS, DK, DV, CHANNELS, state_bytes=8, dtype_bytes=8, conv_width=WIDTH)
    for log, sent, recv in ((3, predicted.state_sent, predicted.state_recv),
                            (2, predicted.halo_sent, predicted.halo_recv)):  # fmt: skip
        fwd = [[r for r in rank[log] if r.pass_ == "forward"] for rank in per_rank]
        bwd = [[r for r in rank[log] if r.pass_ == "backward"] for rank in per_rank]
        assert [sum(r.sent_bytes for r in rs) for rs in fwd] == sent, (what, log)
        assert [sum(r.recv_bytes for r in rs) for rs in fwd] == recv, (what, log)
        assert [sum(r.sent_bytes for r in rs) for rs in bwd] == recv, (what, log)
    assert max(predicted.state_recv) <= state_all_gather_bytes(plan, HEADS, DK, DV, state_bytes=8), what
    cut = any(len(pieces) > 1 for pieces in doc_pieces(plan))
    sent_any = any(rank[2] for rank in per_rank)
    assert cut == any(predicted.state_recv) == any(predicted.halo_recv) == sent_any, what


def test_single_rank_needs_no_process_group():
    plan = plan_shards([5, 9, 2], 1, "per_doc")
    (result,) = run_cases(0, None, [plan])
    assert torch.equal(result[0], torch.arange(plan.context))
    check_case("N=1", plan, 0, [result])


def run_mismatched(rank: int, group, plan: Plan):
    t = torch.zeros(plan.tokens_per_rank, HEADS, DK)
    try:
        cp_gated_delta(t, t, t, t[..., 0], t[..., 0], build_linear_dispatch(plan, rank), group)
    except ValueError as e:
        return str(e)
    return None


def test_dispatch_for_another_world_size_is_rejected(pool):
    messages = pool.run(run_mismatched, (plan_shards([8, 8, 8, 8], 4, "per_doc"),), size=2)
    assert all(m and "process group" in m for m in messages), messages


def test_bad_inputs_are_refused_in_one_line():
    d = build_linear_dispatch(plan_shards([5, 3], 1, "per_doc"), 0)
    with pytest.raises(ValueError, match="8 tokens"):
        cp_causal_conv1d(torch.zeros(7, 2), torch.zeros(2, 4), d)
    with pytest.raises(ValueError, match=r"\[C, W\]"):
        cp_causal_conv1d(torch.zeros(8, 2), torch.zeros(2, 3), d)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        build_linear_dispatch(plan_shards([5, 3], 2, "per_doc"), 2)


@pytest.mark.parametrize("needs_grad", ["q", "g", "x"])
def test_backward_runs_on_every_rank_when_one_input_needs_gradients(needs_grad):
    """Ranks 1 and 2 hold no document's first piece: their backward must still run its exchanges
    (in one process: a rank skipping a collective fails at once instead of hanging gloo)."""
    plan = LAYOUTS["a document ending at a rank boundary"](4)
    names = ("x", "w", "q", "k", "v", "g", "beta")
    want = oracle(plan, 0)[2 + names.index(needs_grad)]

    def program(rank, group):
        d = build_linear_dispatch(plan, rank, WIDTH)
        x, w, q, k, v, g, beta, gy, go = window_inputs(plan.context, 0)
        local = dict(zip(names, (x, w, q, k, v, g, beta)))
        for name in names:
            local[name] = local[name] if name == "w" else local[name][d.token_index].clone()
        local[needs_grad].requires_grad_()
        y = cp_causal_conv1d(local["x"], local["w"], d, group)
        o = cp_gated_delta(*(local[n] for n in names[2:]), d, group, chunk_size=CHUNK)
        ((y * gy[d.token_index]).sum() + (o * go[d.token_index]).sum()).backward()
        return d.token_index, local[needs_grad].grad

    got = torch.zeros_like(want)
    for idx, grad in run_ranks(plan.cp_size, program):
        got[idx] = grad
    assert (got - want).abs().max() < TOL


def test_byte_prediction_by_hand():
    """One document in per_seq's chunks at CP 2: c0 on rank 0, c1 + c2 on rank 1, c3 on rank 0.
    Rank 1 composes (rank 0 would receive c1c2's B and M, 40 bytes, beside 24): rank 0 sends c0's
    B (24 bytes at H=1, d_k=2, d_v=3, float32), rank 1 sends c3 its initial state (24); each
    continued piece receives its 3 preceding rows (5 channels, 2 bytes)."""
    plan = plan_shards([48], 2, "per_seq")
    assert [[(s.start, s.length) for s in r] for r in plan.ranks] == [[(0, 12), (36, 12)], [(12, 24)]]
    assert composers(plan) == [1]
    assert linear_comm(plan, 1, 2, 3, 5) == ([24, 24], [24, 24], [30, 30], [30, 30])
    assert state_all_gather_bytes(plan, 1, 2, 3) == 40


def test_a_piece_receives_one_state_and_composers_spread():
    """Per-Doc at CP 8 cuts each of 6 documents in 15 pieces (rank r holds pieces r and 14 - r).
    Each continued piece's owner receives one state for it and each composer the summaries of its
    document's pieces held elsewhere (one document each, over six ranks): rank 1 receives 33
    states' bytes, where sending each summary to every later piece's owner gave it the summaries
    of 12 pieces of each document (6 x 23)."""
    plan = plan_shards([4096] * 6, 8, "per_doc")
    docs = doc_pieces(plan)
    assert all([p.owner for p in pieces] == [0, 1, 2, 3, 4, 5, 6, 7, 6, 5, 4, 3, 2, 1, 0] for pieces in docs)
    chosen = composers(plan)
    assert sorted(chosen) == [1, 2, 3, 4, 5, 6]
    state = summary_values(1, 2, 2, True) * 4
    comm = linear_comm(plan, 1, 2, 2, 5)
    held = [sum(p.owner == r and j > 0 for pieces in docs for j, p in enumerate(pieces)) for r in range(8)]
    # a composer: the first piece's B and the middle pieces' [B | M] of the 12 pieces it does not hold,
    # and no state for its own two pieces of that document
    composing = (1 + 11 * 2 - 2) * state
    assert comm.state_recv == [h * state + (composing if r in chosen else 0) for r, h in enumerate(held)]
    assert comm.state_recv[1] == 33 * state and sum(comm.state_recv) == sum(comm.state_sent)
