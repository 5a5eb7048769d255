"""Per-template policy, shadow mode and the duplicate reply on a real relay (design.md §4.6):
a real Redis, a real aiosmtpd sink upstream, smtplib clients. The relay reads its
``[[template_policy]]`` tables as the config file gives them (``template_policy``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from relay.app import Relay
from relay.settings import TemplatePolicy
from tests.support.clients import message, send
from tests.support.metrics import scrape
from tests.support.relays import REDIS_URL, MakeRelay, start_serve
from tests.support.sink import Sink
from tests.support.waiting import until

A, B = "a@example.net", "b@example.net"


def policies(*entries: dict[str, Any]) -> tuple[TemplatePolicy, ...]:
    return tuple(TemplatePolicy(**entry) for entry in entries)


def counted(relay: Relay, outcome: str) -> float:
    """``relay_recipients_total{outcome}`` of the in-process relay."""
    value = relay.registry.get_sample_value("relay_recipients_total", {"outcome": outcome})
    return value or 0.0


async def send_all(relay: Relay, rcpts: Sequence[str], data: bytes, times: int) -> list[int]:
    return [(await send(relay.port, rcpts, data)).code for _ in range(times)]


async def test_an_exempt_template_is_delivered_every_time(
        make_relay: MakeRelay, sink: Sink) -> None:
    """dedup = false: three sends with one dedupe key are three copies, counted exempt; a
    template the entry does not match is still deduplicated."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", template_policy=policies(
        {"match": "otp-*", "dedup": False}))
    assert await send_all(relay, [A], message(key="K-1", template="otp-login"), 3) == [250] * 3
    assert sink.handler.copies_to(A) == 3
    assert counted(relay, "exempt") == 3
    assert await send_all(relay, [B], message(key="K-1", template="welcome"), 2) == [250] * 2
    assert sink.handler.copies_to(B) == 1
    assert counted(relay, "suppressed") == 1


async def test_an_exempt_template_needs_no_key_even_where_keys_are_required(
        make_relay: MakeRelay, sink: Sink) -> None:
    """missing_key = reject for the relay, an exempt template without a key is relayed; another
    template without a key is refused 554 5.6.0."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", missing_key="reject",
                             template_policy=policies({"match": "otp-*", "dedup": False}))
    assert (await send(relay.port, [A], message(key=None, template="otp-x"))).code == 250
    refused = await send(relay.port, [B], message(key=None, template="welcome"))
    assert refused.code == 554 and "5.6.0" in refused.text


async def test_a_template_with_its_own_window_expires_on_it(
        make_relay: MakeRelay, sink: Sink) -> None:
    """A 2 s window for reset-*, the relay's 3600 s for the rest: after 2.5 s the reset copy is
    relayed again, the welcome copy is still suppressed. The record's TTL is the template's."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", lease=1.5, store_timeout=0.5,
                             template_policy=policies({"match": "reset-*", "dedup_window": 2}))
    reset, welcome = message(template="reset-pw"), message(template="welcome")
    assert await send_all(relay, [A], reset, 2) == [250, 250]
    assert await send_all(relay, [B], welcome, 2) == [250, 250]
    assert (sink.handler.copies_to(A), sink.handler.copies_to(B)) == (1, 1)
    client = aredis.Redis.from_url(REDIS_URL)
    try:
        ttls = {int(await client.pttl(key)) async for key in
                client.scan_iter(match=relay.settings.store_prefix + "*")}
    finally:
        await client.aclose()
    assert len(ttls) == 2 and min(ttls) <= 2000 and max(ttls) > 3_000_000, ttls
    await asyncio.sleep(2.5)
    assert await send_all(relay, [A], reset, 1) == [250]
    assert await send_all(relay, [B], welcome, 1) == [250]
    assert (sink.handler.copies_to(A), sink.handler.copies_to(B)) == (2, 1)


async def test_shadow_mode_delivers_a_duplicate_and_counts_it(
        make_relay: MakeRelay, sink: Sink) -> None:
    """mode = shadow: the copy goes upstream, counted would_suppress (not suppressed, not
    relayed); the first send's SENT record stays as enforce leaves it, so switching to enforce
    suppresses the next copy."""
    prefix = "test:shadow:" + str(time.monotonic_ns()) + ":"
    shadow = await make_relay(upstream=f"127.0.0.1:{sink.port}", mode="shadow",
                              store_prefix=prefix)
    assert await send_all(shadow, [A, B], message(), 2) == [250, 250]
    assert (sink.handler.copies_to(A), sink.handler.copies_to(B)) == (2, 2)
    assert counted(shadow, "relayed") == 2
    assert counted(shadow, "would_suppress") == 2
    assert counted(shadow, "suppressed") == 0
    enforce = await make_relay(upstream=f"127.0.0.1:{sink.port}", store_prefix=prefix)
    assert await send_all(enforce, [A, B], message(), 1) == [250]
    assert (sink.handler.copies_to(A), sink.handler.copies_to(B)) == (2, 2)
    assert counted(enforce, "suppressed") == 2


async def test_shadow_mode_of_one_template_leaves_the_others_enforced(
        make_relay: MakeRelay, sink: Sink) -> None:
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", template_policy=policies(
        {"match": "news*", "mode": "shadow"}))
    assert await send_all(relay, [A], message(template="newsletter"), 2) == [250, 250]
    assert await send_all(relay, [B], message(template="welcome"), 2) == [250, 250]
    assert (sink.handler.copies_to(A), sink.handler.copies_to(B)) == (2, 1)
    assert (counted(relay, "would_suppress"), counted(relay, "suppressed")) == (1, 1)


async def test_shadow_mode_tells_a_copy_in_flight_to_wait_as_enforce_does(
        make_relay: MakeRelay, sink: Sink) -> None:
    """Without a wait, a copy sent while the first is still at the upstream: 450 (in flight)
    in shadow mode too, nothing relayed for it (unreserved, it would leave no record if the
    first then failed); its retry after the first settled is a shadow copy, relayed and
    counted."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", mode="shadow",
                             in_flight_wait=0)
    sink.handler.delay_s = 1.0
    first = asyncio.create_task(send(relay.port, [A], message()))
    await until(lambda: sink.handler.transactions >= 1)
    copy = await send(relay.port, [A], message())
    assert copy.code == 450 and (await first).code == 250
    assert sink.handler.copies_to(A) == 1
    sink.handler.delay_s = 0.0
    assert (await send(relay.port, [A], message())).code == 250
    assert sink.handler.copies_to(A) == 2
    assert (counted(relay, "inflight"), counted(relay, "would_suppress")) == (1, 1)


async def test_duplicate_reply_550_tells_the_caller(make_relay: MakeRelay, sink: Sink) -> None:
    """duplicate_reply = "550" for receipt-*: a message whose every recipient is a duplicate is
    550 5.7.1; one with a new recipient too is 250 (that one was relayed); another template's
    duplicate is 250 as before."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", template_policy=policies(
        {"match": "receipt-*", "duplicate_reply": "550"}))
    receipt = message(template="receipt-order")
    assert (await send(relay.port, [A], receipt)).code == 250
    copy = await send(relay.port, [A], receipt)
    assert copy.code == 550 and copy.text.startswith("5.7.1 Duplicate not sent again"), copy
    mixed = await send(relay.port, [A, B], receipt)
    assert mixed.code == 250 and "relayed 1, suppressed 1" in mixed.text
    welcome = message(template="welcome")
    assert await send_all(relay, [A], welcome, 2) == [250, 250]
    assert sink.handler.copies_to(A) == 2 and sink.handler.copies_to(B) == 1


async def test_the_global_duplicate_reply_applies_without_entries(
        make_relay: MakeRelay, sink: Sink) -> None:
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", duplicate_reply="550")
    assert await send_all(relay, [A], message(), 2) == [250, 550]


async def test_unknown_policy_per_template(make_relay: MakeRelay, sink: Sink) -> None:
    """An in-doubt record (the upstream hung after the final dot): hold (451) for invoice-*,
    suppress (250, not relayed) for the rest."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_timeout=0.5,
                             template_policy=policies(
                                 {"match": "invoice-*", "unknown_policy": "hold"}))
    sink.handler.delay_s = 1.5  # longer than upstream_timeout: the outcome is unknown
    invoice, welcome = message(template="invoice-1"), message(template="welcome")
    assert (await send(relay.port, [A], invoice)).code == 451
    assert (await send(relay.port, [B], welcome)).code == 451
    sink.handler.delay_s = 0.0
    held = await send(relay.port, [A], invoice)
    assert held.code == 451 and "in doubt" in held.text.lower(), held
    assert (await send(relay.port, [B], welcome)).code == 250
    assert counted(relay, "held") == 1 and counted(relay, "suppressed_unknown") == 1


async def test_a_real_process_counts_would_suppress_on_metrics(
        tmp_path: Path, sink: Sink) -> None:
    """`serve --config` with mode = "shadow" and [[template_policy]] tables, 2 workers: the
    duplicate is delivered and /metrics shows would_suppress and exempt."""
    config = tmp_path / "relay.toml"
    config.write_text(
        f'upstream = "127.0.0.1:{sink.port}"\nstore = "{REDIS_URL}"\n'
        f'store_prefix = "test:proc:{time.monotonic_ns()}:"\nmode = "shadow"\n'
        'metrics_listen = "127.0.0.1:0"\n'
        '[[template_policy]]\nmatch = "otp-*"\ndedup = false\n')
    served = await start_serve(tmp_path, "--config", str(config))
    try:
        for template in ("welcome", "welcome", "otp-1", "otp-1"):
            assert (await send(served.port, [A], message(template=template))).code == 250
        assert sink.handler.copies_to(A) == 4
        assert any(str(e.get("message", "")).startswith("shadow mode for all templates")
                   for e in served.lines())
        assert served.metrics_port is not None
        samples = await asyncio.to_thread(scrape, served.metrics_port)
        outcomes = {labels["outcome"]: value
                    for labels, value in samples["relay_recipients_total"]}
        assert (outcomes["relayed"], outcomes["would_suppress"], outcomes["exempt"]) == (
            1, 1, 2)
    finally:
        served.stop()
