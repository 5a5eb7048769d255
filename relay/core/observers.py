"""The observers of a finished decision (:class:`relay.core.message.DecisionObserver`): the
message and recipient counters, the RFC 3464 notice owed for refusals after a 250, the audit
ledger's rows. Each sees every decision once; none changes it."""

from __future__ import annotations

from collections import Counter

from relay.core.audit import entries_for
from relay.core.interfaces import AuditLedger, Metrics, NonDelivery, Notifier
from relay.core.message import Decision, InboundMessage


class CountDecisions:
    """``relay_messages_total{result}``, ``relay_recipients_total{outcome}`` and
    ``relay_key_reuse_total{template}``."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def decided(self, msg: InboundMessage, decision: Decision) -> None:
        """Count the message and each recipient's outcome."""
        self._metrics.message(decision.result)
        for outcome, count in Counter(decision.outcomes.values()).items():
            self._metrics.recipients(outcome, count)
        if decision.reused:
            self._metrics.key_reused(decision.template, len(decision.reused))


class OweNotices:
    """RFC 5321 sections 4.2.5 and 6.1: a ``250`` makes the relay owe the sender notice of the
    recipients refused permanently; the :class:`Notifier` sends it (RFC 3464)."""

    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier

    def decided(self, msg: InboundMessage, decision: Decision) -> None:
        """Owe a notice when the reply is 250 and some recipient was refused."""
        if decision.reply.code != 250 or not decision.refusals:
            return
        self._notifier.non_delivery(NonDelivery(
            mail_from=msg.mail_from, failures=dict(decision.refusals),
            content=msg.trace + msg.content, queue_id=msg.queue_id,
            header_end=len(msg.trace) + msg.message.header_end))


class RecordDecisions:
    """The audit ledger's rows (design.md §6.7): one per recipient decision."""

    def __init__(self, ledger: AuditLedger) -> None:
        self._ledger = ledger

    def decided(self, msg: InboundMessage, decision: Decision) -> None:
        """Queue the rows of ``decision`` (off the hot path)."""
        self._ledger.record(entries_for(
            now=decision.decided_at, rcpt_tos=msg.rcpt_tos, outcomes=decision.outcomes,
            keys=decision.keys, template=decision.template, dedupe_key=decision.dedupe_key,
            rcpt_results=decision.rcpt_results, final_reply=decision.upstream_reply,
            client_reply=decision.reply, upstream=decision.upstream,
            message_id=msg.message.message_id, queue_id=msg.queue_id,
            key_source=decision.key_source, reused=decision.reused,
            received_at=decision.received_at, sending_at=decision.sending_at),
            admitted=decision.admitted)
