"""Smoke test of the benchmark's parts that need no Postfix: bench/load.py's keyed load with the
50 % duplicate mix through bench/naive_relay.py (in this process) to the test sink, on the
shared Redis under a random prefix. The benchmark itself (bench/run.py) is not run here."""

from __future__ import annotations

import asyncio
import ssl
import uuid

import pytest
import redis.asyncio as aioredis
import trustme
from aiosmtpd.smtp import SMTP

from bench.load import DUP_DISTANCE, Login, run_load
from bench.naive_relay import Dictionary, Handler, Pool
from tests.support.relays import REDIS_URL, delete_prefix
from tests.support.sink import start_sink

pytestmark = pytest.mark.slow  # a few hundred SMTP sessions: about a second


async def test_keyed_load_through_the_naive_relay_drops_the_duplicates() -> None:
    sink = await start_sink()
    prefix = f"benchsmoke:{uuid.uuid4().hex}:"
    store = aioredis.Redis.from_url(REDIS_URL)
    handler = Handler(store, prefix, Pool("127.0.0.1", sink.port, 5))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: SMTP(handler, hostname="naive.test"),
                                      "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    messages = 200
    try:
        unique = await run_load("127.0.0.1", port, messages=40, sessions=5, rcpts=2,
                                reuse=False, prefix=f"u{uuid.uuid4().hex}.")
        mixed = await run_load("127.0.0.1", port, messages=messages, sessions=10, rcpts=1,
                               reuse=True, prefix=f"d{uuid.uuid4().hex}.", duplicate_every=2)
    finally:
        server.close()
        await server.wait_closed()
        sink.server.close()
        await store.aclose()
        delete_prefix(REDIS_URL, prefix)
    assert (unique.accepted, unique.sent) == (40, 40)
    assert (mixed.accepted, mixed.sent) == (messages, messages)
    assert len(mixed.latencies_s) == messages and mixed.wall_s > 0
    duplicates = len(range(DUP_DISTANCE, messages, 2)) if DUP_DISTANCE % 2 else 0
    # every message of the unique load reached the sink with both recipients; of the mix, all
    # but the duplicates (each repeats a key answered 41 messages earlier)
    assert sum(len(d.rcpt_tos) for d in sink.handler.delivered) == 80 + messages - duplicates


async def test_the_login_load_starttls_and_auth_plain_through_the_naive_relay() -> None:
    """The login scenario's parts: every connection STARTTLS and AUTH PLAIN (bench/load.py)
    against the naive relay's TLS and dictionary; a wrong password is refused, not relayed."""
    sink = await start_sink()
    prefix = f"benchsmoke:{uuid.uuid4().hex}:"
    store = aioredis.Redis.from_url(REDIS_URL)
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)
    client_tls = ssl.create_default_context()
    ca.configure_trust(client_tls)
    handler = Handler(store, prefix, Pool("127.0.0.1", sink.port, 5))
    server = await asyncio.get_running_loop().create_server(
        lambda: SMTP(handler, hostname="naive.test", tls_context=server_tls,
                     authenticator=Dictionary({"app@bench": "pw-1"}), auth_require_tls=True),
        "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        good = await run_load("127.0.0.1", port, messages=20, sessions=4, rcpts=1, reuse=False,
                              prefix=f"l{uuid.uuid4().hex}.",
                              login=Login(client_tls, "app@bench", "pw-1"))
        bad = await run_load("127.0.0.1", port, messages=4, sessions=2, rcpts=1, reuse=False,
                             prefix=f"b{uuid.uuid4().hex}.",
                             login=Login(client_tls, "app@bench", "wrong"))
    finally:
        server.close()
        await server.wait_closed()
        sink.server.close()
        await store.aclose()
        delete_prefix(REDIS_URL, prefix)
    assert (good.accepted, good.sent) == (20, 20)
    assert bad.accepted == 0 and bad.perm_failed == 4
    assert len(sink.handler.delivered) == 20
