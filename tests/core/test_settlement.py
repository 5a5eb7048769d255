"""Settlement bookkeeping (core/settlement.py): what is owed, what is counted,
what is logged and measured, and that shutdown's cancellation is not swallowed.

Real Redis under a RedisStore subclass whose settles fail on demand (a store hiccup a real
Redis cannot produce on cue); the dedup core and metrics are the real ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import pytest
import redis.asyncio as aredis
from aiosmtpd.smtp import SMTP, Envelope, Session
from prometheus_client import CollectorRegistry

from relay.core import replies
from relay.core.cancellation import run_to_end
from relay.core.dedup import DedupCore, InboundMessage, Policy, TemplateRule
from relay.core.errors import StoreError
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    OutboundMessage,
    Settle,
    SettleOp,
)
from relay.ops.metrics import PrometheusMetrics
from relay.store.redis.store import RedisStore
from tests.support.clients import message, send
from tests.support.dedup_parts import (
    CountingUpstream,
    HangingUpstream,
    SettleFailsFirst,
    make_core,
    one_message,
)
from tests.support.relays import REDIS_URL, MakeRelay
from tests.support.sink import SinkHandler, start_sink
from tests.support.waiting import until


class SettleDown(RedisStore):
    """A real RedisStore on which every settle after the dot fails while ``down``; ``refused``
    counts those failed settles."""

    down = True
    refused = 0

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        if self.down and all(op.action is not Settle.SENDING for op in ops):
            self.refused += 1
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
    cancellation inside a client library looks from outside) until ``release`` is set;
    ``renewals_over`` is set once none is running."""

    release: asyncio.Event
    renewals_over: asyncio.Event

    async def renew(self, keys: Sequence[str], *, token: str, lease_s: float,
                    window_s: float = 0.0) -> list[bool]:
        self.renewals_over.clear()
        try:
            while not self.release.is_set():
                try:
                    await self.release.wait()
                except asyncio.CancelledError:
                    continue
            return await super().renew(keys, token=token, lease_s=lease_s)
        finally:
            self.renewals_over.set()


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
    store.release, store.renewals_over = asyncio.Event(), asyncio.Event()
    core = make_core(store, SlowUpstream(), prefix, lease_s=0.6)
    try:
        decision = await asyncio.wait_for(core.process(one_message()), 3.0)
        assert not store.renewals_over.is_set(), "the renewal was still hanging at the answer"
    finally:
        store.release.set()  # the hung renewal ends before its store closes (no leaked socket)
        await asyncio.wait_for(store.renewals_over.wait(), 5.0)
        await store.close()
    assert decision.reply.code == 250


async def test_a_settle_deferred_to_the_background_is_logged_when_deferred_and_when_it_lands(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A SENT mark whose quick tries fail logs each failure and an ERROR as it is deferred, and
    a WARNING with the number of background tries once it lands."""
    store = SettleFailsFirst.from_url(REDIS_URL)
    store.failures = 3  # the quick tries; the first background try lands
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0)
    with caplog.at_level(logging.INFO, logger="relay.core.settlement"):
        assert (await core.process(one_message())).reply.code == 250
        await asyncio.wait_for(asyncio.gather(*core.background), timeout=10)
    texts = [r.getMessage() for r in caplog.records]
    assert "settle failed: settle: TimeoutError: timed out" in texts
    assert "settle failed; retrying 1 write(s) in the background until they land" in texts
    assert "settle landed after 1 background attempt(s)" in texts
    await store.close()


async def test_a_background_settle_that_lands_leaves_the_background_set(prefix: str) -> None:
    """Once its write lands, a background settle is no longer among the core's background."""
    store = SettleFailsFirst.from_url(REDIS_URL)
    store.failures = 3
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0)
    assert (await core.process(one_message())).reply.code == 250
    assert core.background
    await asyncio.wait_for(asyncio.gather(*core.background), timeout=10)
    await asyncio.sleep(0)
    assert not core.background
    await store.close()


async def test_a_settle_given_up_after_the_window_is_counted_and_owed_no_more(
        prefix: str) -> None:
    """A SENT mark still failing when the 0.5 s dedup window ends (lease 30 s) is given up:
    counted once in mark_sent_failed and no longer owed (nothing for the journal)."""
    store = SettleDown.from_url(REDIS_URL)
    registry = CollectorRegistry()
    core = DedupCore(store=store, upstream=CountingUpstream(),
                     metrics=PrometheusMetrics(registry=registry),
                     policy=Policy(key_prefix=prefix, lease_s=30.0, window_s=0.5))
    assert (await core.process(one_message())).reply.code == 250
    await asyncio.wait_for(asyncio.gather(*core.background), timeout=10)
    assert registry.get_sample_value("relay_mark_sent_failed_total") == 1.0
    assert core.owed_settles() == []
    await store.close()


async def test_an_attempts_lease_renewer_is_gone_once_it_is_answered(prefix: str) -> None:
    """The renewer of a relayed message's lease has ended and been dropped right after the
    reply (it is cancelled, not left asleep for a third of the lease)."""
    store = RedisStore.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0)
    assert (await core.process(one_message())).reply.code == 250
    await asyncio.sleep(0.05)
    assert not core._settler._renewers
    await store.close()


async def test_lease_renewals_are_timed_under_their_op_label(prefix: str) -> None:
    """An upstream taking 0.5 s under a 0.6 s lease: renewed every 0.2 s (1 to 3 times, not
    in a tight loop), each renewal timed under op=renew."""
    store = RedisStore.from_url(REDIS_URL)
    registry = CollectorRegistry()
    core = make_core(store, SlowUpstream(), prefix, lease_s=0.6, registry=registry)
    assert (await core.process(one_message())).reply.code == 250
    assert 1.0 <= sample(registry, "relay_store_seconds_count", "renew") <= 3.0
    await store.close()


async def test_healthy_lease_renewals_log_nothing_above_info(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Renewals that keep every key (an upstream slower than a third of the lease) log no
    WARNING or ERROR line."""
    store = RedisStore.from_url(REDIS_URL)
    core = make_core(store, SlowUpstream(), prefix, lease_s=0.6)
    with caplog.at_level(logging.DEBUG):
        assert (await core.process(one_message())).reply.code == 250
    assert [r.getMessage() for r in caplog.records if r.levelno > logging.INFO] == []
    await store.close()


class KeyTakenBefore(RedisStore):
    """A real RedisStore on which the key is deleted just before a settle of ``action`` (the
    lease lapsed and another attempt took the key over and released it)."""

    action = Settle.SENT

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        for op in ops:
            if op.action is self.action:
                await self._client.delete(op.key)
        return await super().settle(ops, token=token, window_s=window_s)


async def test_a_sent_mark_that_finds_the_key_taken_is_logged(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A SENT mark the key no longer accepts (not this attempt's) is a WARNING; the reply is
    still the upstream's 250."""
    store = KeyTakenBefore.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix)
    with caplog.at_level(logging.INFO, logger="relay.core.settlement"):
        assert (await core.process(one_message())).reply.code == 250
    assert any(r.levelno == logging.WARNING and r.getMessage().startswith(
        "settle sent not applied: the key no longer holds") for r in caplog.records)
    await store.close()


async def test_a_reservation_lost_before_the_dot_is_logged(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A SENDING mark the key no longer accepts stops the dot, answers RESERVATION_LOST and
    logs an ERROR saying so."""
    store = KeyTakenBefore.from_url(REDIS_URL)
    store.action = Settle.SENDING
    upstream = CountingUpstream()
    core = make_core(store, upstream, prefix)
    with caplog.at_level(logging.INFO, logger="relay.core.settlement"):
        decision = await core.process(one_message())
    assert decision.reply == replies.RESERVATION_LOST and upstream.sent == []
    assert any(r.levelno == logging.ERROR and r.getMessage().startswith(
        "a reservation is no longer ours before the final dot") for r in caplog.records)
    await store.close()


async def test_an_owed_settle_paid_by_a_retrys_flush_is_logged(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A SENT mark owed in the background and paid by the retry's flush logs a WARNING."""
    store = SettleDown.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0)
    assert (await core.process(one_message())).reply.code == 250
    store.down = False
    with caplog.at_level(logging.INFO, logger="relay.core.settlement"):
        await core.process(one_message())
    assert "settle owed on 1 key(s) landed before a retry's reserve" in [
        r.getMessage() for r in caplog.records]
    await stop_background(core.background)
    await store.close()


async def test_a_transaction_cut_before_the_dot_is_logged_as_released(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Shutdown cutting a transaction before its dot logs a WARNING that it was released."""
    store = RedisStore.from_url(REDIS_URL)
    core = make_core(store, HangingUpstream(), prefix)
    with caplog.at_level(logging.INFO, logger="relay.core.settlement"):
        task = asyncio.create_task(core.process(one_message()))
        await asyncio.sleep(0.3)
        task.cancel()
        await task
    assert "transaction cut by shutdown before the final dot: released" in [
        r.getMessage() for r in caplog.records]
    await store.close()


async def test_settles_an_earlier_run_owed_that_do_not_land_are_returned(prefix: str) -> None:
    """Paying the journal's settles while the store is down returns every one of them (they
    are retried in the background)."""
    store = SettleDown.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix)
    owed = [("t1", SettleOp(prefix + "a", Settle.SENT, "250 ok")),
            ("t1", SettleOp(prefix + "b", Settle.RELEASE)),
            ("t2", SettleOp(prefix + "c", Settle.UNKNOWN))]
    assert await core.pay_owed(owed) == owed
    await stop_background(core.background)
    await store.close()


class RenewFindsKeysGone(RedisStore):
    """A real RedisStore on which the keys are gone when a renewal comes (another attempt took
    them over after a lapse and released them)."""

    async def renew(self, keys: Sequence[str], *, token: str, lease_s: float,
                    window_s: float = 0.0) -> list[bool]:
        await self._client.delete(*keys)
        return await super().renew(keys, token=token, lease_s=lease_s)


async def test_a_renewal_that_finds_the_key_taken_is_logged(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A renewal the key no longer accepts, while the upstream works, logs an ERROR."""
    store = RenewFindsKeysGone.from_url(REDIS_URL)
    core = make_core(store, SlowUpstream(), prefix, lease_s=0.6)
    with caplog.at_level(logging.INFO, logger="relay.core.settlement"):
        await core.process(one_message())
    assert "1 reservation(s) no longer this attempt's while it works" in [
        r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    await store.close()


async def test_run_to_end_finishes_its_work_through_a_cancellation_of_the_caller(
        caplog: pytest.LogCaptureFixture) -> None:
    """A caller cancelled while run_to_end waits still gets the work's result, is left no
    longer cancelling, and the refused stop is logged as a WARNING."""
    work: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def caller() -> tuple[str, int]:
        result = await run_to_end(work)
        task = asyncio.current_task()
        assert task is not None
        return result, task.cancelling()

    task = asyncio.create_task(caller())
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.05)
    work.set_result("done")
    assert await task == ("done", 0)
    assert "a store write that must complete was asked to stop: finishing it" in [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


async def test_a_settle_given_up_after_the_window_is_logged(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A SENT mark still failing when the 0.5 s dedup window ends logs an ERROR: given up."""
    store = SettleDown.from_url(REDIS_URL)
    core = DedupCore(store=store, upstream=CountingUpstream(),
                     metrics=PrometheusMetrics(registry=CollectorRegistry()),
                     policy=Policy(key_prefix=prefix, lease_s=30.0, window_s=0.5))
    with caplog.at_level(logging.INFO, logger="relay.core.settlement"):
        assert (await core.process(one_message())).reply.code == 250
        await asyncio.wait_for(asyncio.gather(*core.background), timeout=10)
    assert "settle never landed within the dedup window: given up" in [
        r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    await store.close()


async def test_a_settle_still_owed_at_shutdown_is_logged_for_the_journal(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Cancelling a background settle (shutdown) logs an ERROR: left in the settle journal."""
    store = SettleDown.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0)
    with caplog.at_level(logging.INFO, logger="relay.core.settlement"):
        assert (await core.process(one_message())).reply.code == 250
        await stop_background(core.background)
    assert "settle still owed at shutdown: left in the settle journal" in [
        r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    await store.close()


class RenewDown(RedisStore):
    """A real RedisStore whose renewals fail (Redis unreachable for them); ``tried_twice`` is
    set at the second renewal tried."""

    tried: int = 0
    tried_twice: asyncio.Event

    async def renew(self, keys: Sequence[str], *, token: str, lease_s: float,
                    window_s: float = 0.0) -> list[bool]:
        self.tried += 1
        if self.tried >= 2:
            self.tried_twice.set()
        raise StoreError("renew", "ConnectionError: connection refused")


class UpstreamAfter(CountingUpstream):
    """Accepts everything once ``event`` is set (at most 30 s later)."""

    def __init__(self, event: asyncio.Event) -> None:
        super().__init__()
        self.event = event

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        await asyncio.wait_for(self.event.wait(), 30)
        return await super().deliver(message, progress)


async def test_a_failed_renewal_is_logged_and_tried_again(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A renewal the store refuses while the upstream works logs a WARNING and is tried
    again, and the message is still relayed (the upstream answers after the second try: at
    a third and a sixth of the 3 s lease, far from its end)."""
    store = RenewDown.from_url(REDIS_URL)
    store.tried_twice = asyncio.Event()
    core = make_core(store, UpstreamAfter(store.tried_twice), prefix, lease_s=3.0)
    with caplog.at_level(logging.INFO, logger="relay.core.settlement"):
        assert (await core.process(one_message())).reply.code == 250
    assert store.tried >= 2
    assert any(r.levelno == logging.WARNING and r.getMessage().startswith(
        "cannot renew 1 reservation(s)") for r in caplog.records)
    await store.close()


class SlowerUpstream(SlowUpstream):
    """Accepts everything after 0.9 s (four renewal intervals of the 0.6 s lease)."""

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        await asyncio.sleep(0.4)
        return await super().deliver(message, progress)


async def test_renewals_go_on_every_third_of_the_lease_while_the_upstream_works(
        prefix: str) -> None:
    """An upstream taking 0.9 s under a 0.6 s lease: renewed 3 to 5 times, none an error, each
    well under a second."""
    store = RedisStore.from_url(REDIS_URL)
    registry = CollectorRegistry()
    core = make_core(store, SlowerUpstream(), prefix, lease_s=0.6, registry=registry)
    assert (await core.process(one_message())).reply.code == 250
    renewals = sample(registry, "relay_store_seconds_count", "renew")
    assert 3.0 <= renewals <= 5.0
    assert sample(registry, "relay_store_errors_total", "renew") == 0.0
    assert 0.0 < sample(registry, "relay_store_seconds_sum", "renew") < renewals
    await store.close()


async def test_a_failed_renewal_is_tried_again_at_the_next_tick(prefix: str) -> None:
    """Renewals the store refuses during a 0.9 s transaction (0.6 s lease) are tried again
    every third of the lease: at least three renew errors, not one."""
    store = RenewDown.from_url(REDIS_URL)
    store.tried_twice = asyncio.Event()
    registry = CollectorRegistry()
    core = make_core(store, SlowerUpstream(), prefix, lease_s=0.6, registry=registry)
    await core.process(one_message())  # the lapsed lease answers RESERVATION_LOST
    errors = sample(registry, "relay_store_errors_total", "renew")
    assert errors >= 3.0
    assert 0.0 < sample(registry, "relay_store_seconds_sum", "renew") < errors  # timed too
    await store.close()


async def test_run_to_end_raises_when_its_work_itself_is_cancelled() -> None:
    """run_to_end on work that is cancelled (not its caller) raises CancelledError at once."""
    work: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_to_end(work))
    await asyncio.sleep(0.05)
    work.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)


async def test_journal_settles_that_do_not_land_are_retried_in_the_background(
        prefix: str) -> None:
    """Settles an earlier run owed that the store refuses now stay owed and get one background
    retry per token."""
    store = SettleDown.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix)
    owed = [("t1", SettleOp(prefix + "a", Settle.SENT, "250 ok")),
            ("t2", SettleOp(prefix + "c", Settle.UNKNOWN))]
    await core.pay_owed(owed)
    assert len(core.background) == 2
    assert sorted(core.owed_settles(), key=lambda t: t[0]) == owed
    await stop_background(core.background)
    await store.close()


class SendingDown(RedisStore):
    """A real RedisStore whose SENDING marks fail (Redis gone just before the dot)."""

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        if any(op.action is Settle.SENDING for op in ops):
            raise StoreError("settle", "ConnectionError: connection refused")
        return await super().settle(ops, token=token, window_s=window_s)


async def test_a_sending_mark_the_store_refuses_is_logged(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A SENDING mark the store refuses stops the dot and logs an ERROR: not sending."""
    store = SendingDown.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix)
    with caplog.at_level(logging.INFO, logger="relay.core.settlement"):
        await core.process(one_message())
    assert any(r.levelno == logging.ERROR and r.getMessage().startswith(
        "cannot mark SENDING before the final dot") for r in caplog.records)
    await store.close()


async def test_failed_quick_settles_are_timed(prefix: str) -> None:
    """Each failing quick try of a SENT mark is timed under op=settle, each well under a
    second."""
    store = SettleFailsFirst.from_url(REDIS_URL)
    store.failures = 3
    registry = CollectorRegistry()
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0, registry=registry)
    assert (await core.process(one_message())).reply.code == 250
    assert 0.0 < sample(registry, "relay_store_seconds_sum", "settle") < 2.0
    await asyncio.wait_for(asyncio.gather(*core.background), timeout=10)
    await store.close()


ANOTHER_ATTEMPT = b"P|" + b"f" * 32  # another attempt's PENDING record


class TakesTheKeysAtRcpt(SinkHandler):
    """A sink that, as each RCPT arrives, hands every key under ``prefix`` to another attempt
    (``P|<its token>``, the TTL kept): the relay's lease lapsed and a retry reserved the
    fingerprint while this transaction was under way."""

    prefix = "no-prefix-yet:"

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        client = aredis.Redis.from_url(REDIS_URL)
        try:
            async for key in client.scan_iter(match=self.prefix + "*"):
                await client.set(key, ANOTHER_ATTEMPT, keepttl=True)
        finally:
            await client.aclose()
        return await super().handle_RCPT(server, session, envelope, address, options)


async def test_a_reservation_lost_before_the_dot_answers_451_and_sends_nothing(
        make_relay: MakeRelay) -> None:
    """A fingerprint another attempt took over before the final dot: the relay sends no dot,
    answers ``451 4.3.0`` (RESERVATION_LOST) and leaves the other attempt's record as it was."""
    handler = TakesTheKeysAtRcpt()
    sink = await start_sink(handler=handler)
    client = aredis.Redis.from_url(REDIS_URL)
    try:
        relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
        handler.prefix = relay.settings.store_prefix
        result = await send(relay.port, ["user@example.net"], message())
        assert (result.code, result.text) == (451, replies.RESERVATION_LOST.text)
        assert sink.handler.delivered == []
        keys = [k async for k in client.scan_iter(match=handler.prefix + "*")]
        assert len(keys) == 1 and await client.get(keys[0]) == ANOTHER_ATTEMPT
    finally:
        await client.aclose()
        sink.server.close()
        await sink.server.wait_closed()


class PeekingUpstream(CountingUpstream):
    """Accepts everything; once the SENDING mark let the dot go, waits ``hold_s`` seconds (the
    upstream working on the message) and then keeps what Redis holds under ``prefix``: each
    key's value, its PTTL and the server's time in ms, read in one transaction."""

    def __init__(self, prefix: str, hold_s: float = 0.0) -> None:
        super().__init__()
        self.prefix, self.hold_s = prefix, hold_s
        self.seen: dict[bytes, tuple[bytes, int, int]] = {}

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        if progress is not None and progress.before_dot is not None:
            assert await progress.before_dot(message.rcpt_tos)
            progress.before_dot = None  # marked: the counting upstream goes straight on
            progress.dot_written = True
        await asyncio.sleep(self.hold_s)
        client = aredis.Redis.from_url(REDIS_URL)
        try:
            async for key in client.scan_iter(match=self.prefix + "*"):
                async with client.pipeline(transaction=True) as pipe:
                    pipe.get(key)
                    pipe.pttl(key)
                    pipe.time()
                    value, pttl_ms, (now_s, now_us) = await pipe.execute()
                self.seen[key] = (value, pttl_ms, int(now_s) * 1000 + int(now_us) // 1000)
        finally:
            await client.aclose()
        return await super().deliver(message, progress)


def sending_fields(value: bytes) -> tuple[int, int]:
    """A SENDING value's heartbeat (unix ms) and lease (ms): ``D|<token>|<ms>|<lease ms>``."""
    tag, _token, heartbeat_ms, lease_ms = value.split(b"|")
    assert tag == b"D"
    return int(heartbeat_ms), int(lease_ms)


async def test_a_sending_record_holds_the_attempts_lease_and_lives_the_window(
        prefix: str) -> None:
    """The SENDING record of an attempt with a 30 s lease carries that lease (30000 ms: what a
    retry judges it in doubt by) and expires a dedup window (3600 s) after its heartbeat."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = PeekingUpstream(prefix)
    core = DedupCore(store=store, upstream=upstream,
                     metrics=PrometheusMetrics(registry=CollectorRegistry()),
                     policy=Policy(key_prefix=prefix, lease_s=30.0, window_s=3600.0))
    try:
        assert (await core.process(one_message())).reply.code == 250
        [(value, pttl_ms, now_ms)] = upstream.seen.values()
        heartbeat_ms, lease_ms = sending_fields(value)
        assert lease_ms == 30_000
        assert abs(pttl_ms + (now_ms - heartbeat_ms) - 3_600_000) <= 5  # ms rounding
    finally:
        await store.close()


async def test_renewals_of_a_sending_record_keep_it_to_the_templates_shorter_window(
        prefix: str) -> None:
    """A template with a 5 s window under a relay's 3600 s: a SENDING record renewed while the
    upstream works (0.6 s lease, renewed every 0.2 s) expires 5 s after its last heartbeat, not
    3600 s."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = PeekingUpstream(prefix, hold_s=0.5)
    policy = Policy(key_prefix=prefix, lease_s=0.6, window_s=3600.0,
                    templates=(TemplateRule(match="welcome", window_s=5.0),))
    core = DedupCore(store=store, upstream=upstream,
                     metrics=PrometheusMetrics(registry=CollectorRegistry()), policy=policy)
    try:
        started_ms = int(time.time() * 1000)
        assert (await core.process(one_message())).reply.code == 250
        [(value, pttl_ms, now_ms)] = upstream.seen.values()
        heartbeat_ms, lease_ms = sending_fields(value)
        assert lease_ms == 600
        assert heartbeat_ms - started_ms >= 150, "no renewal came while the upstream worked"
        assert abs(pttl_ms + (now_ms - heartbeat_ms) - 5_000) <= 5  # ms rounding
    finally:
        await store.close()


async def test_a_sent_mark_still_owed_is_not_counted_lost_before_the_lease_ends(
        prefix: str) -> None:
    """A SENT mark failing its quick tries and two background tries within a 30 s lease is not
    yet counted in ``relay_mark_sent_failed_total`` (a retry still gets 450, not in doubt)."""
    store = SettleDown.from_url(REDIS_URL)
    registry = CollectorRegistry()
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0, registry=registry)
    try:
        assert (await core.process(one_message())).reply.code == 250
        await until(lambda: store.refused >= 5, what="two background tries")  # 3 quick + 2
        assert not registry.get_sample_value("relay_mark_sent_failed_total")
    finally:
        await stop_background(core.background)
        await store.close()


class SettleTimes(SettleFailsFirst):
    """SettleFailsFirst that keeps in ``at`` the ``time.monotonic()`` of every settle after
    the dot."""

    at: list[float]

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        if all(op.action is not Settle.SENDING for op in ops):
            self.at.append(time.monotonic())
        return await super().settle(ops, token=token, window_s=window_s)


async def test_the_quick_settle_tries_are_spaced_a_tenth_then_a_fifth_of_a_second(
        prefix: str) -> None:
    """A SENT mark whose first two tries fail is tried three times: the second at least 0.1 s
    after the first, the third at least 0.2 s after the second (a store hiccup is given time
    to pass, not hammered)."""
    store = SettleTimes.from_url(REDIS_URL)
    store.failures, store.at = 2, []
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0)
    try:
        assert (await core.process(one_message())).reply.code == 250
        assert not core.background and len(store.at) == 3
        first, second, third = store.at
        assert second - first >= 0.1 and third - second >= 0.2
    finally:
        await store.close()
