"""Settlement bookkeeping (relay/settlement.py; issue 8 item 22): what is owed, what is counted,
what is logged and measured, and that shutdown's cancellation is not swallowed.

Real Redis under a RedisStore subclass whose settles fail on demand (a store hiccup a real
Redis cannot produce on cue); the dedup core and metrics are the real ones.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest
from conftest import REDIS_URL, delete_prefix
from prometheus_client import CollectorRegistry
from test_dedup_core import CountingUpstream, SettleFailsFirst, make_core, one_message

from relay.dedup import InboundMessage
from relay.errors import StoreError
from relay.interfaces import DeliveryProgress, DeliveryResult, OutboundMessage, Settle, SettleOp
from relay.store_redis import RedisStore


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A random key prefix, deleted afterwards."""
    p = f"test:{uuid.uuid4().hex}:"
    yield p
    delete_prefix(REDIS_URL, p)


class SettleDown(RedisStore):
    """A real RedisStore on which every settle after the dot fails while ``down``."""

    down = True

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        if self.down and all(op.action is not Settle.SENDING for op in ops):
            raise StoreError("settle", "ConnectionError: connection refused")
        return await super().settle(ops, token=token, window_s=window_s)


def message_to(rcpt: str, key: str = "K-1") -> InboundMessage:
    """One message to ``rcpt`` with dedupe key ``key``."""
    return InboundMessage(mail_from="app@example.com", rcpt_tos=[rcpt], queue_id="q1",
                          content=(f"X-Template: welcome\r\nX-Dedupe-Key: {key}\r\n\r\nhi\r\n")
                          .encode())


def sample(registry: CollectorRegistry, name: str, op: str) -> float:
    """A labelled sample of ``registry`` (0.0 when absent)."""
    return registry.get_sample_value(name, {"op": op}) or 0.0


async def stop_background(core_background: set[asyncio.Task[None]]) -> list[object]:
    """Cancel the background settles; their results (exceptions included)."""
    tasks = list(core_background)
    for task in tasks:
        task.cancel()
    return list(await asyncio.gather(*tasks, return_exceptions=True))


async def test_an_owed_settle_paid_by_the_retrys_flush_leaves_the_owed_list(
        prefix: str) -> None:
    """A SENT mark owed in the background and paid by a retry's flush is owed no more."""
    store = SettleDown.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0)
    assert (await core.process(one_message())).reply.code == 250
    assert core._settler._owed, "the mark is owed while the store is down"
    store.down = False
    retry = await core.process(one_message())  # the background loop is still asleep
    assert retry.outcomes == {"user@example.net": "suppressed"}
    assert core._settler._owed == {}
    await asyncio.wait_for(asyncio.gather(*core.background), timeout=10)
    await store.close()


async def test_a_background_settle_that_lands_leaves_the_owed_list(prefix: str) -> None:
    """A SENT mark that lands in the background loop is removed from what is owed."""
    store = SettleFailsFirst.from_url(REDIS_URL)
    store.failures = 4
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0)
    assert (await core.process(one_message())).reply.code == 250
    await asyncio.wait_for(asyncio.gather(*core.background), timeout=10)
    assert core._settler._owed == {}
    await store.close()


async def test_mark_sent_failed_counts_each_fingerprint_once_however_many_tries(
        prefix: str) -> None:
    """A one-recipient and a two-recipient message whose SENT marks stay missing for many
    tries past the lease: counted 3 (one per fingerprint), not per try or per message."""
    store = SettleDown.from_url(REDIS_URL)
    registry = CollectorRegistry()
    core = make_core(store, CountingUpstream(), prefix, lease_s=0.2, registry=registry)
    assert (await core.process(message_to("a@example.net"))).reply.code == 250
    two = InboundMessage(mail_from="app@example.com", rcpt_tos=["b@example.net", "c@example.net"],
                         queue_id="q2", content=message_to("b@example.net").content)
    assert (await core.process(two)).reply.code == 250
    await asyncio.sleep(3.0)  # several background tries each, all past the lease
    assert registry.get_sample_value("relay_mark_sent_failed_total") == 3.0
    await stop_background(core.background)  # the give-up at shutdown counts nothing new
    assert registry.get_sample_value("relay_mark_sent_failed_total") == 3.0
    await store.close()


async def test_cancellation_at_shutdown_propagates_out_of_the_background_settle(
        prefix: str) -> None:
    """Cancelling a background settle (shutdown) ends it cancelled, not finished normally, and
    the mark stays owed for the settle journal."""
    store = SettleDown.from_url(REDIS_URL)
    registry = CollectorRegistry()
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0, registry=registry)
    assert (await core.process(one_message())).reply.code == 250
    tasks = list(core.background)
    assert tasks
    results = await stop_background(core.background)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    assert all(t.cancelled() for t in tasks)
    assert [op.action for _token, op in core._settler.owed()] == [Settle.SENT]  # journal
    assert registry.get_sample_value("relay_mark_sent_failed_total") == 1.0
    await store.close()


async def test_a_healthy_message_logs_nothing_above_info(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Reserve, SENDING, send and SENT with everything answering: no WARNING or ERROR line."""
    store = RedisStore.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix)
    with caplog.at_level(logging.DEBUG):
        assert (await core.process(one_message())).reply.code == 250
        assert (await core.process(one_message())).reply.code == 250  # a true duplicate
    assert [r.getMessage() for r in caplog.records if r.levelno > logging.INFO] == []
    assert not core.background
    await store.close()


async def test_settles_are_measured_under_their_op_label(prefix: str) -> None:
    """One relayed message: one reserve and two settles (SENDING, SENT) timed, no error."""
    store = RedisStore.from_url(REDIS_URL)
    registry = CollectorRegistry()
    core = make_core(store, CountingUpstream(), prefix, registry=registry)
    assert (await core.process(one_message())).reply.code == 250
    assert sample(registry, "relay_store_seconds_count", "reserve") == 1.0
    assert sample(registry, "relay_store_seconds_count", "settle") == 2.0
    assert 0.0 < sample(registry, "relay_store_seconds_sum", "settle") < 2.0
    assert sample(registry, "relay_store_errors_total", "settle") == 0.0
    await store.close()


async def test_failed_settles_are_counted_as_settle_errors(prefix: str) -> None:
    """Each quick try of a failing SENT mark is one settle error and one timed settle."""
    store = SettleFailsFirst.from_url(REDIS_URL)
    store.failures = 3  # the three quick tries fail; the background loop then lands it
    registry = CollectorRegistry()
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0, registry=registry)
    assert (await core.process(one_message())).reply.code == 250
    assert sample(registry, "relay_store_errors_total", "settle") == 3.0
    assert sample(registry, "relay_store_seconds_count", "settle") == 4.0  # + SENDING
    assert sample(registry, "relay_store_errors_total", "reserve") == 0.0
    await asyncio.wait_for(asyncio.gather(*core.background), timeout=10)
    await store.close()


class RenewIgnoresCancel(RedisStore):
    """A real RedisStore whose renewals hang and shrug off a cancellation (the way a lost
    cancellation inside a client library looks from outside)."""

    async def renew(self, keys: Sequence[str], *, token: str, lease_s: float) -> list[bool]:
        for _ in range(50):
            try:
                await asyncio.sleep(0.1)
            except asyncio.CancelledError:
                continue
        return await super().renew(keys, token=token, lease_s=lease_s)


class SlowUpstream(CountingUpstream):
    """Accepts everything after 0.5 s (longer than a renewal interval of the 0.6 s lease)."""

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        await asyncio.sleep(0.5)
        return await super().deliver(message, progress)


@pytest.mark.timeout(30)
async def test_an_attempt_never_waits_for_its_lease_renewer(prefix: str) -> None:
    """A renewal still hanging when the upstream answered does not hold up the attempt: the
    message is answered and SENT at once (it hung for as long as the renewal on old code)."""
    store = RenewIgnoresCancel.from_url(REDIS_URL)
    core = make_core(store, SlowUpstream(), prefix, lease_s=0.6)
    try:
        decision = await asyncio.wait_for(core.process(one_message()), 3.0)
    finally:
        await store.close()
    assert decision.reply.code == 250
