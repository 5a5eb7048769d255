"""SMTP clients of the tests: smtplib in a thread (``send``) and a byte-exact raw client
(``RawClient``); ``message`` builds a small message with the dedupe headers."""

from __future__ import annotations

import asyncio
import contextlib
import smtplib
from collections.abc import Sequence
from dataclasses import dataclass, field


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
    answer: bytes | str
    try:
        code, answer = client.data(data)
    except smtplib.SMTPDataError as exc:
        code, answer = exc.smtp_code, exc.smtp_error
    said = answer.decode(errors="replace") if isinstance(answer, bytes) else answer
    return SendResult(code, said, refused)


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

    async def reply(self, wait_s: float = 60.0) -> str:
        """Read one (possibly multi-line) reply; returns all its lines joined by \\n. Each
        line is waited for up to ``wait_s`` seconds (generous: an AUTH's hash check runs at a
        lower priority, which a loaded runner starves)."""
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
