"""Keyed SMTP load generator of the benchmark (raw asyncio SMTP, no third-party client).

Every message is about 2 KB (``MESSAGE_BYTES``) and carries an ``X-Dedupe-Key`` header: unique per
message, or with ``duplicate_every = 2`` every second message repeats the key of a message sent 41
messages earlier, to the same recipients (a 50 % duplicate mix whose copies arrive after the
original was answered).
Latency is measured from the TCP connect (new connection per message) or from ``MAIL FROM`` (a
reused connection) to the reply to the final dot, in seconds.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import time
from dataclasses import dataclass, field

MESSAGE_BYTES = 2048
"""Approximate size of one message in bytes (header plus body)."""

DUP_DISTANCE = 41
"""A duplicate repeats the key of the message this many positions earlier (odd: a unique one)."""


@dataclass(frozen=True)
class Login:
    """STARTTLS with ``tls`` (a client context trusting the server's CA), then AUTH PLAIN as
    ``user`` / ``password``: every new connection of a load that has one."""

    tls: ssl.SSLContext
    user: str
    password: str


@dataclass
class LoadResult:
    """Outcome of one load: counts, wall time in seconds, per-message latencies in seconds."""

    sent: int = 0
    accepted: int = 0
    temp_failed: int = 0
    perm_failed: int = 0
    errors: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)


def build_message(n: int, key: str | None, rcpts: list[str]) -> bytes:
    """The DATA payload of message ``n`` (dot-stuffed, CRLF lines, without the final dot)."""
    head = [
        "From: bench@example.com",
        f"To: {', '.join(rcpts)}",
        f"Subject: bench message {n}",
        f"Message-ID: <bench.{n}.{time.time_ns()}@example.com>",
    ]
    if key is not None:
        head.append(f"X-Dedupe-Key: {key}")
    text = "\r\n".join(head) + "\r\n\r\n"
    line = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.\r\n"
    body = ""
    while len(text) + len(body) < MESSAGE_BYTES:
        body += line
    return (text + body).encode()


class Client:
    """One SMTP client connection (sequential commands, no PIPELINING)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int, login: Login | None = None) -> Client:
        """Connect, read the greeting and say EHLO; with ``login``, STARTTLS (RFC 3207), EHLO
        again and AUTH PLAIN (RFC 4616). Raises on an unexpected reply."""
        reader, writer = await asyncio.open_connection(host, port)
        client = cls(reader, writer)
        await client.expect(2)
        await client.command(b"EHLO load.bench", 2)
        if login is not None:
            await client.command(b"STARTTLS", 2)
            await writer.start_tls(login.tls, server_hostname=host)
            await client.command(b"EHLO load.bench", 2)
            plain = base64.b64encode(f"\0{login.user}\0{login.password}".encode())
            await client.command(b"AUTH PLAIN " + plain, 2)
        return client

    async def reply(self) -> int:
        """Read one (possibly multi-line) reply; returns its code."""
        while True:
            line = await self.reader.readline()
            if not line:
                raise ConnectionError("connection closed by the server")
            if line[3:4] != b"-":
                return int(line[:3])

    async def expect(self, klass: int) -> int:
        """Read a reply and raise ``SmtpRefused`` unless its first digit is ``klass``."""
        code = await self.reply()
        if code // 100 != klass:
            raise SmtpRefused(code)
        return code

    async def command(self, line: bytes, klass: int) -> int:
        """Send one command line and check its reply class."""
        self.writer.write(line + b"\r\n")
        return await self.expect(klass)

    async def send(self, rcpts: list[str], payload: bytes) -> int:
        """One transaction; returns the final reply code (raises ``SmtpRefused`` on refusal)."""
        await self.command(b"MAIL FROM:<bench@example.com>", 2)
        for rcpt in rcpts:
            await self.command(f"RCPT TO:<{rcpt}>".encode(), 2)
        await self.command(b"DATA", 3)
        self.writer.write(payload + b"\r\n.\r\n")
        code = await self.reply()
        if code // 100 != 2:
            await self.command(b"RSET", 2)
            raise SmtpRefused(code)
        return code

    async def close(self) -> None:
        """QUIT and close (errors ignored)."""
        try:
            self.writer.write(b"QUIT\r\n")
            await asyncio.wait_for(self.reply(), 5)
        except (TimeoutError, OSError, ConnectionError, ValueError):
            pass
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


class SmtpRefused(Exception):
    """The server answered with an unexpected reply code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"SMTP reply {code}")
        self.code = code


def original_of(n: int, duplicate_every: int) -> int:
    """The message whose key and recipients message ``n`` carries (``n`` unless a duplicate)."""
    if duplicate_every and n % duplicate_every == 1 and n >= DUP_DISTANCE:
        return n - DUP_DISTANCE
    return n


async def send_one(result: LoadResult, client: Client | None, host: str, port: int,
                   rcpts: list[str], payload: bytes, reuse: bool,
                   login: Login | None = None) -> Client | None:
    """One message (on ``client``, or a new connection, logged in with ``login``); records it
    in ``result``.

    Returns the connection to reuse, or None.
    """
    started = time.perf_counter()
    result.sent += 1
    try:
        if client is None:
            client = await Client.open(host, port, login)
        await client.send(rcpts, payload)
        result.accepted += 1
        result.latencies_s.append(time.perf_counter() - started)
    except SmtpRefused as exc:
        if exc.code // 100 == 4:
            result.temp_failed += 1
        else:
            result.perm_failed += 1
    except (OSError, ConnectionError, ValueError):
        result.errors += 1
        if client is not None:
            client.writer.close()
        return None
    if not reuse and client is not None:
        await client.close()
        return None
    return client


async def run_load(host: str, port: int, *, messages: int, sessions: int, rcpts: int,
                   reuse: bool, prefix: str, duplicate_every: int = 0,
                   keyed: bool = True, timeout_s: float = 60.0,
                   login: Login | None = None) -> LoadResult:
    """Send ``messages`` messages over ``sessions`` concurrent sessions; returns the figures.

    ``reuse``: each session keeps one connection for all its messages (else one per message).
    ``login``: each connection STARTTLS + AUTH PLAIN first (its time is in the latency).
    ``duplicate_every = 2``: the 50 % duplicate mix (see the module docstring). ``timeout_s``:
    seconds one message may take.
    """
    result = LoadResult()
    counter = iter(range(messages))

    async def session() -> None:
        client: Client | None = None
        for n in counter:
            m = original_of(n, duplicate_every)
            to = [f"user{m}.{i}@example.net" for i in range(rcpts)]
            payload = build_message(n, f"{prefix}{m}" if keyed else None, to)
            client = await asyncio.wait_for(
                send_one(result, client, host, port, to, payload, reuse, login), timeout_s)
        if client is not None:
            await client.close()

    started = time.perf_counter()
    await asyncio.gather(*(session() for _ in range(sessions)))
    result.wall_s = time.perf_counter() - started
    return result
