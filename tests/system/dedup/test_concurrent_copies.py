"""Four SMTP connections sending the same message at once, as a pooled client (nodemailer with
``pool: true``) does, while the smarthost is slow: every copy waits for the first attempt
(``in_flight_wait``, design.md §4.8), one copy is delivered and every client reads 250. Real
relay, real stores (Redis, SQLite, PostgreSQL), real aiosmtpd sink, smtplib clients."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.clients import message, send
from tests.support.postgres import private_schema
from tests.support.relays import REDIS_URL, MakeRelay
from tests.support.sink import Sink
from tests.support.wire import key_of

A = "a@example.net"
CLIENTS = 4


@pytest.fixture(params=["redis", "sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store URL of each kind."""
    if request.param == "redis":
        yield REDIS_URL
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fp.sqlite3'}"
    else:
        with private_schema() as url:
            yield url


async def test_four_pooled_connections_sending_one_message_at_once_all_get_250_and_one_copy(
        make_relay: MakeRelay, sink: Sink, store_url: str) -> None:
    """The first attempt holds the key for the smarthost's 2 s; the three copies wait for it
    and are answered 250 (duplicate) once it is sent: no 450, one copy delivered."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=store_url)
    sink.handler.delay_s = 2.0
    results = await asyncio.gather(*(send(relay.port, [A], message())
                                      for _ in range(CLIENTS)))
    assert [r.code for r in results] == [250] * CLIENTS, [str(r) for r in results]
    assert sink.handler.copies_to(A) == 1
    inflight = relay.registry.get_sample_value("relay_recipients_total", {"outcome": "inflight"})
    assert not inflight


async def test_a_relay_stopping_answers_a_waiting_copy_4yz_within_its_grace(
        make_relay: MakeRelay, sink: Sink) -> None:
    """Another relay holds the key (a reservation of another token) and never settles; the
    copy waits (``in_flight_wait`` 60 s) until this relay stops, and is answered 450 within
    the shutdown grace (5 s), not at the bound."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", in_flight_wait=60.0)
    assert relay.store is not None
    key = key_of(relay, A, "welcome", "K-1")
    [held] = await relay.store.reserve([key], token="another-relay", lease_s=60.0)
    assert held.reserved
    copy = asyncio.ensure_future(send(relay.port, [A], message()))
    await asyncio.sleep(1.0)
    assert not copy.done()
    started = asyncio.get_running_loop().time()
    await relay.stop()
    result = await asyncio.wait_for(copy, 10.0)
    assert 400 <= result.code < 500, result
    assert asyncio.get_running_loop().time() - started < relay.settings.shutdown_grace
    assert sink.handler.copies_to(A) == 0
