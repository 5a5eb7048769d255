"""Parts for driving the dedup core on its Protocols: upstreams that count or hang, a
RedisStore whose settles fail for a while, a core over them and the message the tests send."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from relay.core import replies
from relay.core.dedup import DedupCore, InboundMessage, Policy
from relay.core.errors import StoreError
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    Settle,
    SettleOp,
    SmtpReply,
)
from relay.ops.metrics import PrometheusMetrics
from relay.ops.observed import observed_core
from relay.store.redis.store import RedisStore
from tests.support.clients import message


class CountingUpstream:
    """An upstream that accepts everything and counts transactions."""

    def __init__(self) -> None:
        self.sent: list[OutboundMessage] = []

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        if progress is not None and progress.before_dot is not None:
            if not await progress.before_dot(message.rcpt_tos):  # the contract: no dot
                refused = RcptResult(RcptStatus.REFUSED,
                                     progress.abort_reply or replies.STORE_DOWN,
                                     from_upstream=False)
                return DeliveryResult(recipients={r: refused for r in message.rcpt_tos})
            progress.dot_written = True
        self.sent.append(message)
        ok = RcptResult(RcptStatus.ACCEPTED, SmtpReply(250, "2.0.0", "ok"))
        return DeliveryResult(recipients={r: ok for r in message.rcpt_tos})

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


class SettleFailsFirst(RedisStore):
    """A real RedisStore whose first ``failures`` settles after the dot fail (a store hiccup)."""

    failures = 5

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        if self.failures > 0 and all(op.action is not Settle.SENDING for op in ops):
            self.failures -= 1
            raise StoreError("settle", "TimeoutError: timed out")
        return await super().settle(ops, token=token, window_s=window_s)


class HangingUpstream(CountingUpstream):
    """An upstream that never answers: the transaction waits until it is cancelled."""

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def make_core(store: RedisStore, upstream: CountingUpstream, prefix: str, *,
              lease_s: float = 900.0, registry: CollectorRegistry | None = None) -> DedupCore:
    """A DedupCore over ``store`` and ``upstream`` with a fresh (or the given) registry, its
    calls timed as the relay's (:func:`relay.ops.observed.observed_core`, tracing off); a copy
    of a message in flight is answered 450 at once (``in_flight_wait_s`` 0: the wait is
    tested in tests/core/test_in_flight_wait.py)."""
    return observed_core(store=store, upstream=upstream, metrics=PrometheusMetrics(
        registry=registry if registry is not None else CollectorRegistry()),
        policy=Policy(key_prefix=prefix, lease_s=lease_s, in_flight_wait_s=0.0))[0]


def one_message() -> InboundMessage:
    """The message every test here sends: one recipient, the default key."""
    return InboundMessage(mail_from="app@example.com", rcpt_tos=["user@example.net"],
                          content=message(), queue_id="q1")
