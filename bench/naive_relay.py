"""The benchmark's naive baseline relay: what a first, straightforward dedup relay looks like.

A single-process aiosmtpd server. At the final dot it reads the ``X-Dedupe-Key`` header, sends
one Redis ``SET fingerprint 1 NX PX window`` per recipient (fingerprint: SHA-256 of key and
recipient), and relays the message to the recipients that were new over a pooled aiosmtplib
connection to the upstream; no lease, no SENT mark, no retry. With ``--tls-cert`` and
``--tls-key`` it offers STARTTLS, and with ``--users`` (``user:password`` lines) AUTH PLAIN and
LOGIN over TLS, checked against that dictionary. Run::

    python -m bench.naive_relay --listen 127.0.0.1:2526 --upstream 127.0.0.1:2527 \
        --redis redis://127.0.0.1:6379/0 --prefix naive:
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import re
import signal
import ssl
from pathlib import Path
from typing import Any

import aiosmtplib
import redis.asyncio as aioredis
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session

KEY_RE = re.compile(rb"^X-Dedupe-Key:[ \t]*([^\r\n]*)", re.IGNORECASE | re.MULTILINE)
WINDOW_MS = 86_400_000
"""Dedup window in milliseconds (the ``PX`` of the ``SET``)."""


class Pool:
    """Idle upstream connections (at most ``size``), reused without a probe."""

    def __init__(self, host: str, port: int, size: int) -> None:
        self.host = host
        self.port = port
        self.size = size
        self.idle: list[aiosmtplib.SMTP] = []

    async def get(self) -> aiosmtplib.SMTP:
        """An idle connection, or a new one."""
        while self.idle:
            client = self.idle.pop()
            if client.is_connected:
                return client
        client = aiosmtplib.SMTP(hostname=self.host, port=self.port, timeout=60,
                                 start_tls=False)
        await client.connect()
        return client

    async def put(self, client: aiosmtplib.SMTP) -> None:
        """Keep ``client`` for reuse, or QUIT it when the pool is full."""
        if len(self.idle) < self.size and client.is_connected:
            self.idle.append(client)
            return
        try:
            await client.quit()
        except aiosmtplib.SMTPException:
            client.close()


class Handler:
    """aiosmtpd handler: dedup at the final dot, then relay."""

    def __init__(self, store: aioredis.Redis, prefix: str, pool: Pool) -> None:
        self.store = store
        self.prefix = prefix
        self.pool = pool

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        """Answer the final dot: 250 (relayed or all duplicates) or 451 on any failure."""
        content = envelope.original_content or b""
        match = KEY_RE.search(content.split(b"\r\n\r\n", 1)[0])
        rcpts = list(envelope.rcpt_tos)
        try:
            if match:
                key = match.group(1).strip()
                new = []
                for rcpt in rcpts:
                    fp = hashlib.sha256(key + b"\x00" + rcpt.lower().encode()).hexdigest()
                    if await self.store.set(self.prefix + fp, b"1", nx=True, px=WINDOW_MS):
                        new.append(rcpt)
                rcpts = new
            if not rcpts:
                return "250 2.0.0 OK: duplicate, not relayed"
            client = await self.pool.get()
            try:
                await client.sendmail(envelope.mail_from or "", rcpts, content)
            except BaseException:
                client.close()
                raise
            await self.pool.put(client)
        except (aiosmtplib.SMTPException, OSError, aioredis.RedisError) as exc:
            return f"451 4.3.0 relay failed: {type(exc).__name__}"
        return "250 2.0.0 OK: relayed"


class Dictionary:
    """aiosmtpd authenticator: the login's password equals ``users[login]``."""

    def __init__(self, users: dict[str, str]) -> None:
        self.users = users

    def __call__(self, server: SMTP, session: Session, envelope: Envelope, mechanism: str,
                 auth_data: Any) -> AuthResult:
        if not isinstance(auth_data, LoginPassword):
            return AuthResult(success=False, handled=False)
        wanted = self.users.get(auth_data.login.decode("utf-8", "replace"))
        ok = wanted is not None and hmac.compare_digest(wanted.encode(), auth_data.password)
        # handled=False: aiosmtpd answers the failure (535); True would leave it unanswered
        return AuthResult(success=ok, handled=ok)


def read_users(path: Path) -> dict[str, str]:
    """``user:password`` lines."""
    pairs = (line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
    return {user: password for user, password in pairs}


async def serve(listen: str, upstream: str, redis_url: str, prefix: str, pool_size: int,
                tls: ssl.SSLContext | None = None, users: dict[str, str] | None = None) -> None:
    """Run until SIGTERM or SIGINT."""
    host, port = listen.rsplit(":", 1)
    up_host, up_port = upstream.rsplit(":", 1)
    store = aioredis.Redis.from_url(redis_url)
    handler = Handler(store, prefix, Pool(up_host, int(up_port), pool_size))
    loop = asyncio.get_running_loop()
    authenticator = Dictionary(users) if users else None
    server = await loop.create_server(
        lambda: SMTP(handler, hostname="naive.bench", enable_SMTPUTF8=True, tls_context=tls,
                     authenticator=authenticator, auth_require_tls=True), host, int(port))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    server.close()
    await server.wait_closed()
    await store.aclose()


def main() -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT to listen on")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the smarthost")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis URL")
    parser.add_argument("--prefix", default="naive:", help="key prefix of the fingerprints")
    parser.add_argument("--pool-size", type=int, default=20, help="idle upstream connections kept")
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain: STARTTLS")
    parser.add_argument("--tls-key", type=Path, help="PEM key of --tls-cert")
    parser.add_argument("--users", type=Path, help="user:password lines: AUTH over TLS")
    args = parser.parse_args()
    tls = None
    if args.tls_cert is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    users = read_users(args.users) if args.users is not None else None
    asyncio.run(serve(args.listen, args.upstream, args.redis, args.prefix, args.pool_size,
                      tls, users))


if __name__ == "__main__":
    main()
