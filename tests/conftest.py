"""Suite-wide settings and fixtures.

No test's verdict depends on how fast the machine is: Hypothesis' per-example deadline and its
too-slow health check judge the machine's speed, not the code, and CI machines are loaded, so
both are off for every property test.
"""

import pytest
from distributed_pool import close_shared, shared
from hypothesis import HealthCheck, settings

from flashcp.data import store_source

settings.register_profile("flashcp", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("flashcp")


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
