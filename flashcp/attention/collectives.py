"""The KV exchange of context-parallel attention and its transpose for the gradients.

Forward, each rank packs its local row tensors side by side into one buffer of rows
`[recv_size + T, W]` (received rows first, then its own T rows; W: the parts' widths summed, K and
V over all KV heads, or MLA's latent and RoPE key), sends the rows named by `dispatch.send_index`
through a single collective that writes straight into the front of that buffer, then gathers
every local shard's keys with one `index_select` per part over `dispatch.kv_index`:

- "compact" and "full": one all-gather of `send_pad` rows per rank (zero padded). "compact" sends
  only non-last-shard rows, "full" sends all rows; the code path is the same.
- "needed": one all-to-all-v sending each peer exactly the prefix rows it attends to.
- "two_level": the needed rows of a CP group spanning nodes, in two all-to-all-v (the fabric once
  per node, then NVLink; `flashcp.attention.two_level`).

Backward is the transpose: scatter-add the key/value gradients onto the buffer (a row used by
several shards sums), send the received part back with the transposed collective
(reduce-scatter, or the all-to-all-v with the splits swapped) and add what comes back onto the
rows this rank sent. Nothing here reads device data on the host: every size comes from the
dispatch metadata, so the exchange stays asynchronous on GPUs.

Every buffer is sized by what this rank holds, sends and receives, and lives only as long as it
is used: the forward buffer until the keys are gathered, the backward's until it returns. What
outlives the op is the kernel's: the gathered keys and values it saves for its backward.

The collectives run through `Collectives`: torch.distributed for a process group, or any other
implementation passed as the group (`flashcp.attention.simulate` runs all ranks of a CP group in
one process on one device, which is how one GPU checks the whole op).

`record_comm()` counts the rows and bytes every collective of this module moves, so tests can
check them against the planner's predictions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flashcp.attention import two_level
from flashcp.dispatch import Dispatch

# torch 2.13 renamed the flat-tensor collectives (the old names emit FutureWarnings there);
# torch 2.11 and 2.12 only have all_gather_into_tensor / reduce_scatter_tensor.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommRecord:
    """One collective as seen by the calling rank; rows are tokens (K and V of all heads, or what
    else the exchange carries per token)."""

    op: str  # "all_gather" | "reduce_scatter" | "all_to_all"
    pass_: str  # "forward" | "backward"
    sent_rows: int  # rows this rank's data occupies on other ranks' side
    recv_rows: int  # rows this rank receives from other ranks
    row_bytes: int

    @property
    def sent_bytes(self) -> int:
        return self.sent_rows * self.row_bytes

    @property
    def recv_bytes(self) -> int:
        return self.recv_rows * self.row_bytes


_recorders: list[list[CommRecord]] = []


@contextmanager
def record_comm() -> Iterator[list[CommRecord]]:
    """Collect a `CommRecord` for every KV collective issued inside the `with` block."""
    log: list[CommRecord] = []
    _recorders.append(log)
    try:
        yield log
    finally:
        _recorders.remove(log)


def _record(op: str, pass_: str, sent_rows: int, recv_rows: int, like: torch.Tensor) -> None:
    """Log one collective; the callers count rows from the tensors handed to the collective."""
    if _recorders:
        entry = CommRecord(op, pass_, sent_rows, recv_rows, like.element_size() * math.prod(like.shape[1:]))
        for log in _recorders:
            log.append(entry)


class Collectives:
    """The collectives of the KV exchanges over one CP group, on flat row-major buffers.

    `all_gather` / `all_to_all` may run asynchronously (`async_op=True` returns an object with
    `wait()`); `reduce_scatter` sums. Splits are row counts per peer, in rank order. `ring_shift`
    (the ring's step) sends every `inp` to the next rank and receives every `out` from the
    previous one, asynchronously.
    """

    def size(self) -> int:
        raise NotImplementedError

    def rank(self) -> int:
        raise NotImplementedError

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        raise NotImplementedError

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        raise NotImplementedError

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                   async_op: bool = False):  # fmt: skip
        raise NotImplementedError

    def ring_shift(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        raise NotImplementedError


class TorchCollectives(Collectives):
    """`Collectives` over a torch.distributed process group (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def rank(self) -> int:
        return dist.get_rank(self.group)

    def all_gather(self, out, inp, async_op=False):
        return _all_gather(out, inp, group=self.group, async_op=async_op)

    def reduce_scatter(self, out, inp):
        _reduce_scatter(out, inp, group=self.group)

    def all_to_all(self, out, inp, out_splits, in_splits, async_op=False):
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=async_op)

    def ring_shift(self, pairs):
        """One `batch_isend_irecv` (peers are global ranks, which torch 2.11's P2POp takes)."""
        n, me = self.size(), self.rank()
        group = self.group or dist.group.WORLD
        nxt, prev = dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)
        ops = []
        for out, inp in pairs:
            ops += [dist.P2POp(dist.isend, inp, nxt, self.group), dist.P2POp(dist.irecv, out, prev, self.group)]
        return _AllWorks(dist.batch_isend_irecv(ops))


class _AllWorks:
    """Handles of several operations, waited for together."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def collectives(group: dist.ProcessGroup | Collectives | None) -> Collectives:
    """The collectives of `group`: itself if it implements them, else torch.distributed's."""
    return group if isinstance(group, Collectives) else TorchCollectives(group)


def _check_group(dispatch: Dispatch, comms: Collectives) -> None:
    size, rank = comms.size(), comms.rank()
    if (size, rank) != (dispatch.cp_size, dispatch.rank):
        raise ValueError(
            f"dispatch is for rank {dispatch.rank} of {dispatch.cp_size} but the process group "
            f"has this process as rank {rank} of {size}"
        )


@dataclass
class KVExchange:
    """A launched forward exchange; `wait()` hands over the filled `[recv | local]` row buffer once."""

    buffer: torch.Tensor | None
    send: torch.Tensor | None  # kept alive until the collective completes
    work: Any  # the collective's handle (dist.Work for torch.distributed), None once complete

    def wait(self) -> torch.Tensor:
        """The buffer, which the exchange then lets go of (and of the send rows): it is freed as
        soon as the caller's gather is done, not when the caller's frame ends (after the kernel)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.buffer is None:
            raise RuntimeError("this KV exchange's buffer was already handed over")
        buffer, self.buffer, self.send = self.buffer, None, None
        return buffer


def launch_kv_exchange(
    k: torch.Tensor,
    v: torch.Tensor,
    dispatch: Dispatch,
    group: dist.ProcessGroup | Collectives | None = None,
    async_op: bool = False,
) -> KVExchange:
    """Pack local K/V and start the forward collective (no autograd; see `gather_kv`)."""
    return launch_exchange((k, v), dispatch, group, async_op)


def launch_exchange(
    parts: Sequence[torch.Tensor],
    dispatch: Dispatch,
    group: dist.ProcessGroup | Collectives | None = None,
    async_op: bool = False,
) -> KVExchange:
    """Pack this rank's row tensors `parts` (each `[T, ...]`, one dtype) side by side and start
    the forward collective of `dispatch.comm` on them (no autograd; see `gather_rows`).

    With `cp_size == 1` there is nobody to talk to: no collective is issued and `group` is not
    consulted (it may be None without an initialised process group).
    """
    solo = dispatch.cp_size == 1
    comms = collectives(group)
    if not solo:
        _check_group(dispatch, comms)
    recv = dispatch.recv_size
    work = None
    first = parts[0]
    with torch.no_grad():
        buffer = first.new_empty(recv + first.shape[0], sum(_widths(parts)))
        local = buffer[recv:]
        for (a, b), part in zip(_columns(parts), parts):
            local[:, a:b] = part.reshape(part.shape[0], b - a)
        if dispatch.comm == "two_level":  # two all-to-all-v: the fabric, then NVLink
            send = None
            if not solo:
                work, send = two_level.launch(buffer[:recv], local, dispatch, comms, async_op, _record)
        elif dispatch.comm == "needed":
            send = local.index_select(0, dispatch.send_index)
            if not solo:
                work = comms.all_to_all(buffer[:recv], send, dispatch.recv_splits, dispatch.send_splits, async_op)
                me = dispatch.rank
                sent, received = len(send) - dispatch.send_splits[me], recv - dispatch.recv_splits[me]
                _record("all_to_all", "forward", sent, received, send)
        else:
            n_send, pad = dispatch.send_index.numel(), dispatch.send_pad
            send = local.new_empty(pad, *local.shape[1:])
            torch.index_select(local, 0, dispatch.send_index, out=send[:n_send])
            send[n_send:].zero_()
            if solo:
                buffer[:recv] = send
            elif pad:  # send_pad is the same on every rank: all agree to skip an empty exchange
                work = comms.all_gather(buffer[:recv], send, async_op)
                _record("all_gather", "forward", (dispatch.cp_size - 1) * len(send), recv - len(send), send)
    return KVExchange(buffer, send, work)


def _widths(parts: Sequence[torch.Tensor]) -> list[int]:
    return [math.prod(p.shape[1:]) for p in parts]


def _columns(parts: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Each part's column range in the packed row buffer."""
    ends = list(itertools.accumulate(_widths(parts)))
    return [(end - w, end) for w, end in zip(_widths(parts), ends)]


class _GatherRows(torch.autograd.Function):
    """Rows of every part for all local shards from a launched exchange; backward runs the transpose."""

    @staticmethod
    def forward(ctx, exchange: KVExchange, kv_index: torch.Tensor, dispatch: Dispatch, group, *parts):
        buffer = exchange.wait()
        ctx.dispatch, ctx.group, ctx.local_rows = dispatch, group, parts[0].shape[0]
        ctx.columns, ctx.shapes = _columns(parts), [p.shape[1:] for p in parts]
        ctx.save_for_backward(kv_index)
        n = kv_index.numel()
        return tuple(buffer[:, a:b].index_select(0, kv_index).view(n, *p.shape[1:])
                     for (a, b), p in zip(ctx.columns, parts))  # fmt: skip

    @staticmethod
    def backward(ctx, *grads):
        (kv_index,) = ctx.saved_tensors
        dispatch, group = ctx.dispatch, ctx.group
        recv = dispatch.recv_size
        ref = next(g for g in grads if g is not None)
        grad = ref.new_zeros(recv + ctx.local_rows, ctx.columns[-1][1])
        for (a, b), g in zip(ctx.columns, grads):
            if g is not None:
                grad[:, a:b].index_add_(0, kv_index, g.reshape(len(g), b - a))
        local = _transposed(grad, ctx.local_rows, dispatch, group)
        parts = (local[:, a:b].view(ctx.local_rows, *shape) for (a, b), shape in zip(ctx.columns, ctx.shapes))
        return None, None, None, None, *parts


def _transposed(grad: torch.Tensor, local_rows: int, dispatch: Dispatch, group) -> torch.Tensor:
    """The local rows' gradient: `grad [recv | local]` with the received part sent back to its
    owners by the transposed collective and added onto the rows this rank sent."""
    recv = dispatch.recv_size
    n_send = dispatch.send_index.numel()
    if dispatch.cp_size == 1:  # the "received" rows are this rank's own sent rows
        back = grad[:n_send]
    elif dispatch.comm == "two_level":
        return grad[recv:] + two_level.backward(grad[:recv], local_rows, dispatch, collectives(group), _record)
    elif dispatch.comm == "needed":
        back = grad.new_empty(n_send, *grad.shape[1:])
        collectives(group).all_to_all(back, grad[:recv], dispatch.send_splits, dispatch.recv_splits)
        me = dispatch.rank
        sent, received = recv - dispatch.recv_splits[me], len(back) - dispatch.send_splits[me]
        _record("all_to_all", "backward", sent, received, back)
    elif dispatch.send_pad:
        back = grad.new_empty(dispatch.send_pad, *grad.shape[1:])
        collectives(group).reduce_scatter(back, grad[:recv])
        _record("reduce_scatter", "backward", recv - len(back), (dispatch.cp_size - 1) * len(back), back)
        back = back[:n_send]
    else:  # nothing was exchanged: the buffer holds the local rows only
        return grad
    # Out of place: the gradients handed back live in a tensor of the local rows, so the
    # received rows' gradient is freed when this returns, not when autograd drops the parts'.
    return grad[recv:].index_add(0, dispatch.send_index, back)


def gather_rows(
    parts: Sequence[torch.Tensor],
    exchange: KVExchange,
    kv_index: torch.Tensor,
    dispatch: Dispatch,
    group: dist.ProcessGroup | Collectives | None = None,
) -> tuple[torch.Tensor, ...]:
    """Wait for `exchange` and return, per part, the rows `kv_index` selects from `[recv | local]`.

    Differentiable with respect to the local `parts` (the ones passed to `launch_exchange`):
    their gradients include what other ranks computed for the rows this rank sent them.
    """
    return _GatherRows.apply(exchange, kv_index, dispatch, group, *parts)


def gather_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    exchange: KVExchange,
    kv_index: torch.Tensor,
    dispatch: Dispatch,
    group: dist.ProcessGroup | Collectives | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_rows((k, v), ...)`: every local shard's keys and values."""
    return gather_rows((k, v), exchange, kv_index, dispatch, group)
