"""The PostgreSQL store's lock order and readiness.

- The cleanup of expired rows and a reserve taking over expired rows lock them in one order
  (key order): a multi-recipient message sent again once its records expired does not deadlock
  with the cleanup every relay runs every 5 s.
- ``PostgresStore.ping`` (the readiness probe) fails on a database that takes no writes (a hot
  standby after a failover, ``default_transaction_read_only``): ``/readyz`` does not say 200
  while every reserve would fail.
- A reserve with ``resend_unknown`` (unknown_policy = send) that waited for the row of an
  attempt whose UNKNOWN settle was committing reports what it took over (UNKNOWN), so the core
  warns and counts ``relay_unknown_resent_total``.

Two blocking transactions (row locks released in key order) fix the interleaving that the
scheduler may otherwise produce; each test runs in a private schema of the shared server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import pytest

from relay.core.errors import StoreError
from relay.core.interfaces import Settle, SettleOp, State
from relay.store.postgres.store import PostgresStore
from tests.support.postgres import private_schema, row_locks


@pytest.fixture
def url() -> Iterator[str]:
    """A private schema with the store's tables."""
    with private_schema() as url:
        yield url


async def test_the_cleanup_and_a_reserve_of_expired_keys_do_not_deadlock(url: str) -> None:
    """Keys k:b and k:a hold SENT records whose window passed (k:b first on disk). A cleanup
    round and a reserve of both keys (the message sent again) run while two transactions
    hold the rows; when those let go (k:a first), both calls must answer: the reserve takes
    both keys (or the cleanup deleted them first, and the reserve inserts them)."""
    store = await PostgresStore.open(url, op_timeout_s=10.0, cleanup_interval_s=None)
    admin = await asyncpg.connect(url, timeout=10)
    try:
        for key in ("k:b", "k:a"):
            await admin.execute(
                "INSERT INTO dedup_relay_fingerprints (key, state, at, reply, expires_at) "
                "VALUES ($1, 'sent', now() - interval '2 days', '250 ok', "
                "now() - interval '1 hour')", key)
        async with row_locks(url, ["k:a", "k:b"]) as blocks:
            cleanup = asyncio.ensure_future(store.delete_expired())
            await asyncio.sleep(0.3)  # the cleanup waits for its first row (k:b, by ctid)
            reserve = asyncio.ensure_future(
                store.reserve(["k:a", "k:b"], token="again", lease_s=60.0))
            await asyncio.sleep(0.3)  # the reserve waits for k:a
            for tx in blocks:
                await tx.rollback()
                await asyncio.sleep(0.3)
            results = await asyncio.gather(cleanup, reserve, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"failed: {errors}"
        reservations = results[1]
        assert isinstance(reservations, list)
        assert [r.reserved for r in reservations] == [True, True]
    finally:
        await admin.close()
        await store.close()


async def test_the_store_probe_fails_when_the_database_takes_no_writes(url: str) -> None:
    """The same schema through a session that is read-only (what a hot standby gives): the
    reserve fails, and the probe that /readyz reads must fail too."""
    store = await PostgresStore.open(f"{url}&default_transaction_read_only=on",
                                     op_timeout_s=5.0, cleanup_interval_s=None)
    try:
        with pytest.raises(StoreError, match="read-only"):
            await store.reserve(["k:ro"], token="t", lease_s=60.0)
        with pytest.raises(StoreError):
            await store.ping()
    finally:
        await store.close()


async def test_a_reserve_that_takes_over_an_unknown_record_says_it_found_one(url: str) -> None:
    """Attempt X holds k:u (PENDING); its UNKNOWN settle is held behind a row lock; attempt
    Y's reserve (resend_unknown) starts meanwhile and waits behind it. When the lock goes,
    X's UNKNOWN lands and Y takes the record over: Y's reservation must say it found UNKNOWN."""
    store = await PostgresStore.open(url, op_timeout_s=10.0, cleanup_interval_s=None)
    blocker = await asyncpg.connect(url, timeout=10)
    try:
        [first] = await store.reserve(["k:u"], token="X", lease_s=60.0)
        assert first.reserved
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute(
            "SELECT 1 FROM dedup_relay_fingerprints WHERE key = 'k:u' FOR UPDATE")
        settle = asyncio.ensure_future(store.settle(
            [SettleOp(key="k:u", action=Settle.UNKNOWN)], token="X", window_s=600.0))
        await asyncio.sleep(0.3)  # X's settle waits for the row
        reserve = asyncio.ensure_future(
            store.reserve(["k:u"], token="Y", lease_s=60.0, resend_unknown=True))
        await asyncio.sleep(0.3)  # Y's reserve took its snapshot (PENDING X) and waits
        await tx.rollback()
        settled, [taken] = await asyncio.gather(settle, reserve)
        assert settled == [True]
        assert taken.reserved  # Y holds the key now, over X's UNKNOWN
        assert taken.found is not None and taken.found.state is State.UNKNOWN, taken
    finally:
        await blocker.close()
        await store.close()
