"""Smoke test of the benchmark's parts that need no Postfix: bench/load.py's keyed load with the
50 % duplicate mix, and its STARTTLS + AUTH PLAIN login, through bench/naive_relay.py (in this
process) to the test sink, on the shared Redis under a random prefix. The benchmark itself
(bench/run.py) is not run here."""

from __future__ import annotations

import asyncio
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
import trustme
from aiosmtpd.smtp import SMTP

from bench.load import DUP_DISTANCE, Login, run_load
from bench.naive_relay import Dictionary, Handler, Pool
from tests.support.relays import REDIS_URL, delete_prefix
from tests.support.sink import Sink, start_sink

pytestmark = pytest.mark.slow  # a few hundred SMTP sessions: about a second

StartNaive = Callable[..., Awaitable[tuple[int, Sink]]]


@pytest.fixture
async def naive_relay() -> AsyncIterator[StartNaive]:
    """Factory: ``await naive_relay(**SMTP kwargs)`` starts the naive relay relaying to a new
    sink; its port and the sink. Everything is stopped and its keys deleted at the end."""
    prefix = f"benchsmoke:{uuid.uuid4().hex}:"
    store = aioredis.Redis.from_url(REDIS_URL)
    started: list[tuple[asyncio.Server, Sink]] = []

    async def start(**smtp: Any) -> tuple[int, Sink]:
        sink = await start_sink()
        handler = Handler(store, prefix, Pool("127.0.0.1", sink.port, 5))
        server = await asyncio.get_running_loop().create_server(
            lambda: SMTP(handler, hostname="naive.test", **smtp), "127.0.0.1", 0)
        started.append((server, sink))
        return server.sockets[0].getsockname()[1], sink

    yield start
    for server, sink in started:
        server.close()
        await server.wait_closed()
        sink.server.close()
    await store.aclose()
    delete_prefix(REDIS_URL, prefix)


async def test_keyed_load_through_the_naive_relay_drops_the_duplicates(
        naive_relay: StartNaive) -> None:
    port, sink = await naive_relay()
    messages = 200
    unique = await run_load("127.0.0.1", port, messages=40, sessions=5, rcpts=2,
                            reuse=False, prefix=f"u{uuid.uuid4().hex}.")
    mixed = await run_load("127.0.0.1", port, messages=messages, sessions=10, rcpts=1,
                           reuse=True, prefix=f"d{uuid.uuid4().hex}.", duplicate_every=2)
    assert (unique.accepted, unique.sent) == (40, 40)
    assert (mixed.accepted, mixed.sent) == (messages, messages)
    assert len(mixed.latencies_s) == messages and mixed.wall_s > 0
    duplicates = len(range(DUP_DISTANCE, messages, 2)) if DUP_DISTANCE % 2 else 0
    # every message of the unique load reached the sink with both recipients; of the mix, all
    # but the duplicates (each repeats a key answered 41 messages earlier)
    assert sum(len(d.rcpt_tos) for d in sink.handler.delivered) == 80 + messages - duplicates


async def test_the_login_load_starttls_and_auth_plain_through_the_naive_relay(
        naive_relay: StartNaive) -> None:
    """The login scenario's parts: every connection STARTTLS and AUTH PLAIN (bench/load.py)
    against the naive relay's TLS and dictionary; a wrong password is refused, not relayed."""
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    port, sink = await naive_relay(tls_context=server_tls, auth_require_tls=True,
                                   authenticator=Dictionary({"app@bench": "pw-1"}))
    good = await run_load("127.0.0.1", port, messages=20, sessions=4, rcpts=1, reuse=False,
                          prefix=f"l{uuid.uuid4().hex}.",
                          login=Login(client_tls, "app@bench", "pw-1"))
    bad = await run_load("127.0.0.1", port, messages=4, sessions=2, rcpts=1, reuse=False,
                         prefix=f"b{uuid.uuid4().hex}.",
                         login=Login(client_tls, "app@bench", "wrong"))
    assert (good.accepted, good.sent) == (20, 20)
    assert bad.accepted == 0 and bad.perm_failed == 4
    assert len(sink.handler.delivered) == 20
