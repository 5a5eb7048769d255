"""An in-doubt decision is resolved only by a row decided after it: an old ``relayed`` row that
lands late (its relay's queue waited out a ledger outage) does not hide an in-doubt decision of
the same store key another relay took meanwhile (``decided_at`` decides; ``recorded_at``, when
a row landed, does not). Sequence: relay X relays K (its row queued); an operator releases K;
relay Y sends K again and gets no reply to the final dot (``unknown``); X's old row lands:
``in-doubt`` still lists K and ``DedupRelayInDoubtUnresolved`` can fire.

The outage is :class:`tests.support.pg_proxy.PgProxy` refusing X's ledger connections.
"""

from __future__ import annotations

import asyncio
import time

from relay.core.interfaces import LedgerAction, LedgerEntry
from relay.store.postgres.ledger import LedgerOptions, PostgresLedger
from relay.store.postgres.ledger_read import LedgerReader
from tests.support.pg_proxy import pg_proxy
from tests.support.postgres import wait_ledger_rows


class _Metrics:
    """A :class:`relay.store.postgres.ledger.LedgerMetrics` that keeps the in-doubt gauge."""

    def __init__(self) -> None:
        self.in_doubt = -1

    def ledger_written(self, rows: int) -> None:
        """Nothing."""

    def ledger_dropped(self, reason: str, rows: int) -> None:
        """Nothing."""

    def ledger_queued(self, rows: int) -> None:
        """Nothing."""

    def component_up(self, component: str, up: bool) -> None:
        """Nothing."""

    def in_doubt_unresolved(self, count: int) -> None:
        """Keep ``count``."""
        self.in_doubt = count


def _entry(outcome: str, *, action: LedgerAction = LedgerAction.RELAY) -> LedgerEntry:
    """A row of dr:K decided now."""
    return LedgerEntry(decided_at=time.time(), outcome=outcome, recipient="j@example.com",
                       store_key="dr:K", template="t", dedupe_key="order-1", action=action)


async def _open(url: str, instance: str, metrics: _Metrics) -> PostgresLedger:
    return await PostgresLedger.open(
        url, metrics=metrics, options=LedgerOptions(instance=instance, in_doubt_after_s=0.0),
        op_timeout_s=2.0, cleanup_interval_s=None, gauge_interval_s=None)


async def test_an_old_row_landing_late_does_not_resolve_a_later_unknown(
        ledger_url: str) -> None:
    """Relay X's ``relayed`` row of dr:K waits in X's queue (its ledger refused); an
    operator's ``released`` row and relay Y's ``unknown`` row of dr:K land, decided after
    it; X's ledger comes back and its row lands. The ``unknown`` decision was taken after
    every other row of dr:K: ``in-doubt`` lists it and the gauge counts it, before and after
    X's row landed."""
    y_metrics = _Metrics()
    async with pg_proxy() as proxy:
        x = await _open(proxy.url(ledger_url), "x/1", _Metrics())
        y = await _open(ledger_url, "y/1", y_metrics)
        try:
            proxy.refuse()
            x.record([_entry("relayed")])  # X relayed dr:K; its row waits
            await asyncio.sleep(0.3)
            assert not x.status().up and x.status().queued == 1
            await y.write_now([_entry("released", action=LedgerAction.RELEASE)])
            await asyncio.sleep(0.05)
            y.record([_entry("unknown")])  # Y's resend: no reply to the final dot
            await wait_ledger_rows(ledger_url, 2)
            await asyncio.sleep(0.05)
            assert await y.refresh_in_doubt() == 1  # in doubt: listed and counted
            proxy.resume()
            rows = await wait_ledger_rows(ledger_url, 3)
            assert [r["outcome"] for r in rows] == ["relayed", "released", "unknown"]
            async with await LedgerReader.open(ledger_url) as reader:
                listed = await reader.in_doubt(older_than_s=0.0, limit=10)
            counted = await y.refresh_in_doubt()
            assert ([r.outcome for r in listed], counted) == (["unknown"], 1), (
                "X's old relayed row, landed late, hid Y's later unknown decision")
        finally:
            await x.close(flush_s=0)
            await y.close(flush_s=0)
