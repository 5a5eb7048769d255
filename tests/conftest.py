"""Shared test parts: a real aiosmtpd sink as the upstream, a relay served in the test's loop,
an smtplib client (run in a thread), a raw-socket SMTP client for byte-exact wire tests, and
a private redis-server for tests that must stop Redis.

The Redis used by most tests is ``RELAY_TEST_REDIS_URL`` (default redis://127.0.0.1:6379/0);
each relay gets its own random key prefix and its keys are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import smtplib
import socket
import subprocess
import tempfile
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from aiosmtpd.smtp import SMTP, Envelope, Session

from relay.app import Relay
from relay.config import Settings

REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


# ------------------------------------------------------------------------------------------
# upstream sink
# ------------------------------------------------------------------------------------------


@dataclass
class Delivered:
    """One message the sink accepted."""

    mail_from: str
    rcpt_tos: list[str]
    content: bytes
    mail_options: list[str]


@dataclass
class SinkHandler:
    """aiosmtpd handler of the fake smarthost; its plans script faults per test.

    ``rcpt_plan[address]`` and ``data_plan`` are queues of replies used one per call (then
    250); ``mail_plan`` likewise for MAIL; ``hang_after_dot_s`` delays the reply to the final
    dot; ``delay_s`` delays every DATA reply (to hold a transaction open).
    """

    delivered: list[Delivered] = field(default_factory=list)
    transactions: int = 0
    rcpt_plan: dict[str, deque[str]] = field(default_factory=dict)
    data_plan: deque[str] = field(default_factory=deque)
    mail_plan: deque[str] = field(default_factory=deque)
    hang_after_dot_s: float = 0.0
    delay_s: float = 0.0
    mail_delay_s: float = 0.0
    mail_commands: list[tuple[str, list[str]]] = field(default_factory=list)
    rcpt_commands: list[str] = field(default_factory=list)

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        self.transactions += 1
        self.mail_commands.append((address, options))
        if self.mail_delay_s:
            await asyncio.sleep(self.mail_delay_s)
        if self.mail_plan:
            return self.mail_plan.popleft()
        envelope.mail_from = address
        envelope.mail_options.extend(options)
        return "250 2.1.0 OK"

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        self.rcpt_commands.append(address)
        plan = self.rcpt_plan.get(address)
        if plan:
            reply = plan.popleft()
            if not reply.startswith("250"):
                return reply
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        reply = self.data_plan.popleft() if self.data_plan else "250 2.0.0 Ok: queued as SINK1"
        if reply.startswith("250"):
            self.delivered.append(Delivered(
                envelope.mail_from, list(envelope.rcpt_tos), envelope.original_content,
                list(envelope.mail_options)))
        if self.hang_after_dot_s:
            await asyncio.sleep(self.hang_after_dot_s)
        return reply

    def copies_to(self, address: str) -> int:
        """How many accepted messages were addressed to ``address`` (exact spelling)."""
        return sum(d.rcpt_tos.count(address) for d in self.delivered)


@dataclass
class Sink:
    """A running sink: ``port`` to relay to, ``handler`` to script and inspect."""

    handler: SinkHandler
    port: int
    server: asyncio.base_events.Server


async def start_sink(*, smtputf8: bool = True, eight_bit: bool = True) -> Sink:
    """Serve a SinkHandler on 127.0.0.1:0 in the running loop."""
    handler = SinkHandler()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: SMTP(handler, hostname="sink.test", decode_data=not eight_bit,
                     enable_SMTPUTF8=smtputf8, data_size_limit=50 * 1024 * 1024),
        host="127.0.0.1", port=0)
    return Sink(handler=handler, port=server.sockets[0].getsockname()[1], server=server)


@pytest.fixture
async def sink() -> AsyncIterator[Sink]:
    """A fresh upstream sink for one test."""
    s = await start_sink()
    yield s
    s.server.close()


# ------------------------------------------------------------------------------------------
# relay
# ------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every Redis key under ``prefix`` (test clean-up)."""
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=500))
        if keys:
            client.delete(*keys)
    except redis.ConnectionError:
        pass  # a private redis-server the test already stopped: nothing left to clean
    finally:
        client.close()


MakeRelay = Callable[..., Awaitable[Relay]]


@pytest.fixture
async def make_relay() -> AsyncIterator[MakeRelay]:
    """Factory: ``await make_relay(upstream="127.0.0.1:PORT", **settings)`` -> started Relay.

    Defaults: Redis store at REDIS_URL with a random key prefix, metrics off, short
    timeouts. Every relay is stopped and its keys deleted at the end of the test.
    """
    started: list[Relay] = []

    async def make(**overrides: Any) -> Relay:
        values: dict[str, Any] = {
            "listen": "127.0.0.1:0", "hostname": "relay.test", "store": REDIS_URL,
            "store_prefix": f"test:{uuid.uuid4().hex}:", "metrics_listen": None,
            "upstream_timeout": 5.0, "upstream_command_timeout": 5.0,
            "upstream_connect_timeout": 2.0, "lease": 30.0, "dedup_window": 3600.0,
            "shutdown_grace": 5.0,
            "settle_journal": str(Path(tempfile.gettempdir())
                                  / f"dedup-relay-test-{uuid.uuid4().hex}.jsonl"),
        }
        values.update(overrides)
        relay = Relay(Settings(**values))
        await relay.start()
        started.append(relay)
        return relay

    yield make
    for relay in started:
        await relay.stop()
        if relay.settings.store.startswith(("redis://", "rediss://")):  # not +cluster/+sentinel
            delete_prefix(relay.settings.store, relay.settings.store_prefix)


@pytest.fixture
async def relay(make_relay: MakeRelay, sink: Sink) -> Relay:
    """A relay in front of ``sink`` with the default test settings."""
    return await make_relay(upstream=f"127.0.0.1:{sink.port}")


# ------------------------------------------------------------------------------------------
# clients
# ------------------------------------------------------------------------------------------


@dataclass
class SendResult:
    """What an smtplib client saw: the DATA reply, and the RCPT refusals by address."""

    code: int
    text: str
    rcpt_refused: dict[str, tuple[int, str]] = field(default_factory=dict)


def _send_sync(port: int, mail_from: str, rcpts: Sequence[str], data: bytes,
               mail_options: Sequence[str]) -> SendResult:
    client = smtplib.SMTP("127.0.0.1", port, timeout=30)
    try:
        return _transaction(client, mail_from, rcpts, data, mail_options)
    finally:
        with contextlib.suppress(smtplib.SMTPException, OSError):
            client.quit()  # a relay shutting down may have closed the session already
        client.close()


def _transaction(client: smtplib.SMTP, mail_from: str, rcpts: Sequence[str], data: bytes,
                 mail_options: Sequence[str]) -> SendResult:
    client.ehlo("client.test")
    code, text = client.mail(mail_from, list(mail_options))
    if code != 250:
        return SendResult(code, text.decode())
    refused: dict[str, tuple[int, str]] = {}
    for rcpt in rcpts:
        code, text = client.rcpt(rcpt)
        if code not in (250, 251):
            refused[rcpt] = (code, text.decode())
    if len(refused) == len(rcpts):
        return SendResult(554, "all recipients refused", refused)
    try:
        code, text = client.data(data)
    except smtplib.SMTPDataError as exc:
        code, text = exc.smtp_code, exc.smtp_error
    return SendResult(code, text.decode(errors="replace"), refused)


async def send(port: int, rcpts: Sequence[str], data: bytes, *,
               mail_from: str = "app@example.com",
               mail_options: Sequence[str] = ()) -> SendResult:
    """Send one message with smtplib (in a thread, so the relay's loop keeps running)."""
    return await asyncio.to_thread(_send_sync, port, mail_from, rcpts, data, mail_options)


def message(key: str | None = "K-1", template: str | None = "welcome", body: str = "hello",
            extra: str = "") -> bytes:
    """A small CRLF message with the dedupe headers (None leaves a header out)."""
    lines = ["From: app@example.com", "To: user@example.net", "Subject: test"]
    if template is not None:
        lines.append(f"X-Template: {template}")
    if key is not None:
        lines.append(f"X-Dedupe-Key: {key}")
    head = "\r\n".join(lines) + "\r\n" + extra
    return (head + "\r\n" + body + "\r\n").encode()


class RawClient:
    """A byte-exact SMTP client over asyncio streams, for wire-level cases."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int, host: str = "127.0.0.1") -> RawClient:
        reader, writer = await asyncio.open_connection(host, port)
        client = cls(reader, writer)
        await client.reply()  # greeting
        return client

    async def reply(self, wait_s: float = 15.0) -> str:
        """Read one (possibly multi-line) reply; returns all its lines joined by \\n."""
        lines = []
        while True:
            line = await asyncio.wait_for(self.reader.readline(), wait_s)
            if not line:
                raise ConnectionError("closed by server")
            text = line.decode("utf-8", "replace").rstrip("\r\n")
            lines.append(text)
            if len(text) < 4 or text[3] != "-":
                return "\n".join(lines)

    async def cmd(self, line: bytes | str) -> str:
        """Send one command line (CRLF added) and return the reply."""
        raw = line.encode() if isinstance(line, str) else line
        self.writer.write(raw + b"\r\n")
        await self.writer.drain()
        return await self.reply()

    async def write(self, raw: bytes) -> None:
        self.writer.write(raw)
        await self.writer.drain()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


# ------------------------------------------------------------------------------------------
# a private redis-server that tests may stop
# ------------------------------------------------------------------------------------------


@dataclass
class PrivateRedis:
    """A redis-server process on a free loopback port, owned by one test."""

    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        pytest.fail(f"private redis-server on port {self.port} did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A started private redis-server; stopped at the end of the test whatever happened."""
    server = PrivateRedis(port=free_port())
    server.start()
    yield server
    server.stop()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fail loudly, once, when the test Redis does not answer."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping()
    except redis.RedisError as exc:
        raise pytest.UsageError(
            f"Redis at {REDIS_URL} does not answer ({exc}); start one or set "
            "RELAY_TEST_REDIS_URL (.ci/run does this)") from exc


def maildir_files(path: Path) -> list[bytes]:
    """The contents of every message file in the Maildir at ``path``."""
    return [p.read_bytes() for p in sorted((path / "new").glob("*"))]
