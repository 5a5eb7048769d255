"""The upstream connection pool (design.md §5.3): reuse (RSET after a second idle or an
unfinished transaction), reconnect on error, sized for the sessions a worker serves.

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

from relay.app import Relay
from relay.upstream.pool import default_pool_size
from tests.support.clients import message, send
from tests.support.relays import MakeRelay
from tests.support.sink import Sink, SinkHandler


@dataclass
class PoolSinkHandler(SinkHandler):
    """Records the relay-side (host, port) of every MAIL and RSET, the QUITs, and how many
    sessions have ended."""

    mail_peers: list[Any] = field(default_factory=list)
    rsets: int = 0
    quits: int = 0
    ended: int = 0
    gather: int = 0  # hold each DATA until this many transactions are in DATA at once
    _in_data: int = 0
    _gathered: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        if self.gather:
            self._in_data += 1
            if self._in_data % self.gather == 0:
                self._gathered.set()
            await asyncio.wait_for(self._gathered.wait(), 5.0)
            self._in_data -= 1
            if self._in_data == 0:
                self._gathered.clear()
        return await super().handle_DATA(server, session, envelope)

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


class PoolSMTP(SMTP):
    """aiosmtpd's SMTP that counts ended sessions in its PoolSinkHandler."""

    def connection_lost(self, error: Exception | None) -> None:
        super().connection_lost(error)
        if isinstance(self.event_handler, PoolSinkHandler):
            self.event_handler.ended += 1


ServePool = Callable[..., Awaitable[tuple[Sink, PoolSinkHandler]]]


@pytest.fixture
async def serve_pool_sink() -> AsyncIterator[ServePool]:
    """Factory: a PoolSinkHandler served on 127.0.0.1:0; ``idle_timeout_s`` closes idle sessions."""
    servers: list[asyncio.base_events.Server] = []

    async def serve(idle_timeout_s: float = 300.0) -> tuple[Sink, PoolSinkHandler]:
        handler = PoolSinkHandler()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: PoolSMTP(handler, hostname="sink.test", decode_data=False,
                             enable_SMTPUTF8=True, timeout=idle_timeout_s),
            host="127.0.0.1", port=0)
        servers.append(server)
        return Sink(handler=handler, port=server.sockets[0].getsockname()[1],
                    server=server), handler

    yield serve
    for server in servers:
        server.close()


async def eventually(check: Callable[[], bool], within_s: float = 3.0) -> None:
    """Wait until ``check()`` holds (QUITs go out in the background), failing after a while."""
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def _send_keys(relay: Relay, keys: list[str]) -> list[int]:
    return [(await send(relay.port, ["user@example.net"], message(key=k))).code for k in keys]


async def test_sequential_messages_share_one_connection_without_rset(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """Three messages in a row: one upstream connection, no RSET between (each transaction
    ended with its final dot's 250 less than a second before), three copies."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    assert await _send_keys(relay, ["P-1", "P-2", "P-3"]) == [250, 250, 250]
    assert len(handler.delivered) == 3
    assert len(set(handler.mail_peers)) == 1 and handler.rsets == 0


async def test_a_connection_idle_for_a_second_is_probed_with_rset(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """A connection idle for a second or more answers RSET before its next MAIL."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    assert await _send_keys(relay, ["W-1"]) == [250]
    await asyncio.sleep(1.1)
    assert await _send_keys(relay, ["W-2"]) == [250]
    assert len(set(handler.mail_peers)) == 1 and handler.rsets == 1


def test_the_default_pool_holds_a_connection_per_session_a_worker_serves() -> None:
    """max_connections / workers, rounded up, at least 1, at most 32."""
    assert default_pool_size(200, 1) == 32
    assert default_pool_size(200, 8) == 25
    assert default_pool_size(10, 4) == 3
    assert default_pool_size(1, 4) == 1


async def test_an_unset_pool_size_keeps_a_connection_per_concurrent_session(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """upstream_pool_size unset, max_connections 6, one worker: six concurrent transactions
    leave six idle connections, and the next six concurrent ones open none."""
    sink, handler = await serve_pool_sink()
    handler.gather = 6  # each wave's six transactions are in DATA at once
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_connections=6,
                             max_connections_per_ip=6, workers=1)

    async def wave(name: str) -> list[int]:
        replies = await asyncio.gather(*(send(relay.port, ["user@example.net"],
                                              message(key=f"{name}-{i}")) for i in range(6)))
        return [r.code for r in replies]

    assert await wave("A") == [250] * 6
    opened = len(set(handler.mail_peers))
    assert opened == 6
    assert await wave("B") == [250] * 6
    assert len(set(handler.mail_peers)) == opened and handler.quits == 0


async def test_a_connection_dropped_while_idle_is_replaced_unseen(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """The smarthost closes idle sessions (timeout): the next message fails its RSET, a new
    connection carries it, the client sees nothing but 250."""
    sink, handler = await serve_pool_sink(idle_timeout_s=0.3)
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    assert await _send_keys(relay, ["D-1"]) == [250]
    await eventually(lambda: handler.ended == 1)  # the sink said 421 and closed it
    assert await _send_keys(relay, ["D-2"]) == [250]
    assert len(handler.delivered) == 2
    assert len(set(handler.mail_peers)) == 2


async def test_pool_size_zero_opens_a_connection_per_message(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """upstream_pool_size = 0: every transaction has its own connection, ended with QUIT."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_pool_size=0)
    assert await _send_keys(relay, ["Z-1", "Z-2"]) == [250, 250]
    assert len(set(handler.mail_peers)) == 2 and handler.rsets == 0
    await eventually(lambda: handler.quits == 2)


async def test_a_connection_is_retired_after_its_message_limit(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """upstream_pool_max_messages = 2: messages 1-2 on one connection, 3 on a new one."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_pool_max_messages=2)
    assert await _send_keys(relay, ["M-1", "M-2", "M-3"]) == [250, 250, 250]
    peers = handler.mail_peers
    assert peers[0] == peers[1] != peers[2]
    await eventually(lambda: handler.quits == 1)  # the retired one said goodbye


async def test_an_idle_connection_past_pool_idle_is_not_reused(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """upstream_pool_idle: an older idle connection is closed with QUIT, a new one opened."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_pool_idle=0.2)
    assert await _send_keys(relay, ["I-1"]) == [250]
    await asyncio.sleep(0.5)
    assert await _send_keys(relay, ["I-2"]) == [250]
    assert len(set(handler.mail_peers)) == 2 and handler.rsets == 0
    await eventually(lambda: handler.quits == 1)


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


# -- a smarthost that misbehaves on purpose (raw asyncio server: aiosmtpd cannot) ------------


@dataclass
class RawSmarthost:
    """A minimal SMTP server over asyncio streams whose faults the test scripts.

    ``double_first_dot``: the first final dot of each connection gets two 250 replies in one
    write (the second one nobody asked for). ``silent_rset``: RSET gets no reply at all.
    ``gone_at_second_mail``: the second MAIL of each connection finds it ending, as when an
    idle timeout fires just as MAIL arrives: ``"close"`` closes it unanswered, ``"421"``
    answers ``421 4.4.2`` and closes.
    """

    double_first_dot: bool = False
    silent_rset: bool = False
    gone_at_second_mail: str | None = None
    connections: int = 0
    delivered: list[list[str]] = field(default_factory=list)
    port: int = 0
    server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._session, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _session(self, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        state: dict[str, Any] = {"dots": 0, "rcpts": [], "mails": 0}
        writer.write(b"220 raw.test ESMTP\r\n")
        try:
            while line := await reader.readline():
                if line[:4].upper() == b"QUIT":
                    writer.write(b"221 2.0.0 bye\r\n")
                    break
                if line[:4].upper() == b"MAIL":
                    state["mails"] += 1
                    if self.gone_at_second_mail and state["mails"] == 2:
                        if self.gone_at_second_mail == "421":
                            writer.write(b"421 4.4.2 raw.test idle timeout\r\n")
                        break
                writer.write(await self._answer(line, state, reader, writer))
                await writer.drain()
        except (ConnectionError, IndexError):
            pass
        finally:
            writer.close()

    async def _answer(self, line: bytes, state: dict[str, Any], reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bytes:
        verb = line[:4].upper()
        if verb == b"EHLO":
            return b"250-raw.test\r\n250 8BITMIME\r\n"
        if verb == b"RSET":
            state["rcpts"] = []
            return b"" if self.silent_rset else b"250 2.0.0 OK\r\n"
        if verb == b"RCPT":
            address = line.split(b"<", 1)[1].split(b">", 1)[0].decode()
            if address.startswith("bad@"):
                return b"550 5.1.1 " + address.encode() + b": user unknown\r\n"
            state["rcpts"].append(address)
            return b"250 2.1.5 OK\r\n"
        if verb != b"DATA":
            return b"250 2.0.0 OK\r\n"  # MAIL, NOOP
        writer.write(b"354 go ahead\r\n")
        await writer.drain()
        while (await reader.readline()) != b".\r\n":
            pass
        state["dots"] += 1
        self.delivered.append(state["rcpts"])
        state["rcpts"] = []
        if self.double_first_dot and state["dots"] == 1:
            return b"250 2.0.0 queued\r\n250 2.0.0 queued again\r\n"
        return b"250 2.0.0 queued\r\n"

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture
async def raw_smarthost() -> AsyncIterator[RawSmarthost]:
    """A RawSmarthost on 127.0.0.1:0, closed afterwards."""
    host = RawSmarthost()
    await host.start()
    yield host
    host.close()


async def test_an_unasked_reply_keeps_a_connection_out_of_the_pool(
        make_relay: MakeRelay, raw_smarthost: RawSmarthost) -> None:
    """Two replies to one final dot: reused, that connection would pair every later command
    with the previous command's reply (a good recipient bounced with another's 550). It is
    closed instead, and the next message goes on a fresh connection with the right replies."""
    raw_smarthost.double_first_dot = True
    relay = await make_relay(upstream=f"127.0.0.1:{raw_smarthost.port}",
                             dsn_on_partial_failure=False)  # no DSN for bad@ on the pool
    assert await _send_keys(relay, ["U-1"]) == [250]
    second = await send(relay.port, ["good@example.net", "bad@example.net"],
                        message(key="U-2"))
    assert second.code == 250 and "relayed 1, refused permanently 1" in second.text
    assert raw_smarthost.delivered == [["user@example.net"], ["good@example.net"]]
    assert raw_smarthost.connections == 2


@pytest.mark.parametrize("gone", ["close", "421"])
async def test_a_mail_that_finds_the_reused_connection_gone_is_retried_on_a_new_one(
        make_relay: MakeRelay, raw_smarthost: RawSmarthost, gone: str) -> None:
    """A connection reused without RSET whose smarthost ends the session as MAIL arrives:
    the message goes on a new connection and the client sees only its 250."""
    raw_smarthost.gone_at_second_mail = gone
    relay = await make_relay(upstream=f"127.0.0.1:{raw_smarthost.port}")
    assert await _send_keys(relay, ["G-1", "G-2", "G-3"]) == [250, 250, 250]
    assert raw_smarthost.delivered == [["user@example.net"]] * 3
    assert raw_smarthost.connections == 3  # each connection ends at its second MAIL


async def test_one_silent_probe_drops_every_idle_connection(
        make_relay: MakeRelay, raw_smarthost: RawSmarthost) -> None:
    """Idle connections through a path that went silent (a NAT that forgot them): the first
    RSET probe times out and the others are dropped with it, so the message waits one short
    probe (2 s at most), not one command timeout per pooled connection."""
    relay = await make_relay(upstream=f"127.0.0.1:{raw_smarthost.port}",
                             upstream_command_timeout=4.0)
    codes = await asyncio.gather(*(send(relay.port, ["user@example.net"], message(key=f"S-{i}"))
                                   for i in range(4)))
    assert [c.code for c in codes] == [250] * 4
    opened = raw_smarthost.connections
    assert opened >= 2  # several idle connections to go silent
    raw_smarthost.silent_rset = True
    await asyncio.sleep(1.1)  # idle long enough to be probed before reuse
    started = asyncio.get_running_loop().time()
    assert await _send_keys(relay, ["S-9"]) == [250]
    waited = asyncio.get_running_loop().time() - started
    assert waited < 4.0, f"waited {waited:.1f} s: more than one probe"
    assert raw_smarthost.connections == opened + 1
    assert len(raw_smarthost.delivered) == 5


async def test_idle_connections_are_closed_in_a_quiet_period(
        make_relay: MakeRelay, serve_pool_sink: ServePool) -> None:
    """No traffic after a burst: the idle connections are QUIT once upstream_pool_idle
    passes, not held open until the next message."""
    sink, handler = await serve_pool_sink()
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_pool_idle=0.3)
    await asyncio.gather(*(send(relay.port, ["user@example.net"], message(key=f"Q-{i}"))
                           for i in range(3)))
    opened = len(set(handler.mail_peers))
    await eventually(lambda: handler.quits == opened, within_s=3.0)
