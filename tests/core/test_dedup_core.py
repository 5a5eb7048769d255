"""The dedup core on its Protocols, for store faults a real Redis cannot produce on demand."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import pytest
import redis.asyncio as aredis
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
    Reservation,
    Settle,
    SettleOp,
    SmtpReply,
    State,
)
from relay.core.keys import recipient_keys
from relay.core.rules import iso_utc as _iso
from relay.ops.metrics import PrometheusMetrics
from relay.settings import Settings
from relay.store.redis.store import RedisStore
from tests.support.clients import message
from tests.support.dedup_parts import (
    CountingUpstream,
    HangingUpstream,
    SettleFailsFirst,
    make_core,
    one_message,
)
from tests.support.relays import REDIS_URL


class LandsThenTimesOut(RedisStore):
    """A real RedisStore whose reserve runs on the server, then reports a timeout."""

    async def reserve(self, keys: Sequence[str], *, token: str, lease_s: float,
                      **options: Any) -> list[Reservation]:
        await super().reserve(keys, token=token, lease_s=lease_s, **options)
        raise StoreError("reserve", "TimeoutError: timed out")


async def test_reserve_that_landed_then_timed_out_is_released(prefix: str) -> None:
    """A reserve that ran but timed out is undone, so the retry is relayed, not held 450."""
    store = LandsThenTimesOut.from_url(REDIS_URL)
    upstream = CountingUpstream()
    core = make_core(store, upstream, prefix)
    msg = one_message()
    first = await core.process(msg)
    assert first.reply.code == 451 and first.outcomes == {"user@example.net": "store_down"}
    plain = RedisStore.from_url(REDIS_URL)
    core2 = make_core(plain, upstream, prefix)
    second = await core2.process(msg)
    assert second.reply.code == 250 and second.outcomes == {"user@example.net": "relayed"}
    assert len(upstream.sent) == 1
    client = aredis.Redis.from_url(REDIS_URL)
    keys = [k async for k in client.scan_iter(match=prefix + "*")]
    await client.aclose()
    assert len(keys) == 1
    assert (await plain.inspect(keys[0].decode())).state is State.SENT
    await store.close()
    await plain.close()


async def test_mark_sent_that_fails_is_retried_until_it_lands(prefix: str) -> None:
    """A mark-sent lost to a store hiccup lands later, so a retry is suppressed, never resent."""
    store = SettleFailsFirst.from_url(REDIS_URL)
    upstream = CountingUpstream()
    registry = CollectorRegistry()
    core = make_core(store, upstream, prefix, lease_s=20.0, registry=registry)
    msg = one_message()
    first = await core.process(msg)
    assert first.reply.code == 250  # the upstream accepted: that verdict stands
    assert core.background, "the mark must go on being retried"
    await asyncio.wait_for(asyncio.gather(*core.background), timeout=15)
    second = await core.process(msg)
    assert second.outcomes == {"user@example.net": "suppressed"}
    assert len(upstream.sent) == 1
    assert registry.get_sample_value("relay_mark_sent_failed_total") == 0.0
    await store.close()


class SendingLandsThenStoreDies(RedisStore):
    """A real RedisStore whose SENDING mark runs on the server, then the store goes away.

    That is Redis stopped just after it ran the script: the relay cannot know the mark landed,
    and every write fails until ``up()`` (a restart) is called.
    """

    down = False
    landed_unseen = 0

    def up(self) -> None:
        self.down = False

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        if self.down:
            raise StoreError("settle", "ConnectionError: connection refused")
        applied = await super().settle(ops, token=token, window_s=window_s)
        if any(op.action is Settle.SENDING for op in ops) and not self.landed_unseen:
            self.landed_unseen += 1
            self.down = True
            raise StoreError("settle", "TimeoutError: timed out")
        return applied

    async def reserve(self, keys: Sequence[str], *, token: str, lease_s: float,
                      **options: Any) -> list[Reservation]:
        if self.down:
            raise StoreError("reserve", "ConnectionError: connection refused")
        return await super().reserve(keys, token=token, lease_s=lease_s,
                                     **options)


async def _sending_landed_then_store_down_past_the_lease(
        prefix: str) -> tuple[SendingLandsThenStoreDies, DedupCore, CountingUpstream,
                              InboundMessage]:
    store = SendingLandsThenStoreDies.from_url(REDIS_URL)
    upstream = CountingUpstream()
    core = make_core(store, upstream, prefix, lease_s=1.0)
    msg = one_message()
    first = await core.process(msg)
    assert first.reply.code == 451 and upstream.sent == []  # no dot went out
    assert core.background, "the release must go on being retried"
    await asyncio.sleep(1.5)  # the store stays down past the lease
    retry_while_down = await core.process(msg)
    assert retry_while_down.reply.code == 451
    store.up()
    return store, core, upstream, msg


async def test_release_owed_when_store_returns_is_paid_before_the_retry_reserves(
        prefix: str) -> None:
    """A SENDING mark that landed unseen, then a store outage past the lease: the retry is sent.

    Without the owed release applied first, the SENDING record would read as UNKNOWN past the
    lease and the retry of a message that never left would be suppressed "in doubt".
    """
    store, core, upstream, msg = await _sending_landed_then_store_down_past_the_lease(prefix)
    retry = await core.process(msg)  # at once: the background loop is still asleep
    assert retry.outcomes == {"user@example.net": "relayed"}, retry
    assert len(upstream.sent) == 1
    again = await core.process(msg)
    assert again.outcomes == {"user@example.net": "suppressed"}
    assert len(upstream.sent) == 1
    for task in core.background:
        task.cancel()
    await asyncio.gather(*core.background, return_exceptions=True)
    await store.close()


async def test_release_owed_lands_in_the_background_after_the_lease(prefix: str) -> None:
    """The background loop keeps retrying the release past the lease until it lands."""
    store, core, upstream, msg = await _sending_landed_then_store_down_past_the_lease(prefix)
    await asyncio.wait_for(asyncio.gather(*core.background), timeout=10)
    client = aredis.Redis.from_url(REDIS_URL)
    keys = [k async for k in client.scan_iter(match=prefix + "*")]
    await client.aclose()
    assert keys == []  # released: nothing SENDING left to read as UNKNOWN
    plain = RedisStore.from_url(REDIS_URL)
    core2 = make_core(plain, upstream, prefix)
    retry = await core2.process(msg)  # another relay: it never owed anything
    assert retry.outcomes == {"user@example.net": "relayed"}
    await store.close()
    await plain.close()


async def test_mark_sent_still_owed_at_the_lease_end_is_counted_and_still_lands(
        prefix: str) -> None:
    """A SENT mark missing past the lease is counted once, and lands when the store answers."""
    store = SettleFailsFirst.from_url(REDIS_URL)
    store.failures = 6  # 3 quick + 3 background tries: the 4th starts >= 1.7 s in, past the lease
    upstream = CountingUpstream()
    registry = CollectorRegistry()
    core = make_core(store, upstream, prefix, lease_s=1.0, registry=registry)
    msg = one_message()
    assert (await core.process(msg)).reply.code == 250
    await asyncio.wait_for(asyncio.gather(*core.background), timeout=20)
    assert registry.get_sample_value("relay_mark_sent_failed_total") == 1.0
    retry = await core.process(msg)
    assert retry.outcomes == {"user@example.net": "suppressed"}  # SENT, not in doubt
    assert len(upstream.sent) == 1
    await store.close()


@pytest.mark.parametrize("content", [message(), b"Subject: no key\r\n\r\nhi\r\n"],
                         ids=["dedup", "plain"])
async def test_a_cut_transaction_hands_its_task_back_uncancelled(
        prefix: str, content: bytes) -> None:
    """A transaction cut by shutdown is answered 451 and leaves its task no longer cancelling
    (a later timeout in that task still raises TimeoutError), with or without a dedupe key."""
    store = RedisStore.from_url(REDIS_URL)
    core = make_core(store, HangingUpstream(), prefix)
    msg = InboundMessage(mail_from="app@example.com", rcpt_tos=["user@example.net"],
                         content=content, queue_id="q1")

    async def attempt() -> tuple[SmtpReply, int]:
        decision = await core.process(msg)
        task = asyncio.current_task()
        assert task is not None
        return decision.reply, task.cancelling()

    task = asyncio.create_task(attempt())
    await asyncio.sleep(0.3)
    task.cancel()
    reply, cancelling = await task
    await store.close()
    assert reply == replies.CUT_BY_SHUTDOWN
    assert cancelling == 0


class SettleHangsWhileOwed(SettleFailsFirst):
    """SettleFailsFirst whose settles, once ``hang`` is set, wait until cancelled."""

    hang = False

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        if self.hang:
            await asyncio.Event().wait()
        return await super().settle(ops, token=token, window_s=window_s)


async def test_a_cut_while_a_retry_pays_an_owed_settle_hands_its_task_back_uncancelled(
        prefix: str) -> None:
    """Shutdown cutting a retry while it pays the settle its first attempt owes (the flush
    before its reserve) answers 451 and leaves the task no longer cancelling."""
    store = SettleHangsWhileOwed.from_url(REDIS_URL)
    store.failures = 100  # the SENT mark stays owed
    core = make_core(store, CountingUpstream(), prefix, lease_s=30.0)
    assert (await core.process(one_message())).reply.code == 250
    store.hang = True

    async def retry() -> tuple[SmtpReply, int]:
        decision = await core.process(one_message())
        task = asyncio.current_task()
        assert task is not None
        return decision.reply, task.cancelling()

    task = asyncio.create_task(retry())
    await asyncio.sleep(0.3)
    task.cancel()
    reply, cancelling = await task
    for t in core.background:
        t.cancel()
    await asyncio.gather(*core.background, return_exceptions=True)
    await store.close()
    assert reply == replies.CUT_BY_SHUTDOWN
    assert cancelling == 0


class ReserveDown(RedisStore):
    """A real RedisStore whose reserve always fails (Redis unreachable)."""

    async def reserve(self, keys: Sequence[str], *, token: str, lease_s: float,
                      **options: Any) -> list[Reservation]:
        raise StoreError("reserve", "ConnectionError: connection refused")


async def test_a_failed_reserve_is_logged_with_the_store_down_policy(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """A reserve the store refuses logs an ERROR naming the error and store_down policy."""
    store = ReserveDown.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix)
    with caplog.at_level(logging.INFO, logger="relay.core.dedup"):
        assert (await core.process(one_message())).reply == replies.STORE_DOWN
    assert any(r.levelno == logging.ERROR and r.getMessage().startswith("store reserve failed")
               and "store_down=fail_closed" in r.getMessage() for r in caplog.records)
    await store.close()


def test_the_cores_policy_defaults_are_the_relays_configuration_defaults() -> None:
    """Policy() equals the policy the app builds from default Settings (no drift)."""
    assert Settings.model_validate({"upstream": "127.0.0.1:25"}).dedup_policy() == Policy()


async def test_a_message_without_transport_flags_goes_upstream_as_plain_smtp(prefix: str) -> None:
    """An InboundMessage built without smtputf8 / eight_bit / utf8_headers is relayed with
    all three off."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = CountingUpstream()
    core = make_core(store, upstream, prefix)
    assert (await core.process(one_message())).reply.code == 250
    sent = upstream.sent[0]
    assert (sent.smtputf8, sent.eight_bit, sent.utf8_headers) == (False, False, False)
    await store.close()


class SlowReserve(RedisStore):
    """A real RedisStore whose reserve reaches Redis only after 0.5 s (a slow link)."""

    async def reserve(self, keys: Sequence[str], *, token: str, lease_s: float,
                      **options: Any) -> list[Reservation]:
        await asyncio.sleep(0.5)
        return await super().reserve(keys, token=token, lease_s=lease_s,
                                     **options)


async def test_a_cut_during_a_slow_reserve_waits_for_it_then_releases_it(prefix: str) -> None:
    """Shutdown cutting a reserve still on its way lets it land before releasing: nothing is
    left PENDING (a release sent first would find nothing, and the reserve would land after)."""
    store = SlowReserve.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix)
    task = asyncio.create_task(core.process(one_message()))
    await asyncio.sleep(0.2)
    task.cancel()
    assert (await task).reply == replies.CUT_BY_SHUTDOWN
    await asyncio.sleep(0.5)
    [key] = recipient_keys(["user@example.net"], "welcome", "K-1", core.policy, None).values()
    assert (await store.inspect(key)).state is State.ABSENT
    await store.close()


async def test_a_second_spelling_of_a_mailbox_shares_the_one_copy_as_suppressed(
        prefix: str) -> None:
    """user@ and USER@ in one message: one copy goes upstream, the second spelling's outcome is
    suppressed."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = CountingUpstream()
    core = make_core(store, upstream, prefix)
    msg = InboundMessage(mail_from="app@example.com", queue_id="q1", content=message(),
                         rcpt_tos=["user@example.net", "USER@example.net"])
    decision = await core.process(msg)
    assert decision.outcomes == {"user@example.net": "relayed", "USER@example.net": "suppressed"}
    assert len(upstream.sent) == 1
    await store.close()


async def test_reserve_and_upstream_latencies_are_measured(prefix: str) -> None:
    """A quick message records one reserve and one upstream call, each well under a second."""
    store = RedisStore.from_url(REDIS_URL)
    registry = CollectorRegistry()
    core = make_core(store, CountingUpstream(), prefix, registry=registry)
    assert (await core.process(one_message())).reply.code == 250
    reserve_s = registry.get_sample_value("relay_store_seconds_sum", {"op": "reserve"})
    upstream_s = registry.get_sample_value("relay_upstream_seconds_sum")
    assert reserve_s is not None and 0.0 < reserve_s < 1.0
    assert upstream_s is not None and 0.0 < upstream_s < 1.0
    await store.close()


async def test_a_failed_reserve_is_counted_as_a_reserve_error(prefix: str) -> None:
    """A reserve the store refuses is one store error under op=reserve, and is timed."""
    store = ReserveDown.from_url(REDIS_URL)
    registry = CollectorRegistry()
    core = make_core(store, CountingUpstream(), prefix, registry=registry)
    await core.process(one_message())
    assert registry.get_sample_value("relay_store_errors_total", {"op": "reserve"}) == 1.0
    reserve_s = registry.get_sample_value("relay_store_seconds_sum", {"op": "reserve"})
    assert reserve_s is not None and 0.0 < reserve_s < 1.0  # timed too
    await store.close()


async def test_relaying_again_a_message_in_doubt_is_logged(
        prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    """Under unknown_policy = send, the retry of a message in doubt is relayed with a WARNING
    that it may be a duplicate, naming its queue id and store key."""
    store = RedisStore.from_url(REDIS_URL)
    core = DedupCore(store=store, upstream=CountingUpstream(),
                     metrics=PrometheusMetrics(registry=CollectorRegistry()),
                     policy=Policy(key_prefix=prefix, unknown="send"))
    [key] = recipient_keys(["user@example.net"], "welcome", "K-1", core.policy, None).values()
    await store.reserve([key], token="earlier", lease_s=30)
    await store.settle([SettleOp(key, Settle.UNKNOWN)], token="earlier", window_s=3600)
    with caplog.at_level(logging.INFO, logger="relay.core.dedup"):
        assert (await core.process(one_message())).reply.code == 250
    [record] = [r for r in caplog.records if r.getMessage().startswith(
        "relaying again although an earlier attempt is in doubt")]
    assert record.levelno == logging.WARNING
    assert (record.queue_id, record.key) == ("q1", key)  # type: ignore[attr-defined]
    await store.close()


class ScriptedUpstream(CountingUpstream):
    """Accepts everything except the recipients in ``results``, which get the given result."""

    def __init__(self, results: dict[str, RcptResult]) -> None:
        super().__init__()
        self.results = results

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        accepted = await super().deliver(message, progress)
        return DeliveryResult(recipients={
            r: self.results.get(r, accepted.recipients[r]) for r in message.rcpt_tos})


async def test_an_upstream_500_for_a_recipient_is_a_permanent_refusal(prefix: str) -> None:
    """An upstream 500 (the lowest 5yz) for the only recipient is refused_perm, answered 5yz."""
    store = RedisStore.from_url(REDIS_URL)
    refused = RcptResult(RcptStatus.REFUSED, SmtpReply(500, "5.5.2", "Syntax error"))
    core = make_core(store, ScriptedUpstream({"user@example.net": refused}), prefix)
    decision = await core.process(one_message())
    assert decision.outcomes == {"user@example.net": "refused_perm"}
    assert decision.reply.code == 500
    await store.close()


async def test_the_worst_temporary_outcome_decides_the_reply(prefix: str) -> None:
    """One recipient in flight elsewhere (450) and one the upstream left in doubt (451): the
    reply is the in-doubt one (worst first)."""
    store = RedisStore.from_url(REDIS_URL)
    unknown = RcptResult(RcptStatus.UNKNOWN, replies.OUTCOME_UNKNOWN, from_upstream=False)
    core = make_core(store, ScriptedUpstream({"b@example.net": unknown}), prefix)
    [busy] = recipient_keys(["a@example.net"], "welcome", "K-1", core.policy, None).values()
    await store.reserve([busy], token="another attempt", lease_s=30)
    msg = InboundMessage(mail_from="app@example.com", queue_id="q1", content=message(),
                         rcpt_tos=["a@example.net", "b@example.net"])
    decision = await core.process(msg)
    assert decision.outcomes == {"a@example.net": "inflight", "b@example.net": "unknown"}
    assert decision.reply == replies.OUTCOME_UNKNOWN
    await store.close()


async def test_a_suppressed_message_names_the_earliest_original_send(prefix: str) -> None:
    """Two recipients sent 1.1 s apart, then a duplicate: the 250 names the earlier time."""
    store = RedisStore.from_url(REDIS_URL)
    core = make_core(store, CountingUpstream(), prefix)
    keys = recipient_keys(["a@example.net", "b@example.net"], "welcome", "K-1", core.policy, None)
    for key in keys.values():
        await store.reserve([key], token="t", lease_s=30)
        await store.settle([SettleOp(key, Settle.SENT, "250 ok")], token="t", window_s=3600)
        await asyncio.sleep(1.1)
    first = await store.inspect(keys["a@example.net"])
    assert first.at is not None
    msg = InboundMessage(mail_from="app@example.com", queue_id="q1", content=message(),
                         rcpt_tos=["b@example.net", "a@example.net"])
    decision = await core.process(msg)
    assert decision.reply == replies.all_suppressed(2, _iso(first.at), "q1")
    await store.close()
