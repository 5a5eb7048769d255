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

It shares the relay's descriptors and event loop, so its connections are bounded
(:class:`relay.ops.connection_cap.ConnectionCap`): at most :data:`MAX_CONNECTIONS` open at
once, counted at accept (one more is closed at once, nothing read or sent), and a connection
from which no byte came for :data:`IDLE_TIMEOUT_S` is closed (a client that connects and
sends nothing, or stalls mid-request, or keeps an idle keep-alive open). A request that is
not HTTP aiohttp can parse is answered ``400`` and logged as one INFO line, no traceback
(:class:`RequestErrors`)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from relay.ops.connection_cap import ConnectionCap, Handshake
from relay.ops.health import Readiness

log = logging.getLogger("relay.ops.http")
MAX_CONNECTIONS = 32  # a scraper or two and probes need a few; a flood must not take fds
IDLE_TIMEOUT_S = 10.0  # below Prometheus' 15 s scrape interval: it reconnects per scrape
_SHOWN_CHARS = 120  # of a parse error's first line in the log


class RequestErrors(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log (``aiohttp.server``) as an aiohttp server behind a
    :class:`CappedSite` writes it: a request aiohttp could not parse (a malformed request
    line, header or body framing: ``HttpProcessingError``, answered ``400`` by aiohttp) is
    one INFO line of ``relay.ops.http`` naming the peer and the first line of the parser's
    reason, no traceback; any other error is logged as aiohttp logs it (ERROR, with its
    traceback: a fault of the relay's)."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._refusals = logging.getLogger("relay.ops.http")

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            reason = (exc_info.message or "").strip().splitlines() or [type(exc_info).__name__]
            self._refusals.info("HTTP request refused (%s): %s", exc_info.code,
                                reason[0][:_SHOWN_CHARS].rstrip(":"),
                                extra={"peer": args[0] if args else None})
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return msg, kwargs


class CappedSite:
    """An aiohttp application served on TCP behind a :class:`ConnectionCap`: ``await
    start()``, then ``await stop()``. ``sock``: a socket already bound (to host:port), served
    instead of binding; ``handshake``: serve HTTPS, TLS started on each connection once the
    cap counted it (:class:`ConnectionCap`); ``shutdown_timeout_s``: how long aiohttp lets
    running requests finish at stop (it waits that long twice); ``limits``: the cap's other
    keyword arguments."""

    def __init__(self, app: web.Application, *, host: str, port: int,
                 sock: socket.socket | None = None, handshake: Handshake | None = None,
                 shutdown_timeout_s: float = 60.0, **limits: Any) -> None:
        self._app = app
        self._host, self._port, self._sock = host, port, sock
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout_s,
                                     logger=RequestErrors())
        self._limits: Mapping[str, Any] = {**limits, "handshake": handshake}
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
        if self._sock is None:
            self._server = await loop.create_server(factory, self._host, self._port)
        else:
            self._server = await loop.create_server(factory, sock=self._sock)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting, end the handshakes still running, then close the open
        connections (aiohttp's shutdown)."""
        if self._server is not None:
            self._server.close()
        if self.cap is not None:
            self.cap.cancel_handshakes()
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
