"""The audit ledger's database stopped and started again under a relay: relaying
goes on while it is stopped (``/readyz`` stays 200 and its body says the ledger is down), the
rows wait in the relay's queue, and they land, each once, when the database returns. With
``ledger_required`` the relay answers 451 4.3.0 while the database is stopped and relays again
after. Rows still queued when the relay stops with the ledger down are counted dropped
(``reason="shutdown"``).

A private PostgreSQL server (tests/support/private_postgres.py), stopped with ``pg_ctl stop
-m immediate`` as a crash would; the store is the shared Redis.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import asyncpg
import pytest

from tests.support.clients import message, send
from tests.support.metrics import readyz, sample
from tests.support.postgres import upgrade_ledger
from tests.support.private_postgres import PrivatePostgres
from tests.support.relays import MakeRelay
from tests.support.sink import Sink


@pytest.fixture
def server() -> Iterator[PrivatePostgres]:
    """A started private PostgreSQL with the ledger's table; closed whatever happened."""
    pg = PrivatePostgres(schema=False)
    try:
        pg.start()
        asyncio.run(upgrade_ledger(pg.url))
        yield pg
    finally:
        pg.close()


async def count_rows(url: str) -> int:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        value = await conn.fetchval("SELECT count(*) FROM dedup_relay_ledger")
    finally:
        await conn.close()
    return int(value)


async def until(check: Callable[[], bool], timeout_s: float) -> None:
    """Return once ``check()`` is true, or after ``timeout_s`` seconds (the caller asserts)."""
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:  # noqa: ASYNC110  # polled state
        await asyncio.sleep(0.05)


async def wait_count(url: str, want: int, timeout_s: float = 15.0) -> int:
    """The ledger's row count once it reached ``want`` (or what it was past ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await count_rows(url)
        if got >= want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.1)


async def test_relaying_goes_on_while_the_ledger_is_stopped_and_the_rows_land_after(
        make_relay: MakeRelay, sink: Sink, server: PrivatePostgres) -> None:
    """3 messages with the ledger up, 5 while it is stopped (all 250, all delivered, /readyz
    200 naming the ledger down), then it starts again: all 8 rows land, none twice, and the
    ledger reads up again."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=server.url,
                             metrics_listen="127.0.0.1:0", health_interval=0.2)
    for i in range(3):
        assert (await send(relay.port, [f"a{i}@example.net"], message(key=f"a{i}"))).code == 250
    assert await wait_count(server.url, 3) == 3
    await asyncio.to_thread(server.stop, "immediate")
    codes = [(await send(relay.port, [f"b{i}@example.net"], message(key=f"b{i}"))).code
             for i in range(5)]
    assert codes == [250] * 5
    assert len(sink.handler.delivered) == 8
    assert relay.ledger is not None
    ledger = relay.ledger
    await until(lambda: ledger.report()["state"] == "down", 10)
    status, body = await asyncio.to_thread(readyz, relay.metrics_port)
    assert status == 200, body
    assert body["ledger"]["state"] == "down" and body["ledger"]["required"] is False, body
    assert body["components"]["ledger"]["ok"] is False, body["components"]
    await asyncio.to_thread(server.start)
    assert await wait_count(server.url, 8) == 8
    await asyncio.sleep(0.5)
    assert await count_rows(server.url) == 8  # a batch retried after the outage: no copy
    assert relay.ledger.report()["state"] == "up"
    assert sample(relay.registry, "relay_ledger_dropped_total", reason="full") == 0
    assert sample(relay.registry, "relay_ledger_rows_total") == 8


async def test_a_required_ledger_refuses_while_stopped_and_relays_after(
        make_relay: MakeRelay, sink: Sink, server: PrivatePostgres) -> None:
    """ledger_required: once the relay knows the ledger is down (its probe), messages get
    451 4.3.0 and nothing is relayed; /readyz is 503; after the restart they relay again."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=server.url,
                             ledger_required=True, metrics_listen="127.0.0.1:0",
                             health_interval=0.2)
    assert (await send(relay.port, ["a@example.net"], message(key="a"))).code == 250
    await asyncio.to_thread(server.stop, "immediate")
    assert relay.ledger is not None
    ledger = relay.ledger
    await until(lambda: not ledger.admits(), 10)
    refused = await send(relay.port, ["b@example.net"], message(key="b"))
    assert refused.code == 451 and "4.3.0" in refused.text, refused
    assert sink.handler.copies_to("b@example.net") == 0
    status, body = await asyncio.to_thread(readyz, relay.metrics_port)
    assert status == 503 and body["ledger"]["required"] is True, body
    await asyncio.to_thread(server.start)
    await until(ledger.admits, 15)
    assert (await send(relay.port, ["b@example.net"], message(key="b"))).code == 250
    assert sink.handler.copies_to("b@example.net") == 1


async def test_rows_queued_when_the_relay_stops_with_the_ledger_down_are_counted(
        make_relay: MakeRelay, sink: Sink, server: PrivatePostgres) -> None:
    """The ledger stopped, two messages relayed, the relay stopped: their rows are counted
    dropped (shutdown) after the bounded flush, and the relay stops."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=server.url)
    await asyncio.to_thread(server.stop, "immediate")
    for i in range(2):
        assert (await send(relay.port, [f"c{i}@example.net"], message(key=f"c{i}"))).code == 250
    assert relay.ledger is not None
    started = time.monotonic()
    await relay.ledger.close(flush_s=0.5)
    assert time.monotonic() - started < 5
    assert sample(relay.registry, "relay_ledger_dropped_total", reason="shutdown") == 2
