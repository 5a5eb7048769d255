"""An upstream scripted per transaction, for the dedup core's tests: it stands in for the
smarthost where a test must hold or refuse one transaction and not the next."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    SmtpReply,
)

USER = "user@example.net"
OTHER = "other@example.net"
OK = SmtpReply(250, "2.0.0", "ok")
TEMP = SmtpReply(451, "4.3.0", "try later")


@dataclass
class Plan:
    """One scripted transaction: wait for ``gate`` (when given) before the SENDING mark, or
    after the dot with ``after_dot`` (the upstream holds its reply; never set: it hangs until
    cancelled), then answer each recipient ``ACCEPTED`` unless ``refuse`` names a reply for it
    (a refusal at DATA, before the dot: nothing delivered)."""

    gate: asyncio.Event | None = None
    refuse: SmtpReply | None = None
    after_dot: bool = False
    no_reply: bool = False  # after the dot and the gate: no reply came (RFC 1047)
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    dot: asyncio.Event = field(default_factory=asyncio.Event)


class ScriptedUpstream:
    """An upstream whose transactions follow ``plans`` in order (then: accept everything);
    ``delivered`` holds each recipient copy that went out and was accepted."""

    def __init__(self, *plans: Plan) -> None:
        self.plans: deque[Plan] = deque(plans)
        self.delivered: list[str] = []

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        plan = self.plans.popleft() if self.plans else Plan()
        plan.entered.set()
        if plan.gate is not None and not plan.after_dot:
            await plan.gate.wait()
        if plan.refuse is not None:
            refused = RcptResult(RcptStatus.REFUSED, plan.refuse)
            return DeliveryResult(recipients=dict.fromkeys(message.rcpt_tos, refused))
        if progress is not None and progress.before_dot is not None:
            if not await progress.before_dot(message.rcpt_tos):
                lost = RcptResult(RcptStatus.REFUSED, TEMP, from_upstream=False)
                return DeliveryResult(recipients=dict.fromkeys(message.rcpt_tos, lost))
            progress.dot_written = True
        plan.dot.set()
        if plan.gate is not None and plan.after_dot:
            await plan.gate.wait()
        if plan.no_reply:
            lost = RcptResult(RcptStatus.UNKNOWN, TEMP, from_upstream=False)
            return DeliveryResult(recipients=dict.fromkeys(message.rcpt_tos, lost))
        self.delivered.extend(message.rcpt_tos)
        ok = RcptResult(RcptStatus.ACCEPTED, OK)
        return DeliveryResult(recipients=dict.fromkeys(message.rcpt_tos, ok), final_reply=OK)

    def copies_to(self, rcpt: str) -> int:
        return sum(1 for r in self.delivered if r.lower() == rcpt.lower())

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
