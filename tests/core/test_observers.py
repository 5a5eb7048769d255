"""Every message's decision is built once and seen once by each observer, in order: the
counters (always), the notice owed for refusals after a 250 (RFC 5321 section 4.2.5), the
audit ledger's rows; a gate that does not admit the message makes it 451 before anything is
reserved, and the decision says it was not admitted. Real Redis store (random key prefix), an
upstream in this process that refuses the recipients it is told to."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest
from prometheus_client import CollectorRegistry

from relay.core import replies
from relay.core.dedup import DedupCore, InboundMessage, Policy
from relay.core.gates import Gates
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    LedgerEntry,
    NonDelivery,
    OutboundMessage,
    Outcome,
    RcptResult,
    RcptStatus,
    Result,
    SmtpReply,
)
from relay.core.message import Decision, DecisionObserver
from relay.core.observers import OweNotices, RecordDecisions
from relay.ops.metrics import PrometheusMetrics
from relay.store.redis.store import RedisStore
from tests.support.clients import message
from tests.support.dedup_parts import CountingUpstream
from tests.support.metrics import sample
from tests.support.relays import REDIS_URL

A, B = "a@example.net", "b@example.net"


class RefusingUpstream(CountingUpstream):
    """Accepts every recipient but those in ``refused`` (550 5.1.1)."""

    def __init__(self, refused: Sequence[str]) -> None:
        super().__init__()
        self.refused = set(refused)

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        result = await super().deliver(message, progress)
        no = RcptResult(RcptStatus.REFUSED, SmtpReply(550, "5.1.1", "no such user"))
        return DeliveryResult(recipients={r: no if r in self.refused else res
                                          for r, res in result.recipients.items()},
                              final_reply=SmtpReply(250, "2.0.0", "Ok: queued as Q9"))


class Seen:
    """An observer that keeps what it saw."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    def decided(self, msg: InboundMessage, decision: Decision) -> None:
        self.decisions.append(decision)


class Notices:
    """A notifier that keeps the notices owed."""

    def __init__(self) -> None:
        self.owed: list[NonDelivery] = []

    def non_delivery(self, notice: NonDelivery) -> None:
        self.owed.append(notice)


class Ledger:
    """An audit ledger that keeps its rows and admits while ``open``."""

    def __init__(self) -> None:
        self.rows: list[tuple[LedgerEntry, bool]] = []
        self.open = True

    def record(self, entries: Sequence[LedgerEntry], *, admitted: bool = True) -> None:
        self.rows.extend((entry, admitted) for entry in entries)

    def admits(self) -> bool:
        return self.open


def core_with(store: RedisStore, upstream: CountingUpstream, prefix: str,
              registry: CollectorRegistry, *observers: DecisionObserver,
              ledger: Ledger | None = None) -> DedupCore:
    return DedupCore(store=store, upstream=upstream,
                     metrics=PrometheusMetrics(registry=registry),
                     policy=Policy(key_prefix=prefix),
                     gates=Gates(admissions=() if ledger is None else (ledger,)),
                     observers=[*observers, *([RecordDecisions(ledger)] if ledger else [])],
                     clock=lambda: 1_767_225_600.0)


@pytest.fixture
async def store() -> AsyncIterator[RedisStore]:
    opened = RedisStore.from_url(REDIS_URL)
    yield opened
    await opened.close()


async def test_each_observer_sees_the_one_decision_the_client_gets(
        prefix: str, store: RedisStore) -> None:
    seen, notices, ledger = Seen(), Notices(), Ledger()
    registry = CollectorRegistry()
    core = core_with(store, RefusingUpstream([B]), prefix, registry, seen,
                     OweNotices(notices), ledger=ledger)
    msg = InboundMessage(mail_from="app@example.com", rcpt_tos=[A, B],
                         content=message(key="K-obs", extra="Message-ID: <o@x>\r\n"),
                         queue_id="q1")
    decision = await core.process(msg)
    assert seen.decisions == [decision]
    assert decision.reply.code == 250 and decision.outcomes == {
        A: Outcome.RELAYED, B: Outcome.REFUSED_PERM}
    assert set(decision.refusals) == {B} and decision.decided_at == 1_767_225_600.0
    [notice] = notices.owed
    assert list(notice.failures) == [B] and notice.content.startswith(msg.trace)
    assert [(row.recipient, row.outcome, row.message_id, admitted)
            for row, admitted in ledger.rows] == [
        (A, "relayed", "<o@x>", True), (B, "refused_perm", "<o@x>", True)]
    assert sample(registry, "relay_messages_total", result=Result.RELAYED.value) == 1.0


async def test_a_gate_that_does_not_admit_makes_it_451_before_anything(
        prefix: str, store: RedisStore) -> None:
    seen, ledger = Seen(), Ledger()
    ledger.open = False
    upstream = CountingUpstream()
    core = core_with(store, upstream, prefix, CollectorRegistry(), seen, ledger=ledger)
    decision = await core.process(InboundMessage(mail_from="", rcpt_tos=[A],
                                                 content=message(), queue_id="q2"))
    assert decision.reply == replies.LEDGER_UNAVAILABLE and not decision.admitted
    assert seen.decisions == [decision] and upstream.sent == []
    assert [(row.outcome, admitted) for row, admitted in ledger.rows] == [
        ("refused_temp", False)]
