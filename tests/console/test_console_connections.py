"""The console's connections over raw sockets, served by an in-process relay: HTTPS clients
counted when TCP accepts them (before their handshake), anonymous connections that sent no
request closed first when the console is full so a signed-in operator gets in, and malformed
requests on the console and metrics ports answered 400 with one INFO line each."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import aiohttp
import pytest

from tests.support.console import (
    OPERATOR,
    OPERATOR_PASSWORD,
    Browser,
    console_relay,
    opened,
)
from tests.support.pki import make_pki
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.timeout(60)

Raw = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def connect(port: int, source: str = "127.0.0.1") -> Raw:
    """A TCP connection to 127.0.0.1:``port`` from the loopback address ``source``."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_within(raw: Raw, seconds: float) -> bool:
    """Whether the server closed ``raw`` (nothing sent) within ``seconds``."""
    try:
        return await asyncio.wait_for(raw[0].read(1), seconds) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def refused(port: int, source: str = "127.0.0.1", within_s: float = 1.0) -> bool:
    """Whether a new connection from ``source`` is closed within ``within_s``, nothing sent."""
    raw = await connect(port, source)
    try:
        return await closed_within(raw, within_s)
    finally:
        raw[1].close()


def close_all(raws: list[Raw]) -> None:
    for _, writer in raws:
        writer.close()


@pytest.mark.both_loops
async def test_https_connections_are_counted_before_their_handshake(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser]) -> None:
    """Over HTTPS, sixteen connections from one address that never start their handshake are
    all that address gets: the seventeenth is closed at once, nothing sent, as is the
    sixty-fifth of four addresses; a client of a fifth address is served once one goes."""
    pki = make_pki(tmp_path)
    relay = await console_relay(make_relay, sink, tmp_path, tls_cert=pki.cert,
                                tls_key=pki.key)
    assert relay.console is not None and relay.console.tls
    port = relay.console.port
    silent = [await connect(port) for _ in range(16)]
    try:
        assert await refused(port, within_s=2.0)
        for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
            silent += [await connect(port, source) for _ in range(16)]
        assert await refused(port, "127.0.0.5")
        assert not await closed_within(silent[0], 0.1)  # the counted ones are held
        silent.pop()[1].close()
        await asyncio.sleep(0.2)  # the server has seen it go
        b = opened(web, relay, "https", connector=aiohttp.TCPConnector(
            ssl=pki.client_context, local_addr=("127.0.0.5", 0)))
        status, page, _ = await b.get("/login")
        assert status == 200 and 'name="password"' in page
    finally:
        close_all(silent)


async def test_a_signed_in_operator_gets_in_while_silent_connections_fill_the_console(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser]) -> None:
    """Sixty-four connections from four addresses that send nothing fill the console; once
    they have been silent 2 s, a new connection of a signed-in operator closes one of them
    and is served (its next ones take the slot it left), and the others stay open."""
    relay = await console_relay(make_relay, sink, tmp_path)
    assert relay.console is not None
    operator = opened(web, relay, connector=aiohttp.TCPConnector(
        force_close=True, local_addr=("127.0.0.5", 0)))  # a new connection per request
    assert (await operator.sign_in(OPERATOR, OPERATOR_PASSWORD))[0] == 303
    silent: list[Raw] = []
    for source in ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"):
        silent += [await connect(relay.console.port, source) for _ in range(16)]
    try:
        with pytest.raises(aiohttp.ClientError):  # within the 2 s, no silent one may go
            await operator.get("/history")
        await asyncio.sleep(2.2)
        for _ in range(3):
            status, page, _ = await operator.get("/history")
            assert status == 200 and "Sign out" in page
        gone = [await closed_within(raw, 0.05) for raw in silent]
        assert sum(gone) == 1, [i for i, g in enumerate(gone) if g]
    finally:
        close_all(silent)


MALFORMED = [
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/9.Z\r\nHost: x\r\n\r\n",
    b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"POST /login HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
]


async def answer_to(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def multipart_sign_in() -> bytes:
    body = (b'--XX\r\nContent-Disposition: form-data; name="user"\r\n\r\n'
            + OPERATOR.encode() + b"\r\n--XX--\r\n")
    return (b"POST /login HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: multipart/form-data; boundary=XX\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


async def test_malformed_requests_are_answered_400_with_one_info_line(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A request aiohttp cannot parse, on the console's port and on the metrics port, and a
    sign-in posted as multipart or as bytes that are no UTF-8, are each answered 400 and
    logged as one INFO line, no traceback, nothing at WARNING or above."""
    relay = await console_relay(make_relay, sink, tmp_path, metrics_listen="127.0.0.1:0")
    assert relay.console is not None and relay.metrics_port
    caplog.set_level(logging.INFO)
    caplog.clear()
    sent = 0
    for port in (relay.console.port, relay.metrics_port):
        for request in MALFORMED:
            answer = await answer_to(port, request)
            assert answer.startswith(b"HTTP/1.") and answer.split(b" ")[1] == b"400", answer
            sent += 1
    for request in (multipart_sign_in(),
                    b"POST /login HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: "
                    b"application/x-www-form-urlencoded\r\nContent-Length: 6\r\n\r\nuser=\xff"):
        answer = await answer_to(relay.console.port, request)
        assert answer.startswith(b"HTTP/1.1 400"), answer
        sent += 1
    await asyncio.sleep(0.1)
    http = [r for r in caplog.records
            if r.name.startswith(("aiohttp", "relay.ops.http", "relay.console"))]
    assert [r.levelname for r in http] == ["INFO"] * sent, [r.getMessage() for r in http]
    assert not any(r.exc_info for r in http)
    assert all("\n" not in r.getMessage() for r in http)
