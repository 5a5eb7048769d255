"""A template's own dedup window (design.md §4.6) through a real relay: a short window does not
expire a message still in flight, and ``mark-sent --store-key`` keeps the template's window. A
real Redis (random key prefix), a real aiosmtpd sink upstream, smtplib clients."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from relay.core.keys import recipient_key
from relay.settings import TemplatePolicy
from tests.support.cli import run_cli
from tests.support.clients import message, send
from tests.support.relays import REDIS_URL, MakeRelay
from tests.support.sink import Sink
from tests.support.waiting import until

A = "a@example.net"


def policies(*entries: dict[str, Any]) -> tuple[TemplatePolicy, ...]:
    return tuple(TemplatePolicy(**entry) for entry in entries)


async def test_a_short_template_window_does_not_expire_a_message_still_in_flight(
        make_relay: MakeRelay, sink: Sink) -> None:
    """reset-* has a 2 s window (>= the 1.5 s lease, accepted at load); the upstream takes
    4.5 s to answer the final dot. A copy sent once the window has passed since the SENDING
    mark, while the first attempt is still waiting for its reply, must be told to wait (450:
    in flight), never relayed: the first copy is about to be delivered."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", lease=1.5, store_timeout=0.5,
                             upstream_timeout=8.0, in_flight_wait=0, template_policy=policies(
                                 {"match": "reset-*", "dedup_window": 2}))
    assert relay.core is not None
    key = recipient_key(A, "reset-pw", "K-1", relay.core.policy).key
    reset = message(template="reset-pw")
    sink.handler.delay_s = 4.5  # the reply to the final dot comes 4.5 s after the dot
    first = asyncio.create_task(send(relay.port, [A], reset))
    client = aredis.Redis.from_url(REDIS_URL)
    try:
        async def sending() -> bool:
            value = await client.get(key)
            return isinstance(value, bytes) and value.startswith(b"D|")

        await until(sending, what="the SENDING mark of the first attempt")
    finally:
        await client.aclose()
    await asyncio.sleep(2.5)  # the 2 s window has passed since the mark; the first still waits
    assert not first.done()
    sink.handler.delay_s = 0.0
    copy = await send(relay.port, [A], reset)
    assert (await first).code == 250
    assert copy.code == 450, copy
    assert sink.handler.copies_to(A) == 1


async def test_mark_sent_by_store_key_keeps_the_template_window(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path) -> None:
    """receipt-* has a 600000 s window (the relay's: 3600 s). Its message ends in doubt (the
    upstream does not answer the final dot in time): UNKNOWN for 600000 s. The operator marks
    it sent by the store key of the decision log line: the record must still cover the
    template's window, as mark-sent --template does."""
    entries = ({"match": "receipt-*", "dedup_window": 600000},)
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_timeout=0.5,
                             template_policy=policies(*entries))
    sink.handler.delay_s = 1.0  # no reply to the final dot within upstream_timeout
    assert (await send(relay.port, [A], message(template="receipt-order"))).code == 451
    assert relay.core is not None
    key = recipient_key(A, "receipt-order", "K-1", relay.core.policy).key
    config = tmp_path / "relay.toml"
    config.write_text('[[template_policy]]\nmatch = "receipt-*"\ndedup_window = 600000\n')
    env = {"RELAY_STORE": REDIS_URL, "RELAY_STORE_PREFIX": relay.settings.store_prefix,
           "RELAY_DEDUP_WINDOW": "3600", "RELAY_CONFIG": str(config)}
    seen = await asyncio.to_thread(run_cli, "inspect", "--store-key", key, cwd=tmp_path, env=env)
    before = json.loads(seen.stdout)
    assert before["state"] == "unknown" and before["ttl_s"] > 590_000, before
    done = await asyncio.to_thread(run_cli, "mark-sent", "--store-key", key, "--reason",
                                   "smarthost log: queued", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    after = json.loads((await asyncio.to_thread(
        run_cli, "inspect", "--store-key", key, cwd=tmp_path, env=env)).stdout)
    assert after["state"] == "sent"
    assert after["ttl_s"] > 590_000, after
