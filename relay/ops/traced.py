"""The spans of one message (design.md §6.8; names and attributes:
:mod:`relay.core.tracing`), opened by wrappers the composition root builds when tracing is on:
around the core's decision (:class:`TracedCore`, ``smtp.message``), its reserve
(:class:`TracedStore`, ``store.reserve``), its upstream transaction (:class:`TracedUpstream`,
``upstream.transaction``) and its settle (:class:`TracedSettler`, ``store.settle``). With
tracing off none is built: a message makes no call to a tracer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from relay.core.dedup import DedupCore
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    FingerprintStore,
    Metrics,
    OutboundMessage,
    Reservation,
    SettleLog,
    SettleOp,
    Upstream,
)
from relay.core.message import Decision, InboundMessage
from relay.core.settlement import Settler
from relay.core.tracing import MESSAGE, RESERVE, SETTLE, UPSTREAM, Tracer
from relay.ops.ports import StoreWrapper, UpstreamWrapper, reply_code


class TracedCore:
    """What the listener hands a message to: ``core``'s decision in the span
    ``smtp.message`` (its ``trace_id`` is the span's, for the log line), then the
    observers."""

    def __init__(self, core: DedupCore, tracer: Tracer) -> None:
        self._core = core
        self._tracer = tracer

    async def process(self, msg: InboundMessage) -> Decision:
        with self._tracer.span(MESSAGE) as span:
            span.set("relay.queue_id", msg.queue_id)
            span.set("relay.recipients", len(msg.rcpt_tos))
            decision = await self._core.decide(msg)
            if span.recording:
                decision = dataclasses.replace(decision, trace_id=span.trace_id)
                span.set("relay.result", decision.result.value)
                span.set("relay.outcomes", ",".join(sorted({o.value for o in
                                                            decision.outcomes.values()})))
                span.set("smtp.reply_code", decision.reply.code)
        return self._core.observed(msg, decision)


class TracedStore(StoreWrapper):
    """``inner`` with each reserve in the span ``store.reserve``."""

    def __init__(self, inner: FingerprintStore, tracer: Tracer) -> None:
        super().__init__(inner)
        self._tracer = tracer

    async def reserve(self, keys: Sequence[str], *, token: str, lease_s: float,
                      resend_unknown: bool = False, content_digest: str = "",
                      replace_other_content: bool = False) -> list[Reservation]:
        with self._tracer.span(RESERVE) as span:
            span.set("relay.keys", len(keys))
            return await self.inner.reserve(keys, token=token, lease_s=lease_s,
                                            resend_unknown=resend_unknown,
                                            content_digest=content_digest,
                                            replace_other_content=replace_other_content)


class TracedUpstream(UpstreamWrapper):
    """``inner`` with each transaction in the span ``upstream.transaction`` (failed when no
    reply came from the upstream)."""

    def __init__(self, inner: Upstream, tracer: Tracer) -> None:
        super().__init__(inner)
        self._tracer = tracer

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        with self._tracer.span(UPSTREAM) as span:
            span.set("relay.recipients", len(message.rcpt_tos))
            result = await self.inner.deliver(message, progress)
            code = reply_code(result)
            span.set("relay.upstream", result.upstream)
            if code is None:
                span.fail("no reply from the upstream")
            else:
                span.set("smtp.reply_code", code)
        return result


class TracedSettler(Settler):
    """A :class:`Settler` whose settle of an attempt (after the upstream's reply, or cut by
    shutdown), quick tries included, is the span ``store.settle``."""

    def __init__(self, tracer: Tracer, *, store: FingerprintStore, metrics: Metrics,
                 window_s: float, lease_s: float = 900.0,
                 journal: SettleLog | None = None) -> None:
        super().__init__(store=store, metrics=metrics, window_s=window_s, lease_s=lease_s,
                         journal=journal)
        self._tracer = tracer

    async def settle(self, ops: list[SettleOp], token: str, lease_ends: float) -> None:
        with self._tracer.span(SETTLE) as span:
            if span.recording:
                span.set("relay.settles", len(ops))
                span.set("relay.settle_actions", ",".join(sorted({op.action.value
                                                                  for op in ops})))
            await super().settle(ops, token, lease_ends)
