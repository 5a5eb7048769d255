"""The spans the core opens around a message (design.md §6.8, relay.core.tracing): over a real
Redis store, recorded by the OpenTelemetry SDK's in-memory exporter through the relay's
:class:`relay.ops.tracing.OtelTracer`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

from relay.core.dedup import Policy
from relay.core.errors import StoreError
from relay.core.interfaces import Reservation
from relay.core.message import Decision, MessageCore
from relay.core.tracing import MESSAGE, RESERVE, SETTLE, UPSTREAM
from relay.ops.metrics import PrometheusMetrics
from relay.ops.observed import observed_core
from relay.ops.tracing import OtelTracer
from relay.store.redis.store import RedisStore
from tests.support.dedup_parts import CountingUpstream, one_message
from tests.support.relays import REDIS_URL


@pytest.fixture
def recorded() -> Iterator[tuple[OtelTracer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = OtelTracer(provider)
    yield tracer, exporter
    tracer.shutdown()


def traced_core(store: RedisStore, upstream: CountingUpstream, prefix: str,
                tracer: OtelTracer) -> MessageCore:
    """The core as the relay builds it with tracing on: its message in its span."""
    return observed_core(store=store, upstream=upstream,
                         metrics=PrometheusMetrics(registry=CollectorRegistry()),
                         policy=Policy(key_prefix=prefix), tracer=tracer)[1]


async def relayed_once(prefix: str, tracer: OtelTracer) -> Decision:
    """The decision on one message through a traced core over a real Redis."""
    store = RedisStore.from_url(REDIS_URL)
    try:
        return await traced_core(store, CountingUpstream(), prefix, tracer).process(
            one_message())
    finally:
        await store.close()


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def no_address_or_key(spans: tuple[ReadableSpan, ...]) -> None:
    for span in spans:
        for value in (span.attributes or {}).values():
            assert "@" not in str(value) and "K-1" not in str(value), (span.name, value)


async def test_a_relayed_message_is_one_span_with_reserve_upstream_and_settle_children(
        prefix: str, recorded: tuple[OtelTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = recorded
    decision = await relayed_once(prefix, tracer)
    assert decision.reply.code == 250
    spans = exporter.get_finished_spans()
    named = by_name(spans)
    assert set(named) == {MESSAGE, RESERVE, UPSTREAM, SETTLE}
    root = named[MESSAGE]
    assert root.parent is None
    assert root.context is not None
    for child in (RESERVE, UPSTREAM, SETTLE):
        parent, context = named[child].parent, named[child].context
        assert parent is not None and context is not None
        assert (parent.span_id, context.trace_id) == (root.context.span_id,
                                                      root.context.trace_id), child
    assert dict(root.attributes or {}) == {
        "relay.queue_id": "q1", "relay.recipients": 1, "relay.result": "relayed",
        "relay.outcomes": "relayed", "smtp.reply_code": 250}
    assert dict(named[RESERVE].attributes or {}) == {"relay.keys": 1}
    assert dict(named[UPSTREAM].attributes or {}) == {
        "relay.recipients": 1, "relay.upstream": "", "smtp.reply_code": 250}
    assert dict(named[SETTLE].attributes or {}) == {"relay.settles": 1,
                                                    "relay.settle_actions": "sent"}
    no_address_or_key(spans)
    assert decision.trace_id == f"{root.context.trace_id:032x}"  # the log line's trace_id


async def test_a_message_not_sampled_has_no_trace_id(prefix: str) -> None:
    """With the sampler saying no, nothing is exported and the decision (the log line) names
    no trace that no backend will hold."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = OtelTracer(provider)
    try:
        decision = await relayed_once(prefix, tracer)
    finally:
        tracer.shutdown()
    assert decision.reply.code == 250
    assert decision.trace_id == ""
    assert exporter.get_finished_spans() == ()


async def test_a_duplicate_is_answered_after_the_reserve_alone(
        prefix: str, recorded: tuple[OtelTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = recorded
    store = RedisStore.from_url(REDIS_URL)
    upstream = CountingUpstream()
    try:
        core = traced_core(store, upstream, prefix, tracer)
        await core.process(one_message())
        exporter.clear()
        again = await core.process(one_message())
    finally:
        await store.close()
    assert again.reply.code == 250 and len(upstream.sent) == 1
    named = by_name(exporter.get_finished_spans())
    assert set(named) == {MESSAGE, RESERVE}
    assert (named[MESSAGE].attributes or {})["relay.outcomes"] == "suppressed"


class ReserveFails(RedisStore):
    """A real RedisStore whose reserve fails (the store down)."""

    async def reserve(self, keys: Any, *, token: str, lease_s: float,
                      **options: Any) -> list[Reservation]:
        raise StoreError("reserve", "ConnectionError: connection refused")


async def test_a_failed_reserve_is_an_error_span_and_the_message_a_451(
        prefix: str, recorded: tuple[OtelTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = recorded
    store = ReserveFails.from_url(REDIS_URL)
    try:
        decision = await traced_core(store, CountingUpstream(), prefix, tracer).process(
            one_message())
    finally:
        await store.close()
    assert decision.reply.code == 451
    named = by_name(exporter.get_finished_spans())
    assert set(named) == {MESSAGE, RESERVE}
    assert named[RESERVE].status.status_code is StatusCode.ERROR
    assert [e.name for e in named[RESERVE].events] == ["exception"]
    assert (named[MESSAGE].attributes or {})["smtp.reply_code"] == 451


async def test_with_tracing_off_the_listener_gets_the_core_itself(prefix: str) -> None:
    """No tracer, no wrapper: a message makes no call to a tracer (the spans are wrappers the
    composition root builds only with tracing on)."""
    store = RedisStore.from_url(REDIS_URL)
    try:
        core, entry = observed_core(store=store, upstream=CountingUpstream(),
                                    metrics=PrometheusMetrics(registry=CollectorRegistry()),
                                    policy=Policy(key_prefix=prefix))
        assert entry is core
        assert (await entry.process(one_message())).trace_id == ""
    finally:
        await store.close()
