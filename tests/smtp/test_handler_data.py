"""The listener against clients that misbehave in time or size: hang-ups and half-closes around
the final dot, lines without CRLF, slow DATA, and sessions kept alive with idle commands."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.app import Relay
from relay.core import replies
from relay.core.interfaces import SmtpReply
from tests.support.cli import smtp_send, start_relay, wait_for_port
from tests.support.clients import RawClient, message
from tests.support.net import free_port
from tests.support.pki import Pki, tls_relay
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

ENVELOPE = ("EHLO client.test", "MAIL FROM:<app@example.com>", "RCPT TO:<user@example.net>")


async def open_data(port: int) -> RawClient:
    """A raw client that has said EHLO, MAIL, RCPT and DATA and got its 354."""
    client = await RawClient.connect(port)
    for line in ENVELOPE:
        await client.cmd(line)
    assert (await client.cmd("DATA")).startswith("354")
    return client


async def read_to_eof(client: RawClient, wait_s: float = 15.0) -> list[str]:
    """Every reply line the relay writes until it closes the connection."""
    raw = await asyncio.wait_for(client.reader.read(), wait_s)
    return raw.decode().splitlines()


def decision_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The listener's ``message`` decision lines captured so far."""
    return [r for r in caplog.records if r.name == "relay.smtp.handler" and r.msg == "message"]


async def wait_for_decision(caplog: pytest.LogCaptureFixture,
                            timeout_s: float = 5.0) -> logging.LogRecord:
    """The first decision line, waiting for it up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not decision_records(caplog):
        if time.monotonic() > deadline:
            raise AssertionError("no decision line was logged")
        await asyncio.sleep(0.05)
    return decision_records(caplog)[0]


# ------------------------------------------------------------------------------------------
# item 7: a decision line whatever the client did
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hang_up", ["close", "reset"])
async def test_decision_is_logged_when_the_client_hangs_up_after_the_dot(
        relay: Relay, sink: Sink, caplog: pytest.LogCaptureFixture, hang_up: str) -> None:
    """A client gone right after the final dot still gets its message logged with a queue_id."""
    caplog.set_level(logging.INFO, logger="relay.smtp.handler")
    sink.handler.delay_s = 0.5  # the client is gone while the upstream works
    client = await open_data(relay.port)
    await client.write(message(key="HANGUP-1") + b".\r\n")
    if hang_up == "reset":  # RST, not FIN
        sock = client.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.writer.transport.abort()
    else:
        await client.close()
    record = await wait_for_decision(caplog)
    assert record.__dict__["result"] == "relayed"
    assert len(record.__dict__["queue_id"]) == 12
    assert len(sink.handler.delivered) == 1


# ------------------------------------------------------------------------------------------
# item 9: a half-closed client reads its replies
# ------------------------------------------------------------------------------------------


async def test_half_closed_client_reads_the_dot_reply_and_221(
        relay: Relay, sink: Sink, caplog: pytest.LogCaptureFixture) -> None:
    """The final dot and QUIT sent with a write shutdown are answered 250 then 221, in order."""
    caplog.set_level(logging.INFO, logger="relay.smtp.handler")
    sink.handler.delay_s = 0.3
    client = await open_data(relay.port)
    client.writer.write(message(key="HALF-1") + b".\r\nQUIT\r\n")
    client.writer.write_eof()  # shutdown(SHUT_WR), as Exim does
    lines = await read_to_eof(client)
    assert [line[:3] for line in lines] == ["250", "221"]
    assert lines[0].startswith("250 2.0.0 Ok: relayed 1")
    assert (await wait_for_decision(caplog)).__dict__["result"] == "relayed"
    await client.close()


async def test_half_closed_pipelined_session_is_answered_command_by_command(
        relay: Relay, sink: Sink) -> None:
    """A whole pipelined session ended by a write shutdown gets every reply, then the close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    client = RawClient(reader, writer)
    await client.reply()
    writer.write(b"EHLO client.test\r\nMAIL FROM:<app@example.com>\r\n"
                 b"RCPT TO:<user@example.net>\r\nDATA\r\n"
                 + message(key="HALF-2") + b".\r\nNOOP\r\n")
    writer.write_eof()
    lines = [line for line in await read_to_eof(client) if line[3:4] != "-"]
    assert [line[:3] for line in lines] == ["250", "250", "250", "354", "250", "250"]
    assert lines[4].startswith("250 2.0.0 Ok: relayed 1")
    await client.close()


async def test_half_close_inside_data_relays_nothing_and_closes(relay: Relay,
                                                               sink: Sink) -> None:
    """A message cut by the client's EOF before its final dot is dropped and the relay closes."""
    client = await open_data(relay.port)
    client.writer.write(message(key="HALF-3"))
    client.writer.write_eof()
    assert await read_to_eof(client) == []
    assert sink.handler.delivered == []
    await client.close()


def starttls_dot_quit_half_close(port: int, context: ssl.SSLContext) -> bytes:
    """Over STARTTLS, send a message, its dot and QUIT, shut down the TCP write side (no
    close_notify) and return whatever the relay still sends."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    plain = raw.makefile("rb")
    plain.readline()
    raw.sendall(b"EHLO client.test\r\nSTARTTLS\r\n")
    while not plain.readline().startswith(b"220"):
        pass
    with context.wrap_socket(raw, server_hostname="relay.test") as tls:
        stream = tls.makefile("rb")
        for line in (*ENVELOPE, "DATA"):
            tls.sendall(line.encode() + b"\r\n")
            while stream.readline()[3:4] == b"-":
                pass
        tls.sendall(message(key="TLS-HALF") + b".\r\nQUIT\r\n")
        with socket.socket(fileno=os.dup(tls.fileno())) as same:
            same.shutdown(socket.SHUT_WR)
        try:
            return stream.read()
        except (OSError, ssl.SSLError):
            return b""


async def test_half_closed_tls_client_reads_the_dot_reply_and_221(
        make_relay: MakeRelay, sink: Sink, pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    """Over STARTTLS, dot and QUIT then a write shutdown: the client reads 250 and 221, and the
    message is relayed and logged (asyncio's own TLS layer closed on the EOF: no reply)."""
    caplog.set_level(logging.INFO, logger="relay.smtp.handler")
    relay = await tls_relay(make_relay, sink, pki)
    sink.handler.delay_s = 0.3
    tail = await asyncio.to_thread(starttls_dot_quit_half_close, relay.port, pki.client_context)
    assert (await wait_for_decision(caplog)).__dict__["result"] == "relayed"
    assert len(sink.handler.delivered) == 1
    lines = tail.decode().splitlines()
    assert [line[:3] for line in lines] == ["250", "221"], tail


# ------------------------------------------------------------------------------------------
# item 10: line and size limits in bounded memory
# ------------------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    """Resident set size of process ``pid`` in KiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def stream_without_crlf(port: int, prefix: bytes, total: int,
                        pid: int) -> tuple[bytes, bytes, int]:
    """Send ``prefix`` then ``total`` octets holding no line end, then CRLF (and the dot when
    inside DATA), then NOOP; return the reply to the long line, the NOOP's, and the highest
    RSS of process ``pid`` seen meanwhile (KiB)."""
    chunk = b"x" * (64 << 10)
    peak = rss_kib(pid)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        stream = sock.makefile("rb")
        stream.readline()
        sock.sendall(prefix)
        for sent in range(0, total, len(chunk)):
            sock.sendall(chunk)
            if sent % (4 << 20) == 0:
                peak = max(peak, rss_kib(pid))
        in_data = prefix.endswith(b"DATA\r\n")
        sock.sendall(b"\r\n.\r\n" if in_data else b"\r\n")
        if in_data:  # skip the replies to the envelope, up to the 354
            while not stream.readline().startswith(b"354"):
                pass
        long_reply = stream.readline()
        peak = max(peak, rss_kib(pid))
        sock.sendall(b"NOOP\r\n")
        return long_reply.rstrip(), stream.readline().rstrip(), peak


@pytest.fixture
def relay_process(tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """`dedup-relay serve` as its own process (Maildir upstream, embedded SQLite store)."""
    port = free_port()
    proc = start_relay(tmp_path, port, f"maildir:{tmp_path / 'maildir'}")
    try:
        wait_for_port(port, proc)
        yield port, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)  # waits, and closes the pipes (no ResourceWarning)


@pytest.mark.parametrize(("prefix", "reply"), [
    (b"EHLO client.test\r\nMAIL FROM:<app@example.com>\r\nRCPT TO:<user@example.net>\r\n"
     b"DATA\r\n", replies.LINE_TOO_LONG),
    (b"NOOP ", replies.LINE_TOO_LONG),
])
def test_a_long_line_without_crlf_is_read_in_bounded_memory(
        relay_process: tuple[int, subprocess.Popen[str]], prefix: bytes,
        reply: SmtpReply) -> None:
    """200 MB without a line end, in DATA or in a command, grows the relay by under 20 MB."""
    port, proc = relay_process
    pid = proc.pid
    assert smtp_send(port, message())[0] == 250  # warm up: the first message loads modules
    before = rss_kib(pid)
    long_reply, noop, peak = stream_without_crlf(port, prefix, 200 << 20, pid)
    grown = peak - before
    assert long_reply.decode().startswith(str(reply)[:9]), long_reply
    assert noop.startswith(b"250 2.0.0"), noop  # the session goes on
    assert grown < 20 * 1024, f"relay grew by {grown} KiB"


async def test_too_much_data_is_552_after_the_dot(make_relay: MakeRelay, sink: Sink) -> None:
    """A message past max_message_size is answered 552 5.3.4 at the dot; the session goes on."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_message_size=4096)
    client = await open_data(relay.port)
    await client.write(message(body="y" * 900 + "\r\n") * 10 + b".\r\n")
    assert await client.reply() == str(replies.MESSAGE_TOO_BIG)
    assert (await client.cmd("NOOP")).startswith("250 2.0.0")
    assert sink.handler.delivered == []
    await client.close()


async def test_a_line_of_999_octets_is_refused_and_998_relayed(relay: Relay, sink: Sink) -> None:
    """RFC 5321 4.5.3.1.6: 998 octets before CRLF is a line, 999 is 500 5.5.2 after the dot."""
    for length, reply in ((999, str(replies.LINE_TOO_LONG)), (998, "250 2.0.0")):
        client = await open_data(relay.port)
        # stuffed on the wire (RFC 5321 4.5.2): the dot added in front is not counted
        await client.write(message(key=f"LEN-{length}", body=".." + "z" * (length - 1))
                           + b".\r\n")
        assert (await client.reply()).startswith(reply)
        await client.close()
    assert len(sink.handler.delivered) == 1


# ------------------------------------------------------------------------------------------
# item 14: slow clients and idle sessions
# ------------------------------------------------------------------------------------------


async def test_slow_data_is_cut_at_the_data_deadline(make_relay: MakeRelay, sink: Sink) -> None:
    """A body trickling in faster than the idle timeout is cut at data_deadline with 421 4.4.2."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", client_timeout=1.0,
                             data_deadline=1.5)
    client = await open_data(relay.port)
    started = time.monotonic()

    async def trickle() -> None:
        for byte in message(key="SLOW-1"):
            client.writer.write(bytes([byte]))
            await asyncio.sleep(0.2)

    trickling = asyncio.create_task(trickle())
    try:
        assert await client.reply(wait_s=6.0) == str(replies.DATA_DEADLINE)
    finally:
        trickling.cancel()
    assert 1.4 < time.monotonic() - started < 3.0
    assert sink.handler.delivered == []
    await client.close()


async def test_a_noop_kept_session_ends_at_its_lifetime(make_relay: MakeRelay,
                                                         sink: Sink) -> None:
    """A session kept busy with NOOPs is told 421 4.4.2 and closed after session_lifetime."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", session_lifetime=1.0)
    client = await RawClient.connect(relay.port)
    started = time.monotonic()
    reply = ""
    while time.monotonic() - started < 5:
        reply = await client.cmd("NOOP")
        if not reply.startswith("250"):
            break
        await asyncio.sleep(0.1)
    assert reply == str(replies.SESSION_TOO_LONG)
    assert 0.9 < time.monotonic() - started < 2.0
    assert await client.reader.read() == b""
    await client.close()


async def test_session_lifetime_does_not_cut_a_message_being_processed(
        make_relay: MakeRelay, sink: Sink) -> None:
    """A session whose lifetime ends while its message is upstream gets the 250, then 421."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", session_lifetime=1.0)
    sink.handler.delay_s = 1.5
    client = await open_data(relay.port)
    await client.write(message(key="LIFE-1") + b".\r\n")
    lines = await read_to_eof(client)
    assert lines[0].startswith("250 2.0.0 Ok: relayed 1")
    assert lines[1:] == [str(replies.SESSION_TOO_LONG)]
    assert len(sink.handler.delivered) == 1
    await client.close()


async def test_idle_commands_are_capped(make_relay: MakeRelay, sink: Sink) -> None:
    """Past max_idle_commands commands without a transaction, the relay says 421 4.7.0."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_idle_commands=5)
    client = await RawClient.connect(relay.port)
    for command in ("EHLO client.test", "NOOP", "RSET", "HELP", "VRFY <a@b.example>"):
        assert not (await client.cmd(command)).startswith("421")
    assert await client.cmd("NOOP") == str(replies.TOO_MANY_IDLE_COMMANDS)
    assert await client.reader.read() == b""
    await client.close()


async def test_refused_transaction_commands_count_as_idle(
        make_relay: MakeRelay, sink: Sink) -> None:
    """MAIL, RCPT and DATA that are refused make no progress: they count against
    max_idle_commands like NOOP (pipelined refusals no longer keep a session alive)."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_idle_commands=4)
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    for command in ("RCPT TO:<a@example.net>", "DATA", "MAIL FROM:<bad"):
        assert (await client.cmd(command))[:1] in ("5", "4")
    assert (await client.cmd("RCPT TO:<a@example.net>")).startswith("503")  # the 5th
    assert await client.reply() == str(replies.TOO_MANY_IDLE_COMMANDS)
    assert await client.reader.read() == b""
    await client.close()


async def test_a_completed_transaction_resets_the_idle_command_count(
        make_relay: MakeRelay, sink: Sink) -> None:
    """Idle commands are counted from the last message: a steady sender is never cut."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_idle_commands=3)
    client = await RawClient.connect(relay.port)
    for n in range(3):
        await client.cmd("EHLO client.test" if n == 0 else "RSET")
        await client.cmd("NOOP")
        await client.cmd("MAIL FROM:<app@example.com>")
        await client.cmd("RCPT TO:<user@example.net>")
        assert (await client.cmd("DATA")).startswith("354")
        await client.write(message(key=f"RESET-{n}") + b".\r\n")
        assert (await client.reply()).startswith("250 2.0.0 Ok: relayed 1")
    assert await client.cmd("QUIT") == "221 2.0.0 Bye"
    await client.close()
