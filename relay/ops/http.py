"""The operations HTTP server on ``--metrics-listen``: ``/metrics``, ``/healthz``, ``/readyz``.

Served by aiohttp in the relay's own event loop (readiness reads the live
:class:`relay.ops.health.HealthMonitor`), or with several workers in the supervisor's (a
:class:`relay.ops.health.Readiness` over every worker, the metrics of all of them).
``/healthz`` answers 200 while the process serves; ``/readyz`` answers 200 when the store and
at least one upstream answered their last probe (and the audit ledger, when it is required),
else 503, with a JSON body naming what failed, each upstream's state by its configured name
(``upstreams``) and the ledger's (``ledger``: up or down, required, rows dropped). Readiness
that cannot be read is a 503 with a JSON body naming the error, never a 500 (the traceback
goes to the log).

It shares the relay's descriptors and event loop, so its connections are bounded: at most
:data:`MAX_CONNECTIONS` open at once (one more is closed at once, nothing read or sent), and a
connection from which no byte came for :data:`IDLE_TIMEOUT_S` is closed (a client that
connects and sends nothing, or stalls mid-request, or keeps an idle keep-alive open)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any, cast

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from relay.ops.health import Readiness

log = logging.getLogger("relay.ops.http")
MAX_CONNECTIONS = 32  # a scraper or two and probes need a few; a flood must not take fds
IDLE_TIMEOUT_S = 10.0  # below Prometheus' 15 s scrape interval: it reconnects per scrape


class _CappedConnection(asyncio.Protocol):
    """One connection under a :class:`ConnectionCap`: aiohttp's protocol behind the cap's
    counts and two timers (every call is passed on to ``inner``).

    Over the cap's total or per-address limit the connection is aborted before aiohttp sees
    it. It is aborted when no byte came for ``idle_timeout_s``, and when it has lived
    ``lifetime_s`` (a client trickling one byte at a time), unless a response is being
    streamed on it (:meth:`ConnectionCap.busy`): then both wait until the response is done.
    """

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap
        self._timer: asyncio.TimerHandle | None = None
        self._end: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self.host = ""
        self.busy = 0
        self._expired = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport subclass
        peer = tcp.get_extra_info("peername")
        self.host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self._cap.admit(self):
            tcp.abort()
            return
        self._transport = tcp
        self._restart_timer()
        if self._cap.lifetime_s is not None:
            self._end = asyncio.get_running_loop().call_later(self._cap.lifetime_s,
                                                              self._idle)
        self._inner.connection_made(transport)

    def _restart_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self._cap.idle_timeout_s,
                                                            self._idle)

    def _idle(self) -> None:
        if self.busy:
            self._expired = True  # closed once the response is done
        elif self._transport is not None:
            self._transport.abort()

    @property
    def expired(self) -> bool:
        """Whether a timer ran out while a request was answered (its response should close
        the connection once it is sent: ``Connection: close``)."""
        return self._expired

    def released(self) -> None:
        """A request was answered: the idle timer counts again (a connection whose timer ran
        out meanwhile was told to close after its response; if it is still open when the idle
        time passes again, it is aborted then)."""
        if self.busy == 0:
            self._restart_timer()

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._transport

    def data_received(self, data: bytes) -> None:
        self._restart_timer()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._cap.forget(self):  # refused over the cap: aiohttp never saw it
            return
        for timer in (self._timer, self._end):
            if timer is not None:
                timer.cancel()
        self._inner.connection_lost(exc)


class ConnectionCap:
    """A protocol factory for ``loop.create_server`` serving ``factory``'s protocols (aiohttp's
    request handler) with at most ``max_connections`` open at once, at most
    ``max_per_address`` from one client address (None: no such limit), each closed after
    ``idle_timeout_s`` seconds with no byte received and, when ``lifetime_s`` is given, after
    that many seconds in all (see :class:`_CappedConnection`)."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], *, max_connections: int,
                 idle_timeout_s: float, max_per_address: int | None = None,
                 lifetime_s: float | None = None) -> None:
        self._factory = factory
        self._max = max_connections
        self._max_per_address = max_per_address
        self.idle_timeout_s = idle_timeout_s
        self.lifetime_s = lifetime_s
        self._open: set[_CappedConnection] = set()
        self._per_address: dict[str, int] = {}

    def __call__(self) -> asyncio.Protocol:
        return _CappedConnection(self._factory(), self)

    def admit(self, connection: _CappedConnection) -> bool:
        """Count ``connection`` in, or False when it is over a limit."""
        from_host = self._per_address.get(connection.host, 0)
        if len(self._open) >= self._max or (
                self._max_per_address is not None and from_host >= self._max_per_address):
            return False
        self._open.add(connection)
        self._per_address[connection.host] = from_host + 1
        return True

    def forget(self, connection: _CappedConnection) -> bool:
        """Count ``connection`` out; False when it was never counted in."""
        if connection not in self._open:
            return False
        self._open.discard(connection)
        left = self._per_address.get(connection.host, 1) - 1
        if left > 0:
            self._per_address[connection.host] = left
        else:
            self._per_address.pop(connection.host, None)
        return True

    @contextlib.contextmanager
    def busy(self, transport: asyncio.BaseTransport | None
             ) -> Iterator[Callable[[], bool]]:
        """While the block runs (a request being answered, a response streamed for longer
        than a timer), the connection of ``transport`` is not closed for being idle or old.
        Yields a function that says whether a timer ran out meanwhile: the block's response
        should then close the connection when sent (aiohttp's ``force_close()``), instead
        of the connection being cut under it."""
        connection = next((c for c in self._open if c.transport is transport), None)
        if connection is None:
            yield lambda: False
            return
        connection.busy += 1
        try:
            yield lambda: connection.expired
        finally:
            connection.busy -= 1
            connection.released()


class CappedSite:
    """An aiohttp application served on TCP behind a :class:`ConnectionCap`: ``await
    start()``, then ``await stop()``. ``sock``: a socket already bound (to host:port), served
    instead of binding; ``tls``: serve HTTPS, each handshake within ``handshake_timeout_s``;
    ``shutdown_timeout_s``: how long aiohttp lets running requests finish at stop (it waits
    that long twice); ``limits``: the cap's keyword arguments."""

    def __init__(self, app: web.Application, *, host: str, port: int,
                 sock: socket.socket | None = None, tls: ssl.SSLContext | None = None,
                 handshake_timeout_s: float = 10.0, shutdown_timeout_s: float = 60.0,
                 **limits: Any) -> None:
        self._app = app
        self._host, self._port, self._sock = host, port, sock
        self._tls, self._handshake_timeout_s = tls, handshake_timeout_s
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s)
        self._limits = limits
        self._server: asyncio.Server | None = None
        self.cap: ConnectionCap | None = None
        self.port = 0

    async def start(self) -> None:
        """Bind (unless given a socket) and serve; ``port`` is the bound port afterwards
        (``0`` picks a free one). Raises OSError when the address cannot be bound."""
        await self._runner.setup()
        assert self._runner.server is not None  # set by setup()
        factory = self.cap = ConnectionCap(self._runner.server, **self._limits)
        loop = asyncio.get_running_loop()
        handshake_s = self._handshake_timeout_s if self._tls is not None else None
        if self._sock is None:
            self._server = await loop.create_server(factory, self._host, self._port,
                                                    ssl=self._tls,
                                                    ssl_handshake_timeout=handshake_s)
        else:
            self._server = await loop.create_server(factory, sock=self._sock, ssl=self._tls,
                                                    ssl_handshake_timeout=handshake_s)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting, then close the open connections (aiohttp's shutdown)."""
        if self._server is not None:
            self._server.close()
        await self._runner.cleanup()


class OpsServer:
    """aiohttp server for metrics and health; ``await start()``, then ``await stop()``."""

    def __init__(self, *, registry: CollectorRegistry, health: Readiness | None,
                 host: str, port: int, sock: socket.socket | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        """``sock``: a socket already bound (to host:port), served instead of binding;
        ``max_connections`` and ``idle_timeout_s`` (seconds) bound its connections."""
        self._registry = registry
        self._health = health
        self._site = CappedSite(self._app(), host=host, port=port, sock=sock,
                                max_connections=max_connections, idle_timeout_s=idle_timeout_s)
        self.port = 0

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        return app

    async def start(self) -> None:
        """Bind and serve; ``port`` is the bound port afterwards (``0`` picks a free one)."""
        await self._site.start()
        self.port = self._site.port

    async def stop(self) -> None:
        """Stop accepting, then close the open connections (aiohttp's shutdown)."""
        await self._site.stop()

    async def _metrics(self, request: web.Request) -> web.Response:
        """The registry in the format the scraper asks for: OpenMetrics when its ``Accept``
        names ``application/openmetrics-text``, else Prometheus's text format 0.0.4."""
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(self._registry), headers={"Content-Type": content_type})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self._health is None:
            return web.json_response({"ready": False, "error": "not started"}, status=503)
        try:
            return self._readiness(self._health)
        except Exception as exc:  # a health endpoint answers, whatever failed in reading it
            log.exception("readiness could not be read")
            return web.json_response({"ready": False, "error": (
                f"readiness could not be read: {type(exc).__name__}: {exc}")[:300]},
                status=503)

    @staticmethod
    def _readiness(health: Readiness) -> web.Response:
        components = {name: asdict(s) for name, s in health.status().items()}
        ready = health.ready
        body: dict[str, object] = {"ready": ready, "components": components}
        upstreams = health.upstreams()
        if upstreams:
            body["upstreams"] = upstreams
        ledger = health.ledger()
        if ledger:  # down and not required: ready, but the body says rows are being dropped
            body["ledger"] = ledger
        return web.json_response(body, status=200 if ready else 503)
