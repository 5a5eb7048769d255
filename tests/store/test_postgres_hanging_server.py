"""The PostgreSQL store and the audit ledger's writer against a server that stops answering.

- A PostgreSQL that stops answering in the middle of a statement (the TCP connection stays
  open: a paused VM, a partition dropping packets) holds a store call, and the ledger's writer,
  no longer than the op timeout: the connection is terminated, not handed back after a
  cancellation the server never acknowledges.
- A required ledger that is down keeps a bounded number of rows of the messages it refuses.
- ``close()`` wakes a writer sleeping its retry pause: rows queued during an outage land at stop
  when the database is back.
- A renew and a reserve lock their rows in one order (key order): they do not deadlock.

The peer that hangs or refuses is :class:`PgProxy`, a TCP proxy in the test's loop in front of
the shared PostgreSQL (``RELAY_TEST_POSTGRES_URL``); each test works in a private schema.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import asyncpg
import pytest

from relay.core.errors import StoreError
from relay.core.interfaces import LedgerEntry
from relay.store.postgres import ledger as ledger_module
from relay.store.postgres.ledger import LedgerOptions, PostgresLedger
from relay.store.postgres.store import PostgresStore
from tests.support.pg_proxy import PgProxy, pg_proxy
from tests.support.postgres import POSTGRES_URL, ledger_schema, row_locks


@pytest.fixture
def url() -> Iterator[str]:
    """A private schema with the store's and the ledger's tables."""
    with ledger_schema(store=True) as url:
        yield url


@pytest.fixture
async def proxy() -> AsyncIterator[PgProxy]:
    """A PgProxy in front of the test server; resumed and closed at the end."""
    async with pg_proxy() as running:
        yield running


@dataclass
class Counted:
    """A LedgerMetrics that keeps what it was told; ``went_down`` is set at the first
    ``component_up("ledger", False)``."""

    written: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    queued: int = 0
    up: bool = True
    went_down: asyncio.Event = field(default_factory=asyncio.Event)

    def ledger_written(self, rows: int) -> None:
        self.written += rows

    def ledger_dropped(self, reason: str, rows: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + rows

    def ledger_queued(self, rows: int) -> None:
        self.queued = rows

    def component_up(self, component: str, up: bool) -> None:
        self.up = up
        if not up:
            self.went_down.set()

    def in_doubt_unresolved(self, count: int) -> None:
        del count


def entry(n: int) -> LedgerEntry:
    """A relayed recipient's decision (row ``n``)."""
    return LedgerEntry(decided_at=time.time(), outcome="relayed",
                       recipient=f"user{n}@example.net", store_key=f"k:{n}", template="t",
                       dedupe_key=f"key-{n}")


async def count_rows(url: str) -> int:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM dedup_relay_ledger"))
    finally:
        await conn.close()


# -- a PostgreSQL that hangs mid-statement -------------------------------------------------------


async def test_a_reserve_fails_within_the_op_timeout_when_postgres_hangs_mid_statement(
        url: str, proxy: PgProxy) -> None:
    """The store's connection is open and used; the peer then keeps the connection and never
    answers. A reserve must raise StoreError within about its op timeout (0.5 s here), so the
    core answers 451 and the client is not held: it is still waiting 3 s later."""
    store = await PostgresStore.open(proxy.url(url), op_timeout_s=0.5, cleanup_interval_s=None)
    try:
        await store.ping()  # a pooled connection, established through the proxy
        proxy.hang()
        started = time.monotonic()
        outcome = "hung for 3 s"
        try:
            await asyncio.wait_for(
                store.reserve(["k:hang"], token="t1", lease_s=30.0), timeout=3.0)
            outcome = "answered"
        except StoreError:
            outcome = f"StoreError after {time.monotonic() - started:.2f} s"
        except TimeoutError:
            pass
        assert outcome.startswith("StoreError") and time.monotonic() - started < 2.0, outcome
    finally:
        proxy.resume()
        await store.close()


async def test_a_required_ledger_says_down_when_postgres_hangs_mid_write(
        url: str, proxy: PgProxy) -> None:
    """A required ledger whose database hangs while a batch is in flight: within a few op
    timeouts (0.5 s) it must read down and stop admitting (the relay answers 451 4.3.0 and
    /readyz is 503). Here it still says up and admits 3 s later."""
    metrics = Counted()
    ledger = await PostgresLedger.open(
        proxy.url(url), metrics=metrics, op_timeout_s=0.5,
        options=LedgerOptions(required=True, queue_max=1000), cleanup_interval_s=None,
        gauge_interval_s=None)
    try:
        ledger.record([entry(0)])
        for _ in range(250):  # the first row lands: the pooled connection is open
            if metrics.written:
                break
            await asyncio.sleep(0.02)
        assert metrics.written == 1
        proxy.hang()
        ledger.record([entry(1)])
        await asyncio.sleep(3.0)
        state = (ledger.status().up, ledger.admits())
        assert state == (False, False), f"(up, admits) = {state} 3 s into the hang"
    finally:
        proxy.resume()
        await ledger.close(flush_s=2.0)


# -- a required ledger that is down ----------------------------------------------------------------


async def test_a_required_ledger_that_is_down_keeps_its_queue_bounded() -> None:
    """The ledger's database refuses connections from the start (required, queue of 10 rows);
    the core refuses 200 messages 451 and records each refusal. The queue may pass its bound
    by the messages admitted before it went down (none here), not by every refusal."""
    parts = urlsplit(POSTGRES_URL)
    dead = PgProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    await dead.start()
    dead.refuse()
    metrics = Counted()
    ledger = await PostgresLedger.open(
        dead.url(POSTGRES_URL), metrics=metrics, op_timeout_s=0.5,
        options=LedgerOptions(required=True, queue_max=10), cleanup_interval_s=None,
        gauge_interval_s=None)
    try:
        assert not ledger.admits()
        for n in range(200):  # what DedupCore.process does for a message it may not admit
            assert not ledger.admits()
            ledger.record([entry(n)], admitted=False)  # as DedupCore.process records it
            await asyncio.sleep(0)
        assert ledger.status().queued <= 10, (
            f"{ledger.status().queued} rows queued for a queue of 10, all of refused messages")
    finally:
        await ledger.close(flush_s=0)
        await dead.close()


# -- close() after an outage ---------------------------------------------------------------------


async def test_close_after_an_outage_writes_the_queue_at_once(
        url: str, proxy: PgProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger's database refused long enough for the writer's pause to reach its 5 s
    cap (RETRY_MIN_S is set to it here instead of waiting 6 s of doubling), then answers
    again; the relay stops right then (close with the relay's 5 s flush). Every queued row
    must land, and close must not wait out the pause."""
    monkeypatch.setattr(ledger_module, "RETRY_MIN_S", ledger_module.RETRY_MAX_S)
    metrics = Counted()
    ledger = await PostgresLedger.open(
        proxy.url(url), metrics=metrics, op_timeout_s=2.0, batch_rows=500,
        options=LedgerOptions(queue_max=20000), cleanup_interval_s=None,
        gauge_interval_s=None)
    closed = False
    try:
        proxy.refuse()
        for n in range(0, 4000, 100):
            ledger.record([entry(i) for i in range(n, n + 100)])
        await asyncio.wait_for(metrics.went_down.wait(), timeout=5.0)
        proxy.resume()  # the database is back; the relay is told to stop now
        started = time.monotonic()
        await ledger.close(flush_s=5.0)  # relay.app.LEDGER_FLUSH_S
        closed = True
        took = time.monotonic() - started
        landed = await count_rows(url)
        assert (landed, metrics.dropped) == (4000, {}), (
            f"{landed} rows landed, dropped {metrics.dropped}, close took {took:.2f} s")
        assert took < 2.0, f"close took {took:.2f} s with the database answering"
    finally:
        if not closed:
            await ledger.close(flush_s=0)


# -- lock order ------------------------------------------------------------------------------------


async def test_a_renew_and_a_reserve_of_the_same_keys_do_not_deadlock(url: str) -> None:
    """Attempt X holds keys k:a and k:b (written b first, so b is first on disk) and renews
    them while attempt Y (a retry of the same message on another relay) reserves them. Two
    blocking transactions (row locks on k:a, then k:b, released in that order) fix the
    interleaving the scheduler may produce: Y takes k:a and waits for k:b, the renew takes
    k:b and waits for k:a. Both calls must answer; here PostgreSQL kills one (deadlock)."""
    store = await PostgresStore.open(url, op_timeout_s=10.0, cleanup_interval_s=None)
    try:
        await store.reserve(["k:b"], token="X", lease_s=60.0)
        await store.reserve(["k:a"], token="X", lease_s=60.0)
        async with row_locks(url, ["k:a", "k:b"]) as blocks:
            renew = asyncio.ensure_future(store.renew(["k:a", "k:b"], token="X", lease_s=60.0))
            await asyncio.sleep(0.3)  # the renew has k:... whichever its plan reaches first
            reserve = asyncio.ensure_future(store.reserve(["k:a", "k:b"], token="Y",
                                                          lease_s=60.0))
            await asyncio.sleep(0.3)
            await blocks[0].rollback()  # k:a free: Y (queued on it) or the renew takes it
            await asyncio.sleep(0.3)
            await blocks[1].rollback()
            results = await asyncio.gather(renew, reserve, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"failed: {errors}"
        assert results[0] == [True, True]
    finally:
        await store.close()
