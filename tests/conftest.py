"""Suite-wide settings and fixtures.

No test's verdict depends on how fast the machine is: Hypothesis' per-example deadline and its
too-slow health check judge the machine's speed, not the code, and CI machines are loaded, so
both are off for every property test.

pytest-xdist's workers (and the processes they start, through OMP_NUM_THREADS) share the cores
instead of each taking all of them: with more threads than cores every small op's
parallel region waits for a descheduled thread, and the tests' toy tensors are all small ops (the
quick GPU check's CP section took 563 s with 2 threads a process on a loaded 2-core machine, 22 s
with 1). A user's OMP_NUM_THREADS is kept.
"""

import os

import pytest
import torch
from distributed_pool import close_shared, shared
from hypothesis import HealthCheck, settings

from flashcp.data import store_source

settings.register_profile("flashcp", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("flashcp")

if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


@pytest.fixture
def store_reads(monkeypatch) -> list[int]:
    """The lengths of the token-store documents whose tokens are read (memory-mapped) from now on."""
    read: list[int] = []
    getitem = store_source.StoreDoc.__getitem__

    def counting(self, index):
        if self._tokens is None:
            read.append(len(self))
        return getitem(self, index)

    monkeypatch.setattr(store_source.StoreDoc, "__getitem__", counting)
    return read


@pytest.fixture(scope="session")
def gloo_pool():
    """`gloo_pool(world_size, sizes=None)`: this test process's DistributedPool of that many gloo
    ranks, shared with the other tests (distributed_pool.shared); all are closed at the session's end."""
    yield shared
    close_shared()


# The longest files of the default tier, longest first: 4-rank imports, PP runs, launched jobs, compiles.
FIRST = ("tests/titan/test_hf_import_ranks.py", "tests/titan/test_pp_train.py", "tests/titan/test_launch.py",
         "tests/titan/test_e2e.py", "tests/titan/test_compile.py")  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    """The longest test files first: with `--dist loadfile` each file runs whole on one worker, in
    collection order (scripts/test.sh turns off xdist's reordering by test count, which put a long file of
    few tests last), so a long file collected late would leave the other worker idle at the end."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))
