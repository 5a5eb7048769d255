"""The audit ledger's in-doubt follow-up counts the in-doubt records a relay leaves when it dies
after the final dot.

A relay killed (OOM, SIGKILL, power) while the smarthost held its reply to the final dot leaves
a SENDING record that reads as UNKNOWN once its lease passes without a heartbeat (design.md
§7.2), and no ``unknown`` ledger row. The client's retry reaches another relay, which answers
``250`` as in doubt (``suppressed_unknown``, unknown_policy = suppress) and writes that row:
``dedup-relay in-doubt`` and the gauge behind ``DedupRelayInDoubtUnresolved`` count it.

The dead relay's record is made with the store's own calls (reserve, then SENDING with a 1 s
lease, then nothing: no heartbeat), as a killed relay leaves it.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg

from relay.core.interfaces import Settle, SettleOp
from relay.core.keys import recipient_keys
from relay.store.postgres.ledger_read import LedgerReader
from tests.support.clients import message, send
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

RCPT = "user@example.net"


async def _row_count(url: str) -> int:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM dedup_relay_ledger"))
    finally:
        await conn.close()


async def test_in_doubt_lists_a_record_left_in_doubt_by_a_relay_that_died_after_the_dot(
        make_relay: MakeRelay, sink: Sink, ledger_url: str) -> None:
    """The dead relay's SENDING record (lease 1 s, no heartbeat since) is in doubt; the
    client's retry through a relay with the ledger is answered 250 as in doubt. in-doubt
    (no minimum age) must list that store key."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url)
    assert relay.core is not None and relay.store is not None
    key = recipient_keys([RCPT], "welcome", "dead-1", relay.core.policy)[RCPT]
    token = "dead-relay-attempt"
    [held] = await relay.store.reserve([key], token=token, lease_s=30.0)
    assert held.reserved
    assert await relay.store.settle(
        [SettleOp(key=key, action=Settle.SENDING, lease_s=1.0, window_s=3600.0)],
        token=token, window_s=3600.0) == [True]
    await asyncio.sleep(1.5)  # the lease passes without a heartbeat: the relay is gone
    retry = await send(relay.port, [RCPT], message(key="dead-1"))
    assert retry.code == 250, retry  # suppressed as in doubt (unknown_policy = suppress)
    assert sink.handler.copies_to(RCPT) == 0
    deadline = time.monotonic() + 10.0
    while await _row_count(ledger_url) < 1 and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    async with await LedgerReader.open(ledger_url) as reader:
        history = await reader.history(key, limit=10)
        listed = await reader.in_doubt(older_than_s=0.0, limit=10)
    assert [row.outcome for row in history] == ["suppressed_unknown"]
    assert [row.store_key for row in listed] == [key], (
        f"in-doubt lists {listed}; the ledger holds {history}")
