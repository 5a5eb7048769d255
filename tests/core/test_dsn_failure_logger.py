"""The DSN alert's runbook names the logger of the line it sends the operator to.

config/prometheus/alerts.yml (DedupRelayDsnFailed) tells the operator that "the relay log (logger
relay.dsn, ERROR) names the queue ids": the notice's failure is logged on ``relay.dsn`` (the
JSON lines' ``logger`` field), whatever module sends the notice, so a search for ``relay.dsn``
finds it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from relay.core.dsn import DsnSender
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    NonDelivery,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    SmtpReply,
)
from relay.ops.metrics import PrometheusMetrics

ALERTS = Path(__file__).resolve().parents[2] / "config" / "prometheus" / "alerts.yml"


class RefusingUpstream:
    """An upstream that refuses every recipient (the notice is not delivered)."""

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        refused = RcptResult(RcptStatus.REFUSED, SmtpReply.parse(550, "5.7.1 no"))
        return DeliveryResult(recipients=dict.fromkeys(message.rcpt_tos, refused))

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


def logger_the_alert_names() -> str:
    found = re.search(r"\(logger ([\w.]+), ERROR\)", ALERTS.read_text())
    assert found is not None, "DedupRelayDsnFailed no longer names a logger"
    return found.group(1)


async def test_a_notice_not_delivered_is_logged_on_the_logger_the_alert_names(
        caplog: pytest.LogCaptureFixture) -> None:
    sender = DsnSender(upstream=RefusingUpstream(),
                       metrics=PrometheusMetrics(registry=CollectorRegistry()),
                       reporting_mta="relay.example")
    failure = RcptResult(RcptStatus.REFUSED, SmtpReply.parse(550, "5.1.1 User unknown"))
    with caplog.at_level(logging.ERROR):
        sender.non_delivery(NonDelivery(
            mail_from="app@example.com", failures={"b@example.net": failure},
            content=b"Subject: x\r\n\r\nbody\r\n", queue_id="q1"))
        for task in list(sender.background):
            await task
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors, "the undelivered notice was not logged at ERROR"
    assert {r.name for r in errors} == {logger_the_alert_names()}
