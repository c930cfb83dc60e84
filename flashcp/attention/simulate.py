"""All ranks of a CP group in one process, on one device: the whole op checked on a single GPU.

    outs = run_ranks(n, lambda rank, group: program(rank, group))
    out, dq, dk, dv = simulate_cp_attention(plan, "compact", q, k, v, grad_out)

A rank's program (forward and backward of `cp_varlen_attention`, say) is run once per rank, one
after the other, with a `SimulatedGroup` as its process group. A collective needs every rank's
input, which a sequential run does not have when the first rank gets there, so the ranks are run
in passes: collective number i is recorded in the pass where all earlier ones were answered
correctly, and answered from those recordings in every later pass. Every collective's input
depends only on its rank's earlier collectives (the all-gather's on the local K/V, the
reduce-scatter's on the gradients computed from the gathered K/V), so after one pass per
collective plus one, the last pass runs every rank with exactly the data a real CP group would
have exchanged. Threads would avoid the repeats but deadlock on a GPU: autograd runs every
backward of one device on one worker thread, where a collective waiting for its peers blocks them.

The repeats multiply the compute by (collectives + 1), which a check at moderate sizes affords.
Programs must be deterministic in what they feed the collectives (fresh leaf tensors per pass).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from flashcp.attention.collectives import Collectives
from flashcp.attention.cp import cp_varlen_attention
from flashcp.attention.ring import build_ring_dispatch
from flashcp.dispatch import build_dispatch
from flashcp.plan.plan import Plan

_R = TypeVar("_R")


class _Recording:
    """Every rank's input to every collective, by call number, shared by one group's ranks."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.inputs: dict[int, dict[int, tuple[torch.Tensor, list[int] | None]]] = {}
        self.answered = 0  # calls below this number have every rank's correct input recorded


class _Done:
    """The handle of a collective that completed when it was issued."""

    def wait(self) -> bool:
        return True


class SimulatedGroup(Collectives):
    """Rank `rank`'s view of a simulated group for one pass (see the module docstring)."""

    def __init__(self, recording: _Recording, rank: int) -> None:
        self.recording, self._rank, self.calls = recording, rank, 0

    def size(self) -> int:
        return self.recording.size

    def rank(self) -> int:
        return self._rank

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor, in_splits: list[int] | None):
        """This call's inputs from every rank, or None while they are still being recorded."""
        call, self.calls = self.calls, self.calls + 1
        rec = self.recording
        if call < rec.answered:
            return [rec.inputs[call][r] for r in range(rec.size)]
        rec.inputs.setdefault(call, {})[self._rank] = (inp.detach().clone(), in_splits)
        out.zero_()  # a placeholder answer; this pass's later results are discarded
        return None

    def all_gather(self, out, inp, async_op=False):
        inputs = self._exchange(out, inp, None)
        if inputs is not None:
            torch.cat([x for x, _ in inputs], out=out)
        return _Done() if async_op else None

    def reduce_scatter(self, out, inp):
        inputs = self._exchange(out, inp, None)
        if inputs is not None:
            out.copy_(sum(x.chunk(self.size())[self._rank] for x, _ in inputs))

    def all_to_all(self, out, inp, out_splits, in_splits, async_op=False):
        inputs = self._exchange(out, inp, list(in_splits))
        if inputs is not None:
            torch.cat([x.split(splits)[self._rank] for x, splits in inputs], out=out)
        return _Done() if async_op else None

    def ring_shift(self, pairs):
        for out, inp in pairs:
            inputs = self._exchange(out, inp, None)
            if inputs is not None:
                out.copy_(inputs[(self._rank - 1) % self.size()][0])
        return _Done()


def run_ranks(size: int, program: Callable[[int, SimulatedGroup], _R]) -> list[_R]:
    """Each rank's result of `program(rank, group)`, as if the ranks ran as one CP group."""
    recording = _Recording(size)
    while True:
        groups = [SimulatedGroup(recording, rank) for rank in range(size)]
        results = [program(rank, group) for rank, group in enumerate(groups)]
        calls = {g.calls for g in groups}
        if len(calls) != 1:
            raise RuntimeError(f"ranks issued different numbers of collectives: {[g.calls for g in groups]}")
        if recording.answered >= calls.pop():
            return results
        recording.answered += 1


def simulate_cp_attention(
    plan: Plan,
    comm: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    backend: str = "auto",
    overlap: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward and backward of `cp_varlen_attention` on every rank of `plan`, in one process.

    `q, k, v, grad_out` hold the whole window (`[C, heads, D]`, window order); returns the output
    and the gradients of q, k and v in window order, assembled from the ranks' local rows.
    """
    if comm == "ring":
        dispatches = [build_ring_dispatch(plan, r) for r in range(plan.cp_size)]
    else:
        dispatches = [build_dispatch(plan, r, comm, overlap=overlap) for r in range(plan.cp_size)]
    dispatches = [d.to(q.device) for d in dispatches]

    def program(rank: int, group: SimulatedGroup) -> tuple[torch.Tensor, ...]:
        d = dispatches[rank]
        ql, kl, vl = (x.index_select(0, d.token_index).detach().requires_grad_() for x in (q, k, v))
        out = cp_varlen_attention(ql, kl, vl, d, group, comm=comm, backend=backend, overlap=overlap)
        out.backward(grad_out.index_select(0, d.token_index))
        return out.detach(), ql.grad, kl.grad, vl.grad

    results = run_ranks(plan.cp_size, program)
    whole = [torch.empty_like(x) for x in (q, q, k, v)]
    for d, local in zip(dispatches, results):
        for dst, src in zip(whole, local):
            dst[d.token_index] = src
    return tuple(whole)
