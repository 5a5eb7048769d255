"""Second attack on the audit ledger's fixes of issue 13 (e1a9432: ``decided_at`` moved onto the
database's clock); ``xfail(strict=True)`` until fixed.

e1a9432 measures the offset of the relay's clock in the statement that writes a batch
(``now()`` less the writer's clock when it sent it) and adds it to every row of the batch. A
row queued during a ledger outage is written long after its decision: when the relay's clock
was stepped in between (NTP or chrony correcting the very clock that was off, a VM resumed and
resynchronised), the offset measured at the write is not the one the row's ``decided_at`` was
read with, and the row keeps (or gains) the error the fix was meant to remove. Relay A's clock
runs 10 minutes ahead while it relays during a ledger outage; its clock is corrected before the
ledger comes back; relay B then suppresses the same message: ``history`` lists the duplicate
before the copy that was sent, the symptom e1a9432 fixed for a clock that stays wrong.

The outage is :class:`tests.support.pg_proxy.PgProxy` refusing A's ledger connections; the
clock is the core's and the ledger writer's of an in-loop relay (one host clock).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import asyncpg
import pytest

from relay.store.postgres import migrations
from relay.store.postgres.ledger_read import LedgerReader
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


@pytest.mark.xfail(strict=True, reason=(
    "e1a9432 corrects decided_at by the offset measured when the batch is written, not when "
    "the row was decided: a row queued through a ledger outage across a clock step keeps the "
    "old error; fix: carry the decision's monotonic time and write now() less the time "
    "elapsed since (or measure the offset at the decision)"))
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
        reader = await LedgerReader.open(ledger_url)
        try:
            outcomes = [row.outcome for row in await reader.history(keys[0], limit=10)]
        finally:
            await reader.close()
        assert outcomes == ["relayed", "suppressed"], outcomes
    finally:
        await proxy.close()
