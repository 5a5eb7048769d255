"""The audit ledger's order across a step of a relay's clock, and a release that lost a race.

- Each row's ``decided_at`` is put on the database's clock from the offset measured when the
  row was decided, not when it was written: a row queued through a ledger outage keeps its
  place in time across a step of the relay's clock (NTP correcting the clock that was off, a VM
  resumed), so ``history`` lists the send before a duplicate another relay suppressed after it.
- A relay about a second off whose measured offset crosses a second keeps its own rows in order
  (a duplicate it suppressed right after the send is listed after the send).
- A ``release`` that deleted nothing because the record changed between the command's inspect
  and its compare-and-delete (an owed UNKNOWN settle landed) writes no row that resolves the
  decision still in doubt: ``in-doubt`` and the gauge keep listing it.
- A ``mark-sent`` whose record a retry took over between the command's inspect and its
  compare-and-set writes nothing over the retry's record, and no row.

The outage is :class:`tests.support.pg_proxy.PgProxy` refusing A's ledger connections; the
clock is the core's and the ledger writer's of an in-loop relay (one host clock). The release
and the mark-sent run as processes on a PostgreSQL store (the lock of X's settle or of the
retry's take-over, held by the test, orders the race).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import pytest

from relay.store.postgres import migrations
from relay.store.postgres.ledger_read import LedgerReader
from tests.support.cli import run_cli
from tests.support.clients import message, send
from tests.support.pg_proxy import PgProxy
from tests.support.postgres import private_schema, run_apart
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

RCPT = "user@example.net"


async def _upgrade_ledger(url: str) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await migrations.upgrade(conn, "ledger")
    finally:
        await conn.close()


@pytest.fixture
def ledger_url() -> Iterator[str]:
    """A private schema holding the ledger's table."""
    with private_schema(upgraded=False) as url:
        run_apart(_upgrade_ledger(url))
        yield url


async def _rows(ledger_url: str, count: int) -> list[str]:
    """The store keys of the ledger's rows once ``count`` landed (within 10 s)."""
    deadline = time.monotonic() + 10.0
    while True:
        conn = await asyncpg.connect(ledger_url, timeout=10)
        try:
            keys = [r["store_key"] for r in await conn.fetch(
                "SELECT store_key FROM dedup_relay_ledger")]
        finally:
            await conn.close()
        if len(keys) >= count or time.monotonic() > deadline:
            return keys
        await asyncio.sleep(0.05)


async def _history_outcomes(url: str, key: str) -> list[str]:
    """The outcomes ``history`` lists for ``key``, oldest first."""
    async with await LedgerReader.open(url) as reader:
        return [row.outcome for row in await reader.history(key, limit=10)]


async def test_history_order_survives_a_clock_step_during_a_ledger_outage(
        make_relay: MakeRelay, sink: Sink, ledger_url: str) -> None:
    """A (clock +600 s) relays while its ledger is unreachable; A's clock is corrected; the
    ledger comes back and A's row lands; B (same store, same ledger) suppresses the same
    message. history must list relayed, then suppressed."""
    parts = urlsplit(ledger_url)
    proxy = PgProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    await proxy.start()
    try:
        a = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=proxy.url(ledger_url))
        b = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                             store_prefix=a.settings.store_prefix)
        assert a.core is not None and a.ledger is not None
        ahead = lambda: time.time() + 600.0  # noqa: E731  # A's host clock, 10 minutes ahead
        a.core._clock = ahead
        a.ledger._clock = ahead
        proxy.refuse()  # the ledger's database is unreachable from A
        data = message(key="step-1")
        assert (await send(a.port, [RCPT], data)).code == 250
        await asyncio.sleep(0.3)  # A's writer failed its batch: the row waits in its queue
        assert await _rows(ledger_url, 0) == []
        a.core._clock = time.time  # NTP steps A's clock back to the right time
        a.ledger._clock = time.time
        proxy.resume()
        keys = await _rows(ledger_url, 1)
        assert len(keys) == 1, keys
        assert (await send(b.port, [RCPT], data)).code == 250
        assert sink.handler.copies_to(RCPT) == 1
        keys = await _rows(ledger_url, 2)
        assert len(keys) == 2 and len(set(keys)) == 1, keys
        outcomes = await _history_outcomes(ledger_url, keys[0])
        assert outcomes == ["relayed", "suppressed"], outcomes
    finally:
        await proxy.close()


async def test_one_relays_rows_keep_their_order_when_its_offset_crosses_a_second(
        make_relay: MakeRelay, sink: Sink, ledger_url: str) -> None:
    """Relay A's clock runs 0.95 s ahead when it relays, 1.25 s ahead when it suppresses the
    copy right after (its send's row written meanwhile). history must list relayed, then
    suppressed."""
    a = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url)
    assert a.core is not None and a.ledger is not None
    offset = [0.95]

    def clock() -> float:
        return time.time() + offset[0]

    a.core._clock = clock
    a.ledger._clock = clock
    data = message(key="offset-1")
    watcher = await asyncpg.connect(ledger_url, timeout=10)
    try:
        assert (await send(a.port, [RCPT], data)).code == 250
        deadline = time.monotonic() + 5.0
        while not await watcher.fetchval("SELECT count(*) FROM dedup_relay_ledger"):
            assert time.monotonic() < deadline, "the send's row never landed"
            await asyncio.sleep(0.005)  # polls the database
    finally:
        await watcher.close()
    offset[0] = 1.25
    assert (await send(a.port, [RCPT], data)).code == 250
    assert sink.handler.copies_to(RCPT) == 1
    keys = await _rows(ledger_url, 2)
    assert len(keys) == 2 and len(set(keys)) == 1, keys
    outcomes = await _history_outcomes(ledger_url, keys[0])
    assert outcomes == ["relayed", "suppressed"], outcomes


@pytest.fixture
def both_url() -> Iterator[str]:
    """A private schema holding the store's and the ledger's tables."""
    with private_schema() as url:
        run_apart(_upgrade_ledger(url))
        yield url


async def _in_doubt(url: str) -> list[str | None]:
    """The store keys ``dedup-relay in-doubt`` lists (any age)."""
    reader = await LedgerReader.open(url)
    try:
        return [row.store_key for row in await reader.in_doubt(older_than_s=0, limit=10)]
    finally:
        await reader.close()


async def _waiting_for(conn: asyncpg.Connection, holder: asyncpg.Connection,
                      within_s: float) -> bool:
    """Whether a session waits for a lock ``holder``'s transaction holds (polled up to
    ``within_s`` seconds; other sessions of the server, other tests', do not count)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                holder.get_server_pid()):
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_release_that_lost_a_race_leaves_the_decision_in_doubt(
        both_url: str, tmp_path: Path) -> None:
    """X's record is SENDING past its lease (in doubt; its ``unknown`` row is in the ledger);
    X's owed UNKNOWN settle holds the row when the operator's release reads it, and commits
    while the release waits for the row. The release deletes nothing (exit 1): the record is
    UNKNOWN in the store, so ``in-doubt`` must still list its key."""
    key = "race:k1"
    conn = await asyncpg.connect(both_url, timeout=10)
    settle = await asyncpg.connect(both_url, timeout=10)
    try:
        await conn.execute(
            "INSERT INTO dedup_relay_fingerprints (key, state, token, at, expires_at, lease_ms) "
            "VALUES ($1, 'sending', 'X', now() - interval '2 minutes', "
            "now() + interval '1 hour', 60000)", key)
        await conn.execute(
            "INSERT INTO dedup_relay_ledger (row_id, decided_at, action, outcome, store_key, "
            "recipient, message_id) VALUES (gen_random_uuid(), now() - interval '2 minutes', "
            "'decide', 'unknown', $1, 'u***@example.net', '<m1@example.com>')", key)
        assert await _in_doubt(both_url) == [key]
        tx = settle.transaction()
        await tx.start()  # X's owed UNKNOWN settle, landing
        await settle.execute(
            "UPDATE dedup_relay_fingerprints SET state = 'unknown', token = NULL, at = now(), "
            "lease_ms = NULL WHERE key = $1", key)
        env = {"RELAY_STORE": both_url, "RELAY_LEDGER": both_url,
               "RELAY_STORE_PREFIX": "race:"}
        released = asyncio.ensure_future(asyncio.to_thread(
            run_cli, "release", "--store-key", key, "--reason", "smarthost log: not received",
            cwd=tmp_path, env=env))
        assert await _waiting_for(conn, settle, 20.0), "the release never waited for X"
        await tx.commit()
        done = await released
        assert '"released": false' in done.stdout, (done.returncode, done.stdout, done.stderr)
        assert await conn.fetchval("SELECT state FROM dedup_relay_fingerprints WHERE key = $1",
                                   key) == "unknown"  # still in doubt in the store
        listed = await _in_doubt(both_url)
        assert listed == [key], (listed, done.stdout)
    finally:
        await settle.close()
        await conn.close()


async def test_a_mark_sent_that_lost_a_race_to_a_retry_leaves_the_retrys_record(
        both_url: str, tmp_path: Path) -> None:
    """X's record is UNKNOWN (in doubt in the ledger). A retry takes the key over (PENDING of
    its own) and holds the row when the operator's ``mark-sent`` has read it; it commits while
    the mark-sent waits for the row. The mark-sent writes nothing (compare-and-set): exit 1,
    ``"marked_sent": false``, the refusal on stderr, the retry's record kept, no ledger row
    (the decision is still in doubt)."""
    key = "race:k2"
    conn = await asyncpg.connect(both_url, timeout=10)
    retry = await asyncpg.connect(both_url, timeout=10)
    try:
        await conn.execute(
            "INSERT INTO dedup_relay_fingerprints (key, state, at, expires_at) "
            "VALUES ($1, 'unknown', now() - interval '2 minutes', now() + interval '1 hour')",
            key)
        await conn.execute(
            "INSERT INTO dedup_relay_ledger (row_id, decided_at, action, outcome, store_key, "
            "recipient, message_id) VALUES (gen_random_uuid(), now() - interval '2 minutes', "
            "'decide', 'unknown', $1, 'u***@example.net', '<m2@example.com>')", key)
        tx = retry.transaction()
        await tx.start()  # the retry's take-over (unknown_policy = send), landing
        await retry.execute(
            "UPDATE dedup_relay_fingerprints SET state = 'pending', token = 'Y', at = NULL, "
            "expires_at = now() + interval '30 seconds' WHERE key = $1", key)
        env = {"RELAY_STORE": both_url, "RELAY_LEDGER": both_url,
               "RELAY_STORE_PREFIX": "race:"}
        marking = asyncio.ensure_future(asyncio.to_thread(
            run_cli, "mark-sent", "--store-key", key, "--reason", "smarthost log: delivered",
            cwd=tmp_path, env=env))
        assert await _waiting_for(conn, retry, 20.0), "the mark-sent never waited for the retry"
        await tx.commit()
        done = await marking
        outcome = (done.returncode, done.stdout, done.stderr)
        row = await conn.fetchrow(
            "SELECT state, token FROM dedup_relay_fingerprints WHERE key = $1", key)
        assert (row["state"], row["token"]) == ("pending", "Y"), outcome
        assert done.returncode == 1 and '"marked_sent": false' in done.stdout, outcome
        assert "the record changed while it was being marked sent" in done.stderr, outcome
        assert await _in_doubt(both_url) == [key], outcome
    finally:
        await retry.close()
        await conn.close()
