"""The audit ledger lists a key's rows in the order the decisions were taken, whatever the clocks
of the relays that wrote them (``dedup-relay history``).

Two relays share one store (Redis: every deciding time is the store's) and one ledger. Relay A's
wall clock runs 10 minutes ahead. A relays a message; then B is handed the same message and
suppresses it as a duplicate: ``history`` lists the send before the duplicate (design.md §7.5).

The skew is the core's clock (``DedupCore._clock``, what a row's ``decided_at`` is read from)
of an in-loop relay, set 600 s ahead.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg

from relay.store.postgres.ledger_read import LedgerReader
from tests.support.clients import message, send
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

RCPT = "user@example.net"


async def _outcomes(ledger_url: str, count: int) -> tuple[str, list[str]]:
    """The store key of the ledger's rows and their outcomes as ``history`` lists them, once
    ``count`` rows landed (within 10 s)."""
    deadline = time.monotonic() + 10.0
    while True:
        conn = await asyncpg.connect(ledger_url, timeout=10)
        try:
            keys = [r["store_key"] for r in await conn.fetch(
                "SELECT store_key FROM dedup_relay_ledger")]
        finally:
            await conn.close()
        if len(keys) >= count or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert len(keys) == count and len(set(keys)) == 1, keys
    async with await LedgerReader.open(ledger_url) as reader:
        rows = await reader.history(keys[0], limit=10)
    return keys[0], [row.outcome for row in rows]


async def test_history_lists_a_send_before_its_duplicate_when_the_sender_runs_ahead(
        make_relay: MakeRelay, sink: Sink, ledger_url: str) -> None:
    """Relay A (clock +600 s) relays; relay B (same store, same ledger) then suppresses the
    same message; both rows land within a second. history must list relayed, then
    suppressed."""
    a = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url)
    b = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                         store_prefix=a.settings.store_prefix)
    assert a.core is not None and a.ledger is not None
    ahead = lambda: time.time() + 600.0  # noqa: E731  # A's host clock runs 10 minutes ahead
    a.core._clock = ahead  # the clock of A's decisions ...
    a.ledger._clock = ahead  # ... and of its ledger writer: one host clock
    data = message(key="skew-1")
    assert (await send(a.port, [RCPT], data)).code == 250
    await _outcomes(ledger_url, 1)  # A's row landed before B decides
    assert (await send(b.port, [RCPT], data)).code == 250
    assert sink.handler.copies_to(RCPT) == 1
    _, outcomes = await _outcomes(ledger_url, 2)
    assert outcomes == ["relayed", "suppressed"], outcomes
