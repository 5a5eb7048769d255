"""A relay over a PostgreSQL that stops answering in the middle of a statement (the TCP
connection stays open: a paused VM, a partition that drops packets) answers the client's final
dot ``451 4.3.0`` within about ``store_timeout``, as it does for a PostgreSQL that refuses.

The hanging peer is tests/store/test_postgres_hanging_server.py's :class:`PgProxy` in front of
the shared PostgreSQL, the relay served in the test's loop, in a private schema.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.support.clients import RawClient, message
from tests.support.pg_proxy import PgProxy, pg_proxy
from tests.support.postgres import private_schema
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

RCPT = "user@example.net"


@pytest.fixture
def url() -> Iterator[str]:
    """A private schema holding the store's tables."""
    with private_schema() as url:
        yield url


@pytest.fixture
async def proxy() -> AsyncIterator[PgProxy]:
    """A PgProxy in front of the test server; resumed and closed at the end."""
    async with pg_proxy() as running:
        yield running


async def transaction(port: int, key: str, wait_s: float) -> str:
    """One message with dedupe key ``key`` to ``RCPT``; the reply to its final dot, or
    ``"no reply within N s"``."""
    client = await RawClient.connect(port)
    try:
        await client.cmd("EHLO client.test")
        await client.cmd("MAIL FROM:<app@example.com>")
        await client.cmd(f"RCPT TO:<{RCPT}>")
        await client.cmd("DATA")
        await client.write(message(key=key) + b".\r\n")
        try:
            return await client.reply(wait_s=wait_s)
        except TimeoutError:
            return f"no reply within {wait_s:g} s"
    finally:
        await client.close()


async def test_a_relay_answers_451_within_the_store_timeout_when_postgres_hangs(
        make_relay: MakeRelay, sink: Sink, url: str, proxy: PgProxy) -> None:
    """A relay on PostgreSQL (store_timeout 0.5 s) relays one message; then PostgreSQL keeps
    its connections and stops answering. The next message must get its 451 within a few
    store timeouts (3 s allowed): the client is left waiting instead."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=proxy.url(url),
                             store_timeout=0.5, store_prefix="t:")
    first = await transaction(relay.port, "hang-1", wait_s=10.0)
    assert first.startswith("250"), first
    proxy.hang()
    started = time.monotonic()
    try:
        second = await transaction(relay.port, "hang-2", wait_s=3.0)
    finally:
        proxy.resume()  # what is held drains; the relay stops normally afterwards
    took = time.monotonic() - started
    assert second.startswith("451"), f"{second!r} after {took:.1f} s"
