"""The servers a supervisor hosts for the whole relay (design.md §8): ``/metrics`` (every
worker's, prometheus-client multiprocess mode, in a private temporary directory removed at
the end), ``/healthz`` and ``/readyz`` on ``metrics_listen``, and the console on
``console_listen`` (one for every worker, on its own store client). Both ports are bound
before the workers start and served once worker 0 serves.

The metrics server and the console (aiohttp, and the console's pages) are imported when the
settings turn them on: a supervisor with both off starts without them (0.2 s of CPU less)."""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from relay.core.errors import ConfigError, StartupError, StoreError
from relay.listen import bound_socket
from relay.ops.health import Readiness
from relay.ops.metrics import workers_registry
from relay.settings import Settings, host_port

if TYPE_CHECKING:
    from relay.console.server import Console
    from relay.ops.http import OpsServer

log = logging.getLogger("relay.supervisor")


class HostedServers:
    """The metrics server and the console of a supervisor: :meth:`bind`, :meth:`start`,
    :meth:`stop`, :meth:`remove_files`."""

    def __init__(self) -> None:
        self.metrics_dir: str | None = None  # the workers' PROMETHEUS_MULTIPROC_DIR
        self.metrics_port = 0  # the bound one (0: metrics off)
        self.registry: CollectorRegistry | None = None  # the metrics server's (metrics on)
        self.console: Console | None = None
        self._ops: OpsServer | None = None
        self._console_sock: socket.socket | None = None

    def bind(self, settings: Settings, health: Readiness,
             worker_pids: Callable[[], dict[int, int]]) -> None:
        """Bind the metrics port (``health``: what ``/readyz`` reads; ``worker_pids``: each
        live worker's pid by index) and make the multiprocess directory, then bind the
        console's port; neither serves yet. Raises :class:`StartupError` naming the setting."""
        if settings.metrics_address is not None:
            from relay.ops.http import OpsServer

            host, port = settings.metrics_address
            sock = bound_socket(host, port, "metrics_listen")
            self.metrics_dir = tempfile.mkdtemp(prefix="dedup-relay-metrics-")
            self.registry = workers_registry(self.metrics_dir, worker_pids)
            self._ops = OpsServer(registry=self.registry, health=health, host=host, port=port,
                                  sock=sock)
            self.metrics_port = int(sock.getsockname()[1])
        if settings.console_address is not None:
            self._console_sock = bound_socket(*settings.console_address, "console_listen")

    async def start(self, settings: Settings) -> bool:
        """Serve /metrics, /healthz and /readyz, and the console on ``settings``. False when
        the console cannot start (logged: the relay stops, exit 69)."""
        if self._ops is not None:
            await self._ops.start()
        if self._console_sock is None:
            return True
        from relay.console.server import Console

        try:
            self.console = Console(settings, store=None, registry=self.registry,
                                   sock=self._console_sock)
            await self.console.start()
        except (ConfigError, StartupError, StoreError, OSError) as exc:
            log.error("cannot start the console: %s", exc)
            return False
        return True

    async def reload(self, settings: Settings, applied: frozenset[str]) -> None:
        """Hand a configuration reload to the console (``applied``: the settings changed
        live); a console that refuses it keeps its settings (logged)."""
        if self.console is None:
            return
        try:
            await self.console.reload(settings, applied)
        except ConfigError as exc:  # checked by the reload's prepare(): a file changed since
            log.error("console not reloaded: %s", exc)

    def describe(self, settings: Settings) -> str:
        """``metrics HOST:PORT`` (or ``metrics off``) and the console's state, for the
        supervisor's start-up line."""
        metrics = "off"
        if self._ops is not None and settings.metrics_address is not None:
            metrics = host_port(settings.metrics_address[0], self.metrics_port)
        console = "console off" if self.console is None else self.console.describe()
        return f"metrics {metrics}, {console}"

    async def stop(self) -> None:
        """Stop the metrics server and the console (or close its socket, never served)."""
        if self._ops is not None:
            await self._ops.stop()
        if self.console is not None:
            await self.console.stop()
        elif self._console_sock is not None:
            self._console_sock.close()

    def remove_files(self) -> None:
        """Remove the multiprocess metrics directory."""
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
