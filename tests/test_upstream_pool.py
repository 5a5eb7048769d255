"""The upstream connection pool (DESIGN section 5): reuse with RSET, reconnect on error.

A real aiosmtpd sink records which relay connection (source port) carried each MAIL and each
QUIT; a real relay with a real Redis store sends through it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiosmtpd.smtp import SMTP, Envelope, Session
from conftest import MakeRelay, Sink, SinkHandler, message, send

from relay.app import Relay


@dataclass
class PoolSinkHandler(SinkHandler):
    """Records the relay-side (host, port) of every MAIL and RSET, and the QUITs."""

    mail_peers: list[Any] = field(default_factory=list)
    rsets: int = 0
    quits: int = 0

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        self.mail_peers.append(session.peer)
        return await super().handle_MAIL(server, session, envelope, address, options)

    async def handle_RSET(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        self.rsets += 1
        return "250 2.0.0 OK"

    async def handle_QUIT(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        self.quits += 1
        return "221 2.0.0 Bye"


ServePool = Callable[..., Awaitable[tuple[Sink, PoolSinkHandler]]]


@pytest.fixture
async def serve_pool_sink() -> AsyncIterator[ServePool]:
    """Factory: a PoolSinkHandler served on 127.0.0.1:0; ``idle_timeout_s`` closes idle sessions."""
    servers: list[asyncio.base_events.Server] = []

    async def serve(idle_timeout_s: float = 300.0) -> tuple[Sink, PoolSinkHandler]:
        handler = PoolSinkHandler()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: SMTP(handler, hostname="sink.test", decode_data=False,
                         enable_SMTPUTF8=True, timeout=idle_timeout_s),
            host="127.0.0.1", port=0)
        servers.append(server)
        return Sink(handler=handler, port=server.sockets[0].getsockname()[1],
                    server=server), handler

    yield serve
    for server in servers:
        server.close()


async def _send_keys(relay: Relay, keys: list[str]) -> list[int]:
    return [(await send(relay.port, ["user@example.net"], message(key=k))).code for k in keys]


async def test_sequential_messages_share_one_connection_with_rset_between(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """Three messages: one upstream connection, RSET before the 2nd and 3rd, three copies."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    assert await _send_keys(relay, ["P-1", "P-2", "P-3"]) == [250, 250, 250]
    assert len(handler.delivered) == 3
    assert len(set(handler.mail_peers)) == 1 and handler.rsets == 2


async def test_a_connection_dropped_while_idle_is_replaced_unseen(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """The smarthost closes idle sessions (timeout): the next message fails its RSET, a new
    connection carries it, the client sees nothing but 250."""
    sink, handler = await serve_pool_sink(idle_timeout_s=0.3)
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    assert await _send_keys(relay, ["D-1"]) == [250]
    await asyncio.sleep(0.8)  # the sink said 421 and closed the pooled connection
    assert await _send_keys(relay, ["D-2"]) == [250]
    assert len(handler.delivered) == 2
    assert len(set(handler.mail_peers)) == 2


async def test_pool_size_zero_opens_a_connection_per_message(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """upstream_pool_size = 0: every transaction has its own connection, ended with QUIT."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_pool_size=0)
    assert await _send_keys(relay, ["Z-1", "Z-2"]) == [250, 250]
    assert len(set(handler.mail_peers)) == 2 and handler.rsets == 0 and handler.quits == 2


async def test_a_connection_is_retired_after_its_message_limit(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """upstream_pool_max_messages = 2: messages 1-2 on one connection, 3 on a new one."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_pool_max_messages=2)
    assert await _send_keys(relay, ["M-1", "M-2", "M-3"]) == [250, 250, 250]
    peers = handler.mail_peers
    assert peers[0] == peers[1] != peers[2]
    assert handler.quits == 1  # the retired one said goodbye


async def test_an_idle_connection_past_pool_idle_is_not_reused(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """upstream_pool_idle: an older idle connection is closed with QUIT, a new one opened."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_pool_idle=0.2)
    assert await _send_keys(relay, ["I-1"]) == [250]
    await asyncio.sleep(0.5)
    assert await _send_keys(relay, ["I-2"]) == [250]
    assert len(set(handler.mail_peers)) == 2 and handler.rsets == 0 and handler.quits == 1


async def test_a_refused_recipient_leaves_no_trace_on_the_reused_connection(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """After a 450 to RCPT the connection is reused; RSET clears the old envelope, so the
    next message carries only its own recipient."""
    sink, handler = await serve_pool_sink()
    handler.rcpt_plan["busy@example.net"] = deque(["450 4.2.1 Mailbox busy"])
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    first = await send(relay.port, ["busy@example.net"], message(key="R-1"))
    assert first.code == 450
    second = await send(relay.port, ["user@example.net"], message(key="R-2"))
    assert second.code == 250
    assert [d.rcpt_tos for d in handler.delivered] == [["user@example.net"]]
    assert len(set(handler.mail_peers)) == 1 and handler.rsets == 1


async def test_a_421_closes_the_connection_instead_of_pooling_it(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """A 421 at the dot means the smarthost is closing: the next message opens a new one."""
    sink, handler = await serve_pool_sink()
    handler.data_plan.append("421 4.3.2 Shutting down")
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    assert await _send_keys(relay, ["C-1", "C-1"]) == [451, 250]
    assert len(set(handler.mail_peers)) == 2 and handler.rsets == 0
    assert len(handler.delivered) == 1


async def test_stopping_the_relay_quits_the_pooled_connections(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """Relay.stop() says QUIT on every idle upstream connection."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    await asyncio.gather(*(send(relay.port, ["user@example.net"], message(key=f"S-{i}"))
                           for i in range(3)))
    assert handler.quits == 0
    await relay.stop()
    assert handler.quits == len(set(handler.mail_peers)) >= 1
