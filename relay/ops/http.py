"""The operations HTTP server on ``--metrics-listen``: ``/metrics``, ``/healthz``, ``/readyz``.

Served by aiohttp in the relay's own event loop (readiness reads the live
:class:`relay.ops.health.HealthMonitor`), or with several workers in the supervisor's (a
:class:`relay.ops.health.Readiness` over every worker, the metrics of all of them).
``/healthz`` answers 200 while the process serves; ``/readyz`` answers 200 when the store and
at least one upstream answered their last probe (and the audit ledger, when it is required),
else 503, with a JSON body naming what failed, each upstream's state by its configured name
(``upstreams``) and the ledger's (``ledger``: up or down, required, rows dropped)."""

from __future__ import annotations

import socket
from dataclasses import asdict

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from relay.ops.health import Readiness


class OpsServer:
    """aiohttp server for metrics and health; ``await start()``, then ``await stop()``."""

    def __init__(self, *, registry: CollectorRegistry, health: Readiness | None,
                 host: str, port: int, sock: socket.socket | None = None) -> None:
        """``sock``: a socket already bound (to host:port), served instead of binding."""
        self._sock = sock
        self._registry = registry
        self._health = health
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.port = 0

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        return app

    async def start(self) -> None:
        """Bind and serve; ``port`` is the bound port afterwards (``0`` picks a free one)."""
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        site: web.BaseSite = (web.TCPSite(self._runner, self._host, self._port)
                              if self._sock is None else web.SockSite(self._runner, self._sock))
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self._health is None:
            return web.json_response({"ready": False, "error": "not started"}, status=503)
        components = {name: asdict(s) for name, s in self._health.status().items()}
        ready = self._health.ready
        body: dict[str, object] = {"ready": ready, "components": components}
        upstreams = self._health.upstreams()
        if upstreams:
            body["upstreams"] = upstreams
        ledger = self._health.ledger()
        if ledger:  # down and not required: ready, but the body says rows are being dropped
            body["ledger"] = ledger
        return web.json_response(body, status=200 if ready else 503)
