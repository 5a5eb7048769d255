"""The relay's PostgreSQL parts against a server that hangs (the :class:`PgProxy` of
tests/store/test_postgres_hanging_server.py makes the peer hang).

- ``dedup-relay db upgrade`` (:func:`relay.store.postgres.store.upgrade_schema`) ends with a
  StoreError within ``timeout_s`` when the server stops answering while it waits (for the
  advisory lock another upgrade holds, or for its own statements), also when cancelled from
  outside.
- A reserve that waited on another transaction's row lock past the op timeout does not land its
  PENDING after the core gave it up and released it (the client's retries would be told "in
  progress" until the lease ends): the server-side statement ends with the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from relay.core.errors import StoreError
from relay.core.interfaces import Settle, SettleOp
from relay.store.postgres import migrations
from relay.store.postgres.store import PostgresStore, upgrade_schema
from tests.support.pg_proxy import PgProxy, pg_proxy
from tests.support.postgres import private_schema


@pytest.fixture
def url() -> Iterator[str]:
    """A private empty schema (no table: the upgrade has work to do)."""
    with private_schema(upgraded=False) as url:
        yield url


@pytest.fixture
def store_url() -> Iterator[str]:
    """A private schema with the store's tables."""
    with private_schema() as url:
        yield url


@pytest.fixture
async def proxy() -> AsyncIterator[PgProxy]:
    """A PgProxy in front of the test server; resumed and closed at the end."""
    async with pg_proxy() as running:
        yield running


async def _waiting_for_advisory_lock(conn: asyncpg.Connection) -> bool:
    """Whether some session waits for an advisory lock (the upgrade, here)."""
    return bool(await conn.fetchval(
        "SELECT count(*) > 0 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND objid = $1::bigint % 4294967296", migrations._LOCK_KEY))


async def test_db_upgrade_gives_up_within_its_timeout_when_postgres_hangs(
        url: str, proxy: PgProxy) -> None:
    """Another upgrade holds the schema's advisory lock, so this one waits on it; then the
    server stops answering (the connection stays open). upgrade_schema(timeout_s=1) must
    raise StoreError within about a second; here it is still running 4 s later (and does not
    end when cancelled either: the test lets it finish once the server answers again)."""
    holder = await asyncpg.connect(url, timeout=10)
    upgrading: asyncio.Task[tuple[int, int]] | None = None
    try:
        async with holder.transaction():
            await holder.execute("SELECT pg_advisory_xact_lock($1)", migrations._LOCK_KEY)
            upgrading = asyncio.ensure_future(
                upgrade_schema(proxy.url(url), "ledger", timeout_s=1.0))
            watcher = await asyncpg.connect(url, timeout=10)
            try:
                for _ in range(100):  # connected through the proxy, waiting for the lock
                    if await _waiting_for_advisory_lock(watcher) or upgrading.done():
                        break
                    await asyncio.sleep(0.02)
            finally:
                await watcher.close()
            proxy.hang()
            started = time.monotonic()
            done, _ = await asyncio.wait({upgrading}, timeout=4.0)
            outcome = "still running 4 s later"
            if done:
                exc = upgrading.exception()
                outcome = (f"{type(exc).__name__ if exc else 'returned'} after "
                           f"{time.monotonic() - started:.1f} s")
            assert done and isinstance(upgrading.exception(), StoreError), outcome
            assert time.monotonic() - started < 2.5, outcome
    finally:
        proxy.resume()  # the server acknowledges the cancellation: the upgrade ends
        if upgrading is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(upgrading), timeout=10.0)
        await holder.close()


async def test_a_reserve_that_timed_out_on_a_row_lock_leaves_no_reservation_behind(
        store_url: str) -> None:
    """Another attempt's INSERT of the key is not committed yet, so this attempt's reserve
    waits for it past the op timeout (0.5 s) and fails; the core then releases what the
    reserve may have taken (compare-token: nothing yet). The other attempt rolls back. A
    second later the key must not hold this attempt's PENDING: a statement the relay gave up
    on must not go on to take the key (the old code's CancelRequest ended it in the server;
    a connection closed without one leaves the backend waiting for the lock, and then it
    inserts and commits)."""
    store = await PostgresStore.open(store_url, op_timeout_s=0.5, cleanup_interval_s=None)
    other = await asyncpg.connect(store_url, timeout=10)
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute(
            "INSERT INTO dedup_relay_fingerprints (key, state, token, expires_at) "
            "VALUES ('k:lock', 'pending', 'other', now() + interval '1 minute')")
        with pytest.raises(StoreError):
            await store.reserve(["k:lock"], token="mine", lease_s=60.0)
        # DedupCore._relay_dedup on a StoreError: Settler.release_quietly(keys, token)
        await store.settle([SettleOp(key="k:lock", action=Settle.RELEASE)], token="mine",
                           window_s=60.0)
        await tx.rollback()
        await asyncio.sleep(1.0)
        rows = await other.fetch("SELECT state, token FROM dedup_relay_fingerprints "
                                 "WHERE key = 'k:lock'")
        assert [tuple(r) for r in rows] == [], (
            f"the key holds {[tuple(r) for r in rows]} after its reserve failed and was "
            "released: every retry is 'in progress' until the lease (60 s) ends")
    finally:
        await other.close()
        await store.close()
