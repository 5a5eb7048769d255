"""The console shows what the reconciler did (relay/console/pages.py, history.py): the
in-doubt page says when it last looked and, per message, its looks and last answer, or that
it gave up; a message's page shows its looks and, once resolved, the reconciler's row with
the evidence on the timeline. In-process relay (Redis store, an aiosmtpd sink that holds its
reply to the dot, the ledger in a private PostgreSQL schema) and set-answer sources."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from relay.admin.reconciler import Reconciler
from relay.app import Relay
from relay.ops.metrics import ReconcileMetrics
from relay.reconcile.evidence import Verdict
from relay.settings import Settings
from relay.settings.reconcile import AnsweringSource
from tests.support.clients import message, send
from tests.support.console import OPERATOR, OPERATOR_PASSWORD, Browser, console_relay, opened
from tests.support.evidence import SetAnswers
from tests.support.postgres import wait_ledger_rows
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.timeout(60)


def _reconciler(relay: Relay, source: SetAnswers, give_up_s: float = 86400.0) -> Reconciler:
    def settings() -> Settings:
        return relay.settings.model_copy(update={"reconcile_give_up": give_up_s})

    return Reconciler(settings, store=relay.store,
                      metrics=ReconcileMetrics(registry=CollectorRegistry()),
                      instance="relay.test/reconciler",
                      sources=lambda _: [AnsweringSource(source, None)])


async def _in_doubt(relay: Relay, sink: Sink, ledger_url: str, key: str, rows: int
                    ) -> dict[str, object]:
    sink.handler.hang_after_dot_s = 2.0
    assert (await send(relay.port, ["jane.roe@example.net"], message(key=key))).code == 451
    sink.handler.hang_after_dot_s = 0.0
    return (await wait_ledger_rows(ledger_url, rows))[-1]


async def test_the_console_shows_the_reconcilers_looks_and_evidence(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url)
    row = await _in_doubt(relay, sink, ledger_url, "pay-8", 1)
    message_id, queue_id = str(row["message_id"]), str(row["queue_id"])
    assert message_id.startswith(f"<{queue_id}@")  # added by the relay (add_message_id)
    b = opened(web, relay)
    await b.sign_in(OPERATOR, OPERATOR_PASSWORD)
    _, page, _ = await b.get("/in-doubt")
    assert "not looked at yet" in page and "It has not looked at any" in page
    assert "No evidence source is configured" in page

    source = SetAnswers("mx1")
    assert (await _reconciler(relay, source).round()).waiting == 1
    _, page, _ = await b.get("/in-doubt")
    assert "looked 1 time(s)" in page and "wait: mx1 unknown" in page
    assert "It last looked at" in page
    _, page, _ = await b.get(f"/message/{queue_id}")
    assert "reconciler: looked 1 time(s)" in page

    source.verdicts[message_id] = Verdict.ACCEPTED
    assert (await _reconciler(relay, source).round()).sent == 1
    _, page, _ = await b.get(f"/message/{queue_id}")
    assert "marked sent by the reconciler" in page and "postfix/qmgr" in page
    assert "source mx1" in page
    _, page, _ = await b.get("/in-doubt")
    assert "Nothing is in doubt" in page

    await _in_doubt(relay, sink, ledger_url, "pay-9", 3)
    given_up = await _reconciler(relay, SetAnswers("mx1"), give_up_s=0.001).round()
    assert given_up.given_up == 1
    _, page, _ = await b.get("/in-doubt")
    assert "gave up (no evidence): decide by hand" in page
