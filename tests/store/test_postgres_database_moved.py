"""A database that moved (a failover that repoints the DNS name, the old address dropping
packets) is reached again as soon as the new primary answers: connects still waiting on the
old address do not hold every slot of the pool until asyncpg's own connect timeout (60 s).

The failover is a proxy: connections it accepts while "partitioned" are read and never
answered (the old primary's address drops them), those it accepts afterwards go to the shared
server (the new primary). Each test works in a private schema of the shared server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from relay.core.errors import StoreError
from relay.store.postgres.store import PostgresStore
from tests.support.pg_proxy import PgProxy
from tests.support.postgres import POSTGRES_URL, private_schema

OP_TIMEOUT_S = 1.0
"""The store's bound of a call (its wait for a connection: 0.4 s)."""
POOL_SIZE = 3
"""The store's pool (the relay's is 10: the same, ten calls later)."""


@pytest.fixture
def url() -> Iterator[str]:
    """A private schema with the store's tables."""
    with private_schema() as url:
        yield url


async def test_the_store_answers_soon_after_a_failover_to_a_new_address(url: str) -> None:
    """Pool of 3, op timeout 1 s. While the old address drops packets, 3 concurrent pings
    fail (StoreError within about 1 s). The new primary then answers every new connection:
    within 3 s one ping succeeds."""
    parts = urlsplit(POSTGRES_URL)
    proxy = PgProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    await proxy.start()
    store = await PostgresStore.open(proxy.url(url), op_timeout_s=OP_TIMEOUT_S,
                                     pool_size=POOL_SIZE, check_schema=False,
                                     cleanup_interval_s=None)
    try:
        proxy.partitioned = True
        loop = asyncio.get_running_loop()
        started = loop.time()
        failed = await asyncio.gather(*(store.ping() for _ in range(POOL_SIZE)),
                                      return_exceptions=True)
        assert all(isinstance(f, StoreError) for f in failed), failed
        assert loop.time() - started < OP_TIMEOUT_S + 0.5
        proxy.partitioned = False  # the name now points at the new primary
        healed = loop.time()
        errors: list[str] = []
        while loop.time() - healed < 3.0:
            try:
                await store.ping()
            except StoreError as exc:
                errors.append(str(exc))
                await asyncio.sleep(0.1)
                continue
            break
        else:
            pytest.fail(f"no call reached the new primary in 3 s ({len(errors)} failed, "
                        f"{proxy.blackholed} connects to the old address held the pool); "
                        f"the last: {errors[-1]}")
    finally:
        await proxy.close()  # ends the connects still waiting on the old address
        await store.close()
