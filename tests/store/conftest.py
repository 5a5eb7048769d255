"""The private Redis Cluster and Sentinel set of the store tests: one of each per test module
that asks for it (module scope: a module's tests share them; they take seconds to start)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.redis_servers import Cluster, SentinelSet, redis_cluster, redis_sentinel


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A private three-master, three-replica Redis Cluster for this module."""
    with redis_cluster() as servers:
        yield servers


@pytest.fixture(scope="module")
def sentinel() -> Iterator[SentinelSet]:
    """A private master, replica and sentinel for this module."""
    with redis_sentinel() as servers:
        yield servers
