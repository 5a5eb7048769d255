"""A copy of a message another attempt holds in flight waits for that attempt's settle
(``in_flight_wait``, design.md §4.8), on a real Redis and a real SQLite file: the other attempt
is a reservation of another token, settled through the store's own settle path."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from relay.core import replies
from relay.core.dedup import Decision, DedupCore, InboundMessage, Policy
from relay.core.interfaces import FingerprintStore, Settle, SettleOp
from relay.core.keys import recipient_keys
from relay.core.rules import UnknownPolicy
from relay.ops.metrics import PrometheusMetrics
from relay.ops.observed import observed_core
from relay.store.redis.store import RedisStore
from relay.store.sqlite.store import SqliteStore
from tests.support.clients import message
from tests.support.dedup_parts import CountingUpstream
from tests.support.relays import REDIS_URL

OTHER = "another-attempt"


@pytest.fixture(params=["redis", "sqlite"])
async def store(request: pytest.FixtureRequest, prefix: str,
                tmp_path: Path) -> AsyncIterator[FingerprintStore]:
    """A real store of each kind that can watch settles."""
    opened: FingerprintStore
    if request.param == "redis":
        opened = RedisStore.from_url(REDIS_URL)
    else:
        opened = await SqliteStore.open(str(tmp_path / "fp.sqlite3"))
    yield opened
    await opened.close()


def core_over(store: FingerprintStore, upstream: CountingUpstream, prefix: str, *,
              wait_s: float = 30.0, unknown: UnknownPolicy = "suppress") -> DedupCore:
    return observed_core(store=store, upstream=upstream,
                         metrics=PrometheusMetrics(registry=CollectorRegistry()),
                         policy=Policy(key_prefix=prefix, in_flight_wait_s=wait_s,
                                       unknown=unknown))[0]


def to(*rcpts: str) -> InboundMessage:
    return InboundMessage(mail_from="app@example.com", rcpt_tos=list(rcpts), content=message(),
                          queue_id="q1")


async def held_by_another(store: FingerprintStore, core: DedupCore, rcpt: str) -> str:
    """Reserve ``rcpt``'s key for another attempt; returns the key."""
    [key] = recipient_keys([rcpt], "welcome", "K-1", core.policy, None).values()
    [reservation] = await store.reserve([key], token=OTHER, lease_s=900.0)
    assert reservation.reserved
    return key


async def waiting(core: DedupCore, msg: InboundMessage) -> asyncio.Task[Decision]:
    """Start ``msg`` and let it reach its wait."""
    task: asyncio.Task[Decision] = asyncio.ensure_future(core.process(msg))
    await asyncio.sleep(0.5)
    assert not task.done()
    return task


async def test_a_copy_waits_and_is_relayed_once_the_other_attempt_releases(
        store: FingerprintStore, prefix: str) -> None:
    """Released by the attempt it waited for: relayed now, answered 250 in this transaction."""
    upstream = CountingUpstream()
    core = core_over(store, upstream, prefix)
    key = await held_by_another(store, core, "user@example.net")
    task = await waiting(core, to("user@example.net"))
    started = time.monotonic()
    await store.settle([SettleOp(key, Settle.RELEASE)], token=OTHER, window_s=3600.0)
    decision = await asyncio.wait_for(task, 10.0)
    assert time.monotonic() - started < 10.0
    assert decision.reply.code == 250
    assert decision.outcomes == {"user@example.net": "relayed"}
    assert len(upstream.sent) == 1


async def test_a_copy_of_a_message_the_other_attempt_sent_gets_the_duplicate_reply(
        store: FingerprintStore, prefix: str) -> None:
    upstream = CountingUpstream()
    core = core_over(store, upstream, prefix)
    key = await held_by_another(store, core, "user@example.net")
    task = await waiting(core, to("user@example.net"))
    await store.settle([SettleOp(key, Settle.SENT, reply="250 ok")], token=OTHER,
                       window_s=3600.0)
    decision = await asyncio.wait_for(task, 10.0)
    assert decision.outcomes == {"user@example.net": "suppressed"}
    assert decision.reply.code == 250
    assert upstream.sent == []


@pytest.mark.parametrize(("unknown", "outcome", "code", "sent"), [
    ("suppress", "suppressed_unknown", 250, 0),
    ("hold", "held", 451, 0),
    ("send", "relayed", 250, 1)])
async def test_a_copy_of_a_message_left_in_doubt_is_answered_as_unknown_policy_says(
        store: FingerprintStore, prefix: str, unknown: UnknownPolicy, outcome: str, code: int,
        sent: int) -> None:
    upstream = CountingUpstream()
    core = core_over(store, upstream, prefix, unknown=unknown)
    key = await held_by_another(store, core, "user@example.net")
    task = await waiting(core, to("user@example.net"))
    await store.settle([SettleOp(key, Settle.UNKNOWN)], token=OTHER, window_s=3600.0)
    decision = await asyncio.wait_for(task, 10.0)
    assert decision.outcomes == {"user@example.net": outcome}
    assert decision.reply.code == code
    assert len(upstream.sent) == sent


async def test_a_copy_still_in_flight_at_the_bound_is_450(store: FingerprintStore,
                                                          prefix: str) -> None:
    upstream = CountingUpstream()
    core = core_over(store, upstream, prefix, wait_s=1.0)
    await held_by_another(store, core, "user@example.net")
    started = time.monotonic()
    decision = await asyncio.wait_for(core.process(to("user@example.net")), 10.0)
    assert decision.reply == replies.INFLIGHT
    assert time.monotonic() - started >= 1.0
    assert upstream.sent == []


async def test_no_wait_answers_450_at_once(store: FingerprintStore, prefix: str) -> None:
    """``in_flight_wait = 0``: 450 as before, without waiting."""
    core = core_over(store, CountingUpstream(), prefix, wait_s=0.0)
    await held_by_another(store, core, "user@example.net")
    started = time.monotonic()
    decision = await core.process(to("user@example.net"))
    assert decision.reply == replies.INFLIGHT
    assert time.monotonic() - started < 5.0


async def test_a_relay_stopping_answers_the_copies_waiting_450_at_once(
        store: FingerprintStore, prefix: str) -> None:
    """A shutdown ends every wait: the copy is answered 450 (4yz), not at the bound."""
    core = core_over(store, CountingUpstream(), prefix, wait_s=60.0)
    await held_by_another(store, core, "user@example.net")
    task = await waiting(core, to("user@example.net"))
    core.stop_waiting()
    decision = await asyncio.wait_for(task, 10.0)
    assert decision.reply == replies.INFLIGHT


async def test_a_new_recipient_is_relayed_while_another_waits_and_both_answered_250(
        store: FingerprintStore, prefix: str) -> None:
    """One envelope: the recipient nobody holds goes upstream at once, the one in flight
    after the release it waited for; one reply for both."""
    upstream = CountingUpstream()
    core = core_over(store, upstream, prefix)
    key = await held_by_another(store, core, "held@example.net")
    task = await waiting(core, to("new@example.net", "held@example.net"))
    assert [m.rcpt_tos for m in upstream.sent] == [["new@example.net"]]
    await store.settle([SettleOp(key, Settle.RELEASE)], token=OTHER, window_s=3600.0)
    decision = await asyncio.wait_for(task, 10.0)
    assert decision.reply.code == 250
    assert decision.outcomes == {
        "new@example.net": "relayed", "held@example.net": "relayed"}
    assert [m.rcpt_tos for m in upstream.sent] == [["new@example.net"], ["held@example.net"]]


async def test_copies_waiting_for_a_released_key_relay_it_once_and_all_get_250(
        store: FingerprintStore, prefix: str) -> None:
    """Three copies wait for a key the other attempt then releases: one of them takes it and
    relays it, the other two wait for that one and are answered as duplicates."""
    upstream = CountingUpstream()
    core = core_over(store, upstream, prefix)
    key = await held_by_another(store, core, "user@example.net")
    tasks = [asyncio.ensure_future(core.process(to("user@example.net"))) for _ in range(3)]
    await asyncio.sleep(0.5)
    await store.settle([SettleOp(key, Settle.RELEASE)], token=OTHER, window_s=3600.0)
    decisions = await asyncio.wait_for(asyncio.gather(*tasks), 15.0)
    assert sorted(d.outcomes["user@example.net"] for d in decisions) == [
        "relayed", "suppressed", "suppressed"]
    assert [d.reply.code for d in decisions] == [250, 250, 250]
    assert len(upstream.sent) == 1
