"""The audit ledger on a real PostgreSQL, behind an in-process relay on Redis and a
real aiosmtpd sink: the rows of a send, a duplicate, a refusal and an in-doubt message; a
ledger that does not answer (relaying goes on and the rows are counted dropped, or with
``ledger_required`` the messages are refused 451 4.3.0); a ledger that comes back (the queued
rows land).

A ledger that is *stopped* and started again under a relay is in
tests/system/ledger/test_ledger_outage.py (a private PostgreSQL server).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from relay.app import Relay
from tests.support.clients import message, send
from tests.support.metrics import readyz, sample
from tests.support.net import free_port
from tests.support.postgres import ledger_rows, private_schema, wait_ledger_rows
from tests.support.relays import REDIS_URL, MakeRelay, start_serve
from tests.support.sink import Sink

A, B, C, D = ("ann.lee@example.net", "bob@example.net", "cy@example.net", "dee@example.net")


async def wait_count(url: str, count: int) -> list[dict[str, Any]]:
    """The ledger's rows once there are ``count`` (exactly that many)."""
    got = await wait_ledger_rows(url, count)
    assert len(got) == count, got
    return got


def metric(relay: Relay, name: str, **labels: str) -> float:
    return sample(relay.registry, name, **labels)


async def test_rows_of_a_send_a_duplicate_a_refusal_and_an_in_doubt_message(
        make_relay: MakeRelay, sink: Sink, ledger_url: str) -> None:
    """Each recipient decision is one row: outcome, the upstream's reply and queue id, the
    masked recipient, the SHA-256 of the key, the template, the Message-ID and the client's
    reply; a duplicate's row has no upstream reply; rows read oldest first."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                             upstream_timeout=0.6)
    sent = message(key="order-1", extra="Message-ID: <m1@app.example>\r\n")
    assert (await send(relay.port, [A], sent)).code == 250
    assert (await send(relay.port, [A], sent)).code == 250  # the duplicate
    sink.handler.rcpt_plan[B] = deque(["550 5.1.1 no such user"])
    refused = await send(relay.port, [B], message(key="order-2"))
    assert refused.rcpt_refused or refused.code >= 500, refused
    sink.handler.hang_after_dot_s = 2.0  # the reply to the final dot comes too late
    doubt = await send(relay.port, [C], message(key="order-3"))
    assert doubt.code == 451, doubt
    sink.handler.hang_after_dot_s = 0.0
    got = await wait_count(ledger_url, 4)
    by_outcome = {row["outcome"]: row for row in got}
    assert [row["outcome"] for row in got] == ["relayed", "suppressed", "refused_perm",
                                               "unknown"]
    first = by_outcome["relayed"]
    assert first["reply"] == "250 2.0.0 Ok: queued as SINK1"
    assert first["upstream_queue_id"] == "SINK1"
    assert first["recipient"] == "a***@example.net"
    assert first["dedupe_key"] == hashlib.sha256(b"order-1").hexdigest()
    assert first["template"] == "welcome"
    assert first["message_id"] == "<m1@app.example>"
    assert first["action"] == "relay"
    assert first["client_reply"].startswith("250 ")
    assert first["upstream"] == f"127.0.0.1:{sink.port}"
    dup = by_outcome["suppressed"]
    assert dup["store_key"] == first["store_key"] and dup["store_key"]
    assert dup["reply"] == "" and dup["upstream_queue_id"] == ""
    assert by_outcome["refused_perm"]["reply"].startswith("550 5.1.1")
    assert by_outcome["unknown"]["reply"] == ""
    assert by_outcome["unknown"]["client_reply"].startswith("451 ")
    deadline = time.monotonic() + 5  # the writer counts a batch once its INSERT returned
    while metric(relay, "relay_ledger_rows_total") < 4 and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)  # a counter, polled
    assert metric(relay, "relay_ledger_rows_total") == 4


async def test_full_recipients_and_plain_keys_when_asked(
        make_relay: MakeRelay, sink: Sink, ledger_url: str) -> None:
    """ledger_recipients = full, ledger_keys = plain: written as the client gave them; a
    message without a key has a row without a store key."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                             ledger_recipients="full", ledger_keys="plain")
    assert (await send(relay.port, [A], message(key="order-9"))).code == 250
    assert (await send(relay.port, [D], message(key=None))).code == 250
    got = await wait_count(ledger_url, 2)
    assert [(r["recipient"], r["dedupe_key"], r["outcome"]) for r in got] == [
        (A, "order-9", "relayed"), (D, None, "no_key")]
    assert got[1]["store_key"] is None


async def test_a_ledger_that_does_not_answer_drops_rows_and_relaying_goes_on(
        make_relay: MakeRelay, sink: Sink) -> None:
    """Nothing listens at the ledger's address: the relay starts, relays every message,
    keeps ledger_queue rows and counts the rest dropped; /readyz's ledger part says down."""
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=dead, ledger_queue=3)
    codes = [(await send(relay.port, [f"u{i}@example.net"], message(key=f"k{i}"))).code
             for i in range(5)]
    assert codes == [250] * 5
    assert sink.handler.copies_to("u4@example.net") == 1
    assert metric(relay, "relay_ledger_dropped_total", reason="full") == 2
    assert relay.ledger is not None and relay.ledger.report()["state"] == "down"
    assert relay.ledger.admits()  # not required: messages keep coming


async def test_a_required_ledger_that_does_not_answer_refuses_messages(
        make_relay: MakeRelay, sink: Sink) -> None:
    """ledger_required = true and the ledger down: 451 4.3.0, nothing relayed or reserved."""
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=dead,
                             ledger_required=True, ledger_queue=2)
    got = await send(relay.port, [A], message(key="k-req"))
    assert got.code == 451 and "4.3.0" in got.text and "ledger" in got.text.lower(), got
    assert sink.handler.delivered == []
    assert metric(relay, "relay_recipients_total", outcome="refused_temp") == 1
    for _ in range(4):  # the client retries: the refusals' rows stay within the bound
        assert (await send(relay.port, [A], message(key="k-req"))).code == 451
    assert relay.ledger is not None and relay.ledger.report()["queued"] == 2
    assert metric(relay, "relay_ledger_dropped_total", reason="full") == 3


async def test_a_required_ledger_that_answers_relays(
        make_relay: MakeRelay, sink: Sink, ledger_url: str) -> None:
    """ledger_required = true with the ledger up: relayed, and its row written."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                             ledger_required=True)
    assert (await send(relay.port, [A], message(key="k-up"))).code == 250
    [row] = await wait_count(ledger_url, 1)
    assert row["outcome"] == "relayed"


async def test_a_relay_refuses_to_start_on_a_missing_ledger_schema(
        make_relay: MakeRelay, sink: Sink) -> None:
    """The ledger's database answers but holds no ledger table: start-up fails naming
    `db upgrade --ledger`."""
    from relay.core.errors import StartupError

    with private_schema(upgraded=False) as empty, \
            pytest.raises(StartupError, match="db upgrade --ledger"):
        await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=empty)


def test_the_ledger_setting_takes_only_postgresql() -> None:
    """A ledger URL of another kind is a configuration error naming the setting."""
    from pydantic import ValidationError

    from relay.settings import Settings

    base: dict[str, Any] = {"upstream": "127.0.0.1:25", "settle_journal": ""}
    with pytest.raises(ValidationError, match="ledger must be a postgresql"):
        Settings(**base, ledger="redis://127.0.0.1:6379/0")
    assert Settings(**base, ledger="").ledger is None


async def test_a_serve_process_with_two_workers_writes_every_row_and_flushes_on_sigterm(
        sink: Sink, ledger_url: str, tmp_path: Path) -> None:
    """`serve --workers 2 --ledger URL`: 6 messages over several connections, then SIGTERM
    right after the last reply: all 6 rows are in the ledger once the process exited 0 (written
    by the workers; a row still queued gets the bounded flush at shutdown); /readyz names the
    ledger up, required false."""
    relay = await start_serve(tmp_path, "--store", REDIS_URL, "--store-prefix",
                              f"t:{uuid.uuid4().hex}:", "--upstream", f"127.0.0.1:{sink.port}",
                              "--ledger", ledger_url, "--metrics-listen", "127.0.0.1:0",
                              "--health-interval", "0.2", workers=2)
    try:
        assert relay.metrics_port is not None
        for i in range(6):
            assert (await send(relay.port, [f"w{i}@example.net"], message(key=f"w{i}"))).code \
                == 250
        deadline = time.monotonic() + 10
        while True:  # the supervisor reads the workers' gauges; the rows land in batches
            status, body = await asyncio.to_thread(readyz, relay.metrics_port)
            landed = body.get("ledger", {}).get("queued") == 0
            if ("ledger" in body.get("components", {}) and landed) \
                    or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert status == 200, body
        assert body["ledger"]["state"] == "up" and body["ledger"]["required"] is False, body
        assert body["ledger"]["dropped"] == 0 and body["ledger"]["queued"] == 0, body
    finally:
        code = await asyncio.to_thread(relay.stop)
    assert code == 0
    got = await ledger_rows(ledger_url)
    assert sorted(r["outcome"] for r in got) == ["relayed"] * 6
    assert len({r["instance"] for r in got}) >= 1
