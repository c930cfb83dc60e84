"""Moving a dispatch to the device: every tensor (the overlap split's too), pinned, non-blocking."""

from __future__ import annotations

import torch

from flashcp import plan_shards
from flashcp.dispatch import build_dispatch, Dispatch


def _tensors(d: Dispatch) -> list[torch.Tensor]:
    split = d.overlap
    nested = [] if split is None else [split.inverse, *vars(split.local).values(), *vars(split.remote).values()]
    return [t for t in [*vars(d).values(), *nested] if isinstance(t, torch.Tensor)]


def _dispatch() -> Dispatch:
    return build_dispatch(plan_shards([40, 3, 9, 1, 17, 2, 8], 2, "flashcp"), 1, "compact", overlap=True)


def test_to_moves_every_tensor_without_blocking(monkeypatch):
    d = _dispatch()
    calls = []
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        calls.append(kwargs.get("non_blocking"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    moved = d.to("meta")
    assert len(calls) == len(_tensors(d)) == 15 and all(calls)
    assert all(t.device.type == "meta" for t in _tensors(moved))
    assert (moved.max_seqlen_q, moved.overlap.local.max_seqlen_k) == (d.max_seqlen_q, d.overlap.local.max_seqlen_k)


def test_pin_memory_pins_every_tensor(monkeypatch):
    """torch pins only where an accelerator exists; here the pinning call is recorded instead."""
    d = _dispatch()
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t.clone())
    out = d.pin_memory()
    assert len(pinned) == len(_tensors(d))
    assert all(torch.equal(a, b) for a, b in zip(_tensors(out), _tensors(d)))


def test_overlap_split_partitions_the_shards():
    d = _dispatch()
    split = d.overlap
    rows = torch.cat([split.local.rows, split.remote.rows])
    assert torch.equal(rows[split.inverse], torch.arange(d.token_index.numel()))
    assert bool((split.remote.kv_index < d.recv_size).any())  # remote shards read received rows
    assert bool((split.local.kv_index >= 0).all()) and bool((split.local.kv_index < d.token_index.numel()).all())
    assert build_dispatch(plan_shards([8, 8], 2, "per_doc"), 0).overlap is None  # only on request
