"""The test pool's own guards: a call that leaves the ranks with different process-group counts
(a mesh built on some ranks only) fails naming itself, since the pool's next group would hang; a
shared pool whose ranks hold many groups (each polling while it lives) is replaced."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import distributed_pool
from distributed_pool import DistributedPool, shared


def make_group(rank: int, group) -> int:
    return dist.get_world_size(dist.new_group([0]))


def test_a_group_made_on_some_ranks_only_fails_the_call_and_retires_the_pool():
    with DistributedPool(world_size=2, sizes=(1, 2), timeout=600) as pool:
        assert pool.run(make_group) == [1, -1]  # every rank joins the call: the pool stays usable
        assert not pool.failed
        with pytest.raises(RuntimeError, match=r"make_group created process groups on some ranks only .*\[\d+, \d+\]"):
            pool.run(make_group, size=1)  # rank 1 sits the call out
        assert pool.failed


def test_a_shared_pool_holding_many_groups_is_replaced(monkeypatch):
    pool = shared(2)
    pool.run(make_group)
    monkeypatch.setattr(distributed_pool, "MAX_GROUPS", pool.groups - 1)
    fresh = shared(2)
    assert fresh is not pool and fresh.groups < pool.groups and not fresh.failed
    assert not any(p.is_alive() for p in pool._procs)  # the old ranks exited, their groups' threads with them
    assert fresh.run(make_group) == [1, -1]
