"""relay.ops.connection_cap.ConnectionCap around a real aiohttp server on loopback: a
response streamed for longer than the idle timer is not cut, a client trickling its request
is closed at the connection's lifetime, a request being answered when the lifetime runs out
still gets its answer, connections from one address are capped, and a full cap makes room
by closing silent, then idle anonymous connections, never vouched ones."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from relay.ops.connection_cap import ConnectionCap

pytestmark = pytest.mark.timeout(30)

IDLE_S, LIFETIME_S = 0.3, 0.8


@pytest.fixture
async def served() -> AsyncIterator[int]:
    """A server whose /slow streams for 1.5 s (five times the idle timer) inside busy()."""
    cap: ConnectionCap

    async def slow(request: web.Request) -> web.StreamResponse:
        with cap.busy(request.transport):
            response = web.StreamResponse()
            await response.prepare(request)
            for _ in range(15):
                await response.write(b"x" * 100)
                await asyncio.sleep(0.1)
            await response.write_eof()
            return response

    async def late(request: web.Request) -> web.StreamResponse:
        """Answered 1 s after it came: past the connection's lifetime when sent at 0.2 s."""
        with cap.busy(request.transport) as timed_out:
            await asyncio.sleep(1.0)
            response = web.Response(text="late")
            if timed_out():
                response.force_close()
            return response

    app = web.Application()
    app.router.add_get("/slow", slow)
    app.router.add_get("/late", late)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    assert runner.server is not None
    cap = ConnectionCap(runner.server, max_connections=10, idle_timeout_s=IDLE_S,
                        max_per_address=3, lifetime_s=LIFETIME_S)
    server = await asyncio.get_running_loop().create_server(cap, "127.0.0.1", 0)
    yield int(server.sockets[0].getsockname()[1])
    server.close()
    await runner.cleanup()


async def test_a_streamed_response_outlives_the_idle_timer(served: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    body = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert body.startswith(b"HTTP/1.1 200") and body.count(b"x" * 100) == 15


async def test_a_trickling_request_is_closed_at_the_lifetime(served: int) -> None:
    """One byte every 0.2 s keeps the idle timer from running out; the lifetime closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    started = time.monotonic()
    closed_after = None
    for byte in b"GET /slow HTTP/1.1\r\nHost: x\r\n":
        writer.write(bytes([byte]))
        try:
            await writer.drain()
            if await asyncio.wait_for(reader.read(1), 0.2) == b"":
                closed_after = time.monotonic() - started
                break
        except TimeoutError:
            continue
        except ConnectionError:
            closed_after = time.monotonic() - started
            break
    writer.close()
    assert closed_after is not None and LIFETIME_S - 0.1 < closed_after < LIFETIME_S + 1


async def test_connections_from_one_address_are_capped(served: int) -> None:
    """The fourth connection from 127.0.0.1 is closed at once, nothing read; once one of
    the three closes, a new one is served."""
    held = [await asyncio.open_connection("127.0.0.1", served) for _ in range(3)]
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    with contextlib.suppress(ConnectionError):
        assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    held[0][1].close()
    await asyncio.sleep(0.1)
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 200")
    writer.close()
    for _, w in held[1:]:
        w.close()


async def test_a_request_answered_when_the_lifetime_ran_out_gets_its_answer(served: int) -> None:
    """Asked at 0.2 s and answered at 1.2 s (the lifetime ran out at 0.8 s, the idle timer
    at 0.5 s): the answer comes, saying Connection: close, and then the connection closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    await asyncio.sleep(0.2)
    writer.write(b"GET /late HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"late"), answer
    assert b"Connection: close" in answer


@pytest.fixture
async def full() -> AsyncIterator[int]:
    """A server of three connections that makes room after 0.3 s: /vouch answers a request
    as one carrying a session (cap.vouch), /anon as an anonymous one."""
    cap: ConnectionCap

    async def vouch(request: web.Request) -> web.StreamResponse:
        with cap.busy(request.transport):
            cap.vouch(request.transport)
            return web.Response(text="vouched")

    async def anon(request: web.Request) -> web.StreamResponse:
        with cap.busy(request.transport):
            return web.Response(text="anonymous")

    app = web.Application()
    app.router.add_get("/vouch", vouch)
    app.router.add_get("/anon", anon)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    assert runner.server is not None
    cap = ConnectionCap(runner.server, max_connections=3, idle_timeout_s=30,
                        evict_after_s=0.3)
    server = await asyncio.get_running_loop().create_server(cap, "127.0.0.1", 0)
    yield int(server.sockets[0].getsockname()[1])
    server.close()
    await runner.cleanup()


async def ask(raw: tuple[asyncio.StreamReader, asyncio.StreamWriter], path: str) -> bytes:
    """One keep-alive request on ``raw``: the answer's body (b"" when the connection closed)."""
    reader, writer = raw
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


async def gone(raw: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> bool:
    try:
        return await asyncio.wait_for(raw[0].read(1), 0.2) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def test_a_full_cap_closes_silent_then_idle_anonymous_connections_never_vouched_ones(
        full: int) -> None:
    """At the cap, a new connection closes the one that sent no request for 0.3 s, the next
    one the anonymous connection idle that long; then, with only a vouched connection and
    young ones left, a new connection is refused and the vouched one still serves."""
    vouched = await asyncio.open_connection("127.0.0.1", full)
    anonymous = await asyncio.open_connection("127.0.0.1", full)
    silent = await asyncio.open_connection("127.0.0.1", full)
    opened = [vouched, anonymous, silent]
    try:
        assert await ask(vouched, "/vouch") == b"vouched"
        assert await ask(anonymous, "/anon") == b"anonymous"
        await asyncio.sleep(0.4)
        opened.append(await asyncio.open_connection("127.0.0.1", full))
        assert await gone(silent) and not await gone(anonymous)
        opened.append(await asyncio.open_connection("127.0.0.1", full))
        assert await gone(anonymous)
        refused = await asyncio.open_connection("127.0.0.1", full)
        opened.append(refused)
        assert await gone(refused)
        assert await ask(vouched, "/vouch") == b"vouched"
    finally:
        for _, writer in opened:
            writer.close()
