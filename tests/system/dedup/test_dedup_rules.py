"""Dedup rules that a wrong relay could otherwise get past the suite.

Each test pins the reply a client reads, not only what reached upstream: a copy of a message in
flight is told to retry, a retry of an in-doubt message is told it is in doubt, and records
another application wrote (a plain ``1``) mix with the relay's own. Real relay, real Redis, real
aiosmtpd sink, smtplib clients.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from datetime import UTC, datetime

import redis.asyncio as aredis

from relay.app import Relay
from relay.core import replies
from relay.core.interfaces import State
from tests.support.clients import message, send
from tests.support.relays import MakeRelay
from tests.support.sink import Sink
from tests.support.wire import key_of

A, B = "a@example.net", "b@example.net"


async def wait_for_transactions(sink: Sink, count: int, timeout_s: float = 10.0) -> None:
    """Wait until the sink has seen ``count`` MAIL commands."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while sink.handler.transactions < count:
        assert asyncio.get_running_loop().time() < deadline, "the sink saw no transaction"
        await asyncio.sleep(0.02)


def recipients(relay: Relay, outcome: str) -> float | None:
    """The relay's ``relay_recipients_total{outcome}`` counter."""
    return relay.registry.get_sample_value("relay_recipients_total", {"outcome": outcome})


# -- item 18: a copy that arrives while the first attempt is in flight ---------------------------


async def test_copy_while_the_first_is_in_flight_is_450_and_sent_after_the_first_fails(
        make_relay: MakeRelay, sink: Sink) -> None:
    """Without a wait (``in_flight_wait = 0``), a copy sent while the first attempt waits on
    upstream is answered 450 4.2.0 (retry), never 250: the first then fails with 451 and the
    copy's retry is the one relayed."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", in_flight_wait=0)
    sink.handler.delay_s = 1.5
    sink.handler.data_plan = deque(["451 4.3.0 try later"])
    first = asyncio.create_task(send(relay.port, [A], message()))
    await wait_for_transactions(sink, 1)
    copy = await send(relay.port, [A], message())
    assert (copy.code, copy.text) == (replies.INFLIGHT.code, replies.INFLIGHT.text)
    assert recipients(relay, "inflight") == 1.0
    assert (await first).code == 451
    sink.handler.delay_s = 0.0
    retry = await send(relay.port, [A], message())
    assert retry.code == 250 and "relayed 1" in retry.text
    assert sink.handler.copies_to(A) == 1


async def test_inflight_recipient_makes_the_whole_message_450_though_another_is_new(
        make_relay: MakeRelay, sink: Sink) -> None:
    """Without a wait, a message with one recipient in flight and one new gets 450 4.2.0, not
    250 (the new one goes upstream, and the retry then sends nothing twice)."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", in_flight_wait=0)
    sink.handler.delay_s = 1.0
    first = asyncio.create_task(send(relay.port, [A], message()))
    await wait_for_transactions(sink, 1)
    mixed = await send(relay.port, [A, B], message())
    assert (mixed.code, mixed.text) == (replies.INFLIGHT.code, replies.INFLIGHT.text)
    assert (await first).code == 250
    sink.handler.delay_s = 0.0
    retry = await send(relay.port, [A, B], message())
    assert retry.code == 250 and "duplicate suppressed for 2 recipient(s)" in retry.text
    assert (sink.handler.copies_to(A), sink.handler.copies_to(B)) == (1, 1)


# -- item 19: a retry of an in-doubt message ------------------------------------------------------


IN_DOUBT_ALL = re.compile(r"2\.0\.0 Ok: duplicate suppressed for 1 recipient\(s\); 1 in doubt "
                          r"since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ; id=\S+")


async def in_doubt_relay(make_relay: MakeRelay, sink: Sink) -> Relay:
    """A relay whose first message to A got no reply to its final dot (held in doubt)."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_timeout=0.5)
    sink.handler.hang_after_dot_s = 1.5
    first = await send(relay.port, [A], message())
    assert (first.code, first.text) == (replies.OUTCOME_UNKNOWN.code, replies.OUTCOME_UNKNOWN.text)
    sink.handler.hang_after_dot_s = 0.0
    return relay


async def test_retry_of_an_in_doubt_message_is_told_it_is_in_doubt(
        make_relay: MakeRelay, sink: Sink) -> None:
    """The suppressed retry of an in-doubt message says "in doubt since", never "original
    sent", and is counted suppressed_unknown, not suppressed."""
    relay = await in_doubt_relay(make_relay, sink)
    retry = await send(relay.port, [A], message())
    assert retry.code == 250 and IN_DOUBT_ALL.fullmatch(retry.text), retry.text
    assert "original sent" not in retry.text
    assert recipients(relay, "suppressed_unknown") == 1.0
    assert not recipients(relay, "suppressed")
    assert relay.registry.get_sample_value(
        "relay_messages_total", {"result": "suppressed"}) == 1.0


async def test_in_doubt_recipient_beside_a_new_one_is_named_in_the_250(
        make_relay: MakeRelay, sink: Sink) -> None:
    """In doubt for A, new for B: 250 "relayed 1, suppressed 1 duplicate(s) (1 in doubt)"."""
    relay = await in_doubt_relay(make_relay, sink)
    result = await send(relay.port, [A, B], message())
    assert result.code == 250
    assert "relayed 1, suppressed 1 duplicate(s) (1 in doubt)" in result.text
    assert recipients(relay, "suppressed_unknown") == 1.0
    assert recipients(relay, "relayed") == 1.0


# -- item 20: records another application wrote ----------------------------------------------------


async def write_foreign_record(relay: Relay, rcpt: str) -> None:
    """Store the plain value ``1`` for ``rcpt``'s fingerprint, as the seed Go mailer does."""
    client = aredis.Redis.from_url(relay.settings.store)
    try:
        await client.set(key_of(relay, rcpt, "welcome", "K-1"), "1", ex=600)
    finally:
        await client.aclose()


async def test_foreign_and_own_records_together_give_the_relays_sent_time(
        relay: Relay, sink: Sink) -> None:
    """A foreign ``1`` for B and the relay's own SENT for A: 250 all suppressed, and the text's
    "original sent" is A's send time (the foreign record has none); nothing goes upstream."""
    assert (await send(relay.port, [A], message())).code == 250
    assert relay.store is not None
    own = await relay.store.inspect(key_of(relay, A, "welcome", "K-1"))
    assert own.state is State.SENT and own.at is not None
    await write_foreign_record(relay, B)
    for rcpts in ([A, B], [B, A]):
        result = await send(relay.port, rcpts, message())
        when = datetime.fromtimestamp(own.at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        assert result.code == 250, result
        assert f"duplicate suppressed for 2 recipient(s); original sent {when};" in result.text
    assert len(sink.handler.delivered) == 1


async def test_foreign_record_alone_is_suppressed_without_a_time(
        relay: Relay, sink: Sink) -> None:
    """Only a foreign ``1`` for the recipient: 250 suppressed, no "original sent" time."""
    await write_foreign_record(relay, B)
    result = await send(relay.port, [B], message())
    assert result.code == 250
    assert re.fullmatch(r"2\.0\.0 Ok: duplicate suppressed for 1 recipient\(s\); id=\S+",
                        result.text), result.text
    assert sink.handler.delivered == []


async def test_foreign_record_beside_a_new_recipient_relays_the_new_one(
        relay: Relay, sink: Sink) -> None:
    """A foreign ``1`` for B, nothing for A: A is relayed, B suppressed, the reply counts both."""
    await write_foreign_record(relay, B)
    result = await send(relay.port, [A, B], message())
    assert result.code == 250 and "relayed 1, suppressed 1 duplicate(s);" in result.text
    assert [d.rcpt_tos for d in sink.handler.delivered] == [[A]]
    assert relay.store is not None
    assert (await relay.store.inspect(key_of(relay, B, "welcome", "K-1"))).state is State.SENT
