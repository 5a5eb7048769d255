"""Several worker processes on shared listening sockets (``workers`` > 1; design.md §8).

The supervisor binds ``listen`` (and ``tls_listen``) once; every worker inherits the same
sockets (one accept queue per listener: a worker that dies strands no queued connection) and
runs its own event loop, store client and upstream pool (:class:`relay.app.Relay` on
:class:`relay.listen.Inherited` sockets). Worker 0 starts first, alone: a start-up error (the
store, a setting found wrong only then) is reported once, by it, with its exit code (69, 78);
the others start when it serves. Every worker pays the settle journal at each of its starts
(worker 0 first) and appends what it owes when it becomes owed (the journal's lock keeps them
from losing each other's lines).

The supervisor restarts a worker that exits on its own (back-off from 0.5 s doubling to 30 s;
reset after a minute of serving); a worker that cannot start 5 times in a row, or exits 69/78
before it served, ends the relay with that code (69 otherwise). SIGTERM and SIGINT are
forwarded to every worker and the supervisor waits for their graceful shutdown (up to
``shutdown_grace`` + 5 s for replies to final dots + 4 store timeouts + 10 s, then SIGKILL).
SIGHUP reloads the configuration (:mod:`relay.reload`): the supervisor reads and checks the
file, and refuses it (one ERROR line, nothing changed) or forwards SIGHUP to every worker,
which applies the same file and confirms on its status pipe; the supervisor then logs one INFO
line for the whole relay and counts the reload (``relay_config_reloads_total``, in its own
registry). Reloads run one at a time; one
asked for during start-up runs once the relay serves. The supervisor serves ``/metrics``
(every worker's, prometheus-client multiprocess mode, in a private temporary directory it
removes at exit), ``/healthz`` and ``/readyz`` (ready when every worker serves and every
worker's last store and upstream probe answered).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from setproctitle import setproctitle

from relay.console.server import Console
from relay.core.cancellation import AFTER_DOT_WAIT_S
from relay.core.errors import ConfigError, StartupError, StoreError
from relay.listen import Inherited, Listeners, bind_error, bind_listeners
from relay.ops.health import ComponentStatus
from relay.ops.http import OpsServer
from relay.ops.logs import set_level, setup_logging
from relay.ops.metrics import (
    ConfigReloadMetrics,
    components_up,
    ledger_totals,
    upstreams_up,
    worker_gone,
    workers_registry,
)
from relay.ops.notify import keep_watchdog, notify, watchdog_interval_s
from relay.ops.pidfile import remove_pid_file, write_pid_file
from relay.reload import (
    Reloader,
    SettingsSource,
    SnapshotSource,
    one_line,
    worker_hangup,
    write_snapshot,
)
from relay.serving import run
from relay.settings import Settings, host_port

log = logging.getLogger("relay.supervisor")

WORKER_ENV = "DEDUP_RELAY_WORKER"  # JSON: index and the inherited descriptors of one worker
EX_UNAVAILABLE = 69  # sysexits.h, as relay.cli.exit_codes.ExitCode.UNAVAILABLE
EX_CONFIG = 78  # as ExitCode.CONFIG
START_ERRORS = (EX_UNAVAILABLE, EX_CONFIG)
MAX_START_FAILURES = 5
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 60.0  # a worker that served this long restarts at the first back-off again
FORWARDED = (signal.SIGTERM, signal.SIGINT)
RELOAD_CONFIRM_S = 10.0  # how long the supervisor waits for its workers to apply a reload
# A worker's first lines, before the relay's imports: it dies with its supervisor (Linux
# PR_SET_PDEATHSIG: a supervisor killed with SIGKILL takes its workers along, as one process
# would, instead of leaving them on the port; gone already: exit); a stop signal or a SIGHUP
# forwarded while it still imports is kept, and handled once its loop runs.
_WORKER_COMMAND = (
    "import ctypes, os, signal; early = []\n"
    "try: ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"  # 1: PR_SET_PDEATHSIG
    "except (OSError, AttributeError): pass\n"
    "if os.getppid() != {supervisor}: os._exit(1)\n"
    "for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
    "    signal.signal(sig, lambda n, _: early.append(n))\n"
    # started with SIGHUP blocked (spawn_worker): one that came meanwhile is delivered now
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGHUP}})\n"
    "from relay.supervisor import worker_main; worker_main(early)")


# uvloop when it imports (a dependency); the transports are duck-typed since e8b2dfc (the
# upstream transfer's checks and write backlog hold on both loops). False: asyncio's loop.
USE_UVLOOP = True


def loop_factory(*, uvloop_wanted: bool = USE_UVLOOP, required: bool = False) -> Any:
    """The event loop constructor: ``uvloop.new_event_loop`` when ``uvloop_wanted`` and uvloop
    imports, else None (asyncio's default loop). Raises
    :class:`relay.core.errors.StartupError` when ``required`` and uvloop does not import."""
    if not uvloop_wanted:
        return None
    try:
        import uvloop
    except ImportError as exc:
        if required:
            raise StartupError(f"event_loop = uvloop, but uvloop does not import ({exc})") from exc
        return None
    return uvloop.new_event_loop


def run_loop(main: Coroutine[Any, Any, Any], *, uvloop_wanted: bool = USE_UVLOOP,
             required: bool = False) -> Any:
    """Run ``main`` to its end on a new event loop from :func:`loop_factory`; its result."""
    try:
        factory = loop_factory(uvloop_wanted=uvloop_wanted, required=required)
    except StartupError:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def run_loop_for(settings: Settings, main: Coroutine[Any, Any, Any]) -> Any:
    """:func:`run_loop` on the loop ``settings.event_loop`` names (auto: uvloop when it
    imports). Raises StartupError for ``uvloop`` without uvloop."""
    return run_loop(main, uvloop_wanted=settings.event_loop != "asyncio",
                    required=settings.event_loop == "uvloop")


@dataclass
class _Worker:
    """One worker slot: its current process, whether it served, its restart state."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    serving: bool = False
    since: float = 0.0  # monotonic time it started serving
    start_failures: int = 0
    backoff_s: float = BACKOFF_FIRST_S
    served: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    reloads: int = 0  # reloads its processes confirmed on the status pipe (applied or not)
    reload_ok: bool = True  # whether the last one was applied


class WorkersReadiness:
    """``/readyz`` of the supervisor: every worker serves and the live workers' last probes of
    the store and the upstream answered (``relay_component_up``, livemin)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def status(self) -> dict[str, ComponentStatus]:
        """``store``, ``upstream`` and ``workers`` (how many of N serve)."""
        now = time.time()
        sup = self._supervisor
        up = components_up(sup.metrics_dir) if sup.metrics_dir is not None else {}
        result = {name: ComponentStatus(
            up.get(name) == 1.0, None if up.get(name) == 1.0
            else "not answering in at least one worker", now) for name in ("store", "upstream")}
        if sup.settings.ledger is not None and "ledger" in up:
            result["ledger"] = ComponentStatus(
                up["ledger"] == 1.0, None if up["ledger"] == 1.0
                else "not writable in at least one worker", now)
        missing = [w.index for w in sup.workers if not w.serving]
        result["workers"] = ComponentStatus(
            not missing, f"worker(s) {missing} not serving" if missing else None, now)
        return result

    @property
    def ready(self) -> bool:
        """True when every worker serves and every component answered in every worker (the
        audit ledger only when it is required)."""
        required = self._supervisor.settings.ledger_required
        return all(s.ok for name, s in self.status().items()
                   if name != "ledger" or required)

    def ledger(self) -> dict[str, object]:
        """The audit ledger over the workers: ``state`` (``up`` in every live worker, else
        ``down``), ``required``, the rows ``queued`` in them and ``dropped`` by all of them;
        {} without one."""
        sup = self._supervisor
        if sup.settings.ledger is None or sup.metrics_dir is None:
            return {}
        up = components_up(sup.metrics_dir).get("ledger")
        dropped, queued = ledger_totals(sup.metrics_dir)
        return {"state": "up" if up in (None, 1.0) else "down",
                "required": sup.settings.ledger_required, "queued": queued,
                "dropped": dropped}

    def upstreams(self) -> dict[str, dict[str, object]]:
        """Each upstream by name: ``ready`` when it is in every live worker
        (``relay_upstream_up``, livemin), else ``not ready in at least one worker``."""
        sup = self._supervisor
        up = upstreams_up(sup.metrics_dir) if sup.metrics_dir is not None else {}
        return {name: {"state": "ready" if value == 1.0 else
                       "not ready in at least one worker"} for name, value in up.items()}


class Supervisor:
    """Starts ``count`` workers on shared sockets and keeps them running until a signal;
    ``await run()`` returns the exit code."""

    def __init__(self, settings: Settings, count: int, source: SettingsSource | None = None
                 ) -> None:
        self.settings = settings
        self.count = count
        self.source = source
        self._reloader = Reloader(source, settings) if source is not None else None
        # the settings a reload read and checked, for the workers to apply (SnapshotSource);
        # in a private directory made by run()
        self._snapshot_dir: str | None = None
        self.snapshot = Path("/nonexistent/dedup-relay-reload-snapshot")
        self.reloads = ConfigReloadMetrics(registry=None)  # metrics on: _bind_ops's registry
        self._hangups: asyncio.Queue[None] = asyncio.Queue()
        self._confirmed = asyncio.Condition()
        self.workers = [_Worker(i) for i in range(count)]
        self.metrics_dir: str | None = None
        self.metrics_port = 0
        self._listeners: Listeners | None = None
        self._ops: OpsServer | None = None
        self._registry: CollectorRegistry | None = None  # the ops server's (metrics on)
        self._console_sock: socket.socket | None = None
        self.console: Console | None = None
        self._stopping = asyncio.Event()
        self._signal: int | None = None
        self._give_up: int | None = None
        self._codes: list[int] = []
        self._tasks: list[asyncio.Task[None]] = []

    def _worker_settings(self, settings: Settings | None = None) -> Settings:
        """A worker's settings (``settings``, default the running ones): its share of
        ``max_connections`` (rounded up), the rest alike."""
        settings = self.settings if settings is None else settings
        share = -(-settings.max_connections // self.count)
        # as plain Settings: those read with --config are of a class made for the file, which
        # pickle cannot name (the worker got no settings: `serve --config F --workers 2` hung)
        return Settings.model_construct(**{**dict(settings), "max_connections": share})

    async def run(self) -> int:
        """Bind, start the workers, supervise until SIGTERM/SIGINT, stop them; returns the exit
        code. Raises :class:`StartupError` when a listener cannot be bound."""
        loop = asyncio.get_running_loop()
        for sig in FORWARDED:
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._hangups.put_nowait, None)
        pid_file = Path(self.settings.pid_file) if self.settings.pid_file else None
        reloads: asyncio.Task[None] | None = None
        announced: asyncio.Task[None] | None = None
        setproctitle("dedup-relay: supervisor")  # ps, top; `reload` knows the title too
        self._snapshot_dir = tempfile.mkdtemp(prefix="dedup-relay-reload-")
        self.snapshot = Path(self._snapshot_dir) / "settings.pickle"
        try:
            self._listeners = await bind_listeners(self.settings)
            self._bind_ops()
            self._console_sock = self._bind_console()
            self._tasks = [asyncio.create_task(self._keep(w)) for w in self.workers]
            await self._await_first_start()
            if not self._stopping.is_set() and self.workers[0].served.is_set():
                await self._start_ops()  # serves last, as one process's
                self._log_started()
                _write_pid(pid_file)
                reloads = asyncio.create_task(self._serve_hangups())
                announced = asyncio.create_task(self._announce_ready())
            await self._stopping.wait()
            notify("STOPPING=1")
            if reloads is not None:
                reloads.cancel()
            await self._stop_workers()
        finally:
            for task in (reloads, announced):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await self._cleanup()
            for sig in (*FORWARDED, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            if pid_file is not None:
                remove_pid_file(pid_file)
        if self._give_up is not None:
            return self._give_up
        return next((c for c in self._codes if c > 0), 0)

    async def _announce_ready(self) -> None:
        """Tell systemd the relay serves (``Type=notify``) once every worker serves, then keep
        its watchdog (``WatchdogSec``) until cancelled."""
        await asyncio.gather(*(w.served.wait() for w in self.workers))
        notify("READY=1", f"STATUS=serving with {self.count} workers")
        interval = watchdog_interval_s()
        if interval is not None:
            await keep_watchdog(interval)

    async def _serve_hangups(self) -> None:
        """One configuration reload per SIGHUP (those of the start-up too), one at a time."""
        while True:
            await self._hangups.get()
            try:
                await self._reload()
            except Exception:
                log.exception("configuration reload failed")

    async def _reload(self) -> None:
        """Read and check the configuration again; refused: one ERROR line, nothing changed;
        else forward SIGHUP to every worker, wait for them to confirm (up to
        :data:`RELOAD_CONFIRM_S`), log one INFO line and count it."""
        if self._reloader is None:
            log.error("configuration reload refused: this relay was not started by "
                      "`dedup-relay serve` (no configuration to read again)")
            self.reloads.reloaded(applied=False, now=time.time())
            return
        log.debug("SIGHUP: reading the settings again from %s",
                  self._reloader.source.describe())
        try:
            changes = await asyncio.to_thread(self._reloader.prepare)
        except ConfigError as exc:
            log.error("configuration reload refused: %s", one_line(exc))
            self.reloads.reloaded(applied=False, now=time.time())
            return
        try:  # every worker applies this one reading, not the file as it is when it looks
            await asyncio.to_thread(write_snapshot, self.snapshot, self._worker_settings(
                changes.merged))
        except OSError as exc:
            log.error("configuration reload refused: cannot hand the settings to the workers "
                      "(%s)", exc)
            self.reloads.reloaded(applied=False, now=time.time())
            return
        self._reloader.commit(changes)
        self.settings = changes.merged  # a worker started from now on gets these
        set_level(changes.merged.log_level)
        if self.console is not None:
            try:
                await self.console.reload(changes.merged, frozenset(changes.applied))
            except ConfigError as exc:  # checked by prepare(): a file changed since
                log.error("console not reloaded: %s", exc)
        missing = await self._forward_reload()
        if missing:  # they keep the rules they had: the relay is split until they apply it
            log.error("configuration reload partly applied: %s; worker(s) %s did not apply it "
                      "(see their log; send SIGHUP again)", changes.describe(),
                      ", ".join(map(str, missing)))
            self.reloads.reloaded(applied=False, now=time.time(), partial=True)
            return
        log.info("configuration reloaded: %s", changes.describe())
        self.reloads.reloaded(applied=True, now=time.time())

    async def _forward_reload(self) -> list[int]:
        """SIGHUP every live worker process; wait until each serving one confirmed it. The
        indexes of the serving workers that did not apply it (failed, or silent too long)."""
        before = {w.index: w.reloads for w in self.workers}
        waiting = []
        for worker in self.workers:
            if worker.proc is not None and worker.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(signal.SIGHUP)
                if worker.serving:  # one still starting applies it once it serves
                    waiting.append(worker)

        def done() -> bool:
            return all(w.reloads > before[w.index] or not w.serving for w in waiting)

        async with self._confirmed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._confirmed.wait_for(done), RELOAD_CONFIRM_S)
        return [w.index for w in waiting
                if w.serving and (w.reloads <= before[w.index] or not w.reload_ok)]

    async def _await_first_start(self) -> None:
        """Worker 0 serves (then the others start), the relay stops, or worker 0 ended."""
        waits = {asyncio.create_task(self.workers[0].served.wait()),
                 asyncio.create_task(self._stopping.wait()),
                 asyncio.create_task(self.workers[0].ended.wait())}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()

    def _log_started(self) -> None:
        listeners = self._listeners
        assert listeners is not None
        metrics = "off"
        if self._ops is not None and self.settings.metrics_address is not None:
            metrics = host_port(self.settings.metrics_address[0], self.metrics_port)
        log.info("supervisor %d: %d workers on SMTP port %d, metrics %s, %s", os.getpid(),
                 self.count, listeners.port, metrics,
                 "console off" if self.console is None else self.console.describe())

    def _bind_ops(self) -> None:
        """Bind the metrics port (not listening yet: :meth:`_start_ops` serves it once worker 0
        serves) and make the multiprocess directory. Raises :class:`StartupError`."""
        s = self.settings
        if s.metrics_address is None:
            return
        host, port = s.metrics_address
        sock = _bound(host, port, "metrics_listen")
        self.metrics_dir = tempfile.mkdtemp(prefix="dedup-relay-metrics-")
        registry = self._registry = workers_registry(self.metrics_dir, self._worker_pids)
        self.reloads = ConfigReloadMetrics(registry=registry)  # once per reload, not per worker
        self._ops = OpsServer(registry=registry, health=WorkersReadiness(self), host=host,
                              port=port, sock=sock)
        self.metrics_port = int(sock.getsockname()[1])

    def _worker_pids(self) -> dict[int, int]:
        """Each live worker's pid by its index (the metrics of every worker)."""
        return {w.index: w.proc.pid for w in self.workers
                if w.proc is not None and w.proc.poll() is None}

    async def _stop_ops(self) -> None:
        """Stop the metrics server and the console (or close its socket, never served)."""
        if self._ops is not None:
            await self._ops.stop()
        if self.console is not None:
            await self.console.stop()
        else:
            _unused(self._console_sock)

    def _bind_console(self) -> socket.socket | None:
        """Bind the console's port (served by :meth:`_start_ops` once worker 0 serves), None
        without a console. Raises :class:`StartupError`."""
        address = self.settings.console_address
        return None if address is None else _bound(*address, "console_listen")

    async def _start_ops(self) -> None:
        """Serve /metrics, /healthz and /readyz on the bound metrics socket, and the console
        (one for every worker, on its own store client). A console that cannot start stops
        the relay (exit 69), gracefully."""
        if self._ops is not None:
            await self._ops.start()
        if self._console_sock is None:
            return
        try:
            self.console = Console(self.settings, store=None, registry=self._registry,
                                   sock=self._console_sock)
            await self.console.start()
        except (ConfigError, StartupError, StoreError, OSError) as exc:
            log.error("cannot start the console: %s", exc)
            self._give_up = EX_UNAVAILABLE
            self._on_signal(signal.SIGTERM)

    def _on_signal(self, sig: int) -> None:
        self._signal = sig
        self._stopping.set()
        if self._listeners is not None:  # the workers close theirs: the port is closed
            self._listeners.close()
        for worker in self.workers:
            if worker.proc is not None and worker.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.send_signal(sig)

    async def _keep(self, worker: _Worker) -> None:
        """Run ``worker``'s process, restarting it, until the relay stops."""
        if worker.index > 0:
            await self._await_first_start()
        while not self._stopping.is_set():
            code = await self._run_once(worker)
            if self._stopping.is_set():
                self._codes.append(code)
                break
            if not self._restart_wanted(worker, code):
                self._stopping.set()
                self._on_signal(signal.SIGTERM)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), worker.backoff_s)
            worker.backoff_s = min(BACKOFF_MAX_S, worker.backoff_s * 2)
        worker.ended.set()

    def _restart_wanted(self, worker: _Worker, code: int) -> bool:
        """Log the exit of ``worker``; False when the relay must give up (start errors)."""
        if worker.serving:
            ran_s = time.monotonic() - worker.since
            worker.serving = False
            worker.start_failures = 0
            if ran_s > BACKOFF_RESET_S:
                worker.backoff_s = BACKOFF_FIRST_S
            log.error("worker %d exited (%s) after %.1f s: restarting in %.1f s",
                      worker.index, _exit_text(code), ran_s, worker.backoff_s)
            return True
        worker.start_failures += 1
        if code in START_ERRORS or worker.start_failures >= MAX_START_FAILURES:
            self._give_up = code if code in START_ERRORS else EX_UNAVAILABLE
            if code not in START_ERRORS or worker.index > 0 or worker.start_failures > 1:
                log.error("worker %d could not start (%s, %d time(s)): giving up",
                          worker.index, _exit_text(code), worker.start_failures)
            return False
        log.error("worker %d exited before serving (%s): restarting in %.1f s",
                  worker.index, _exit_text(code), worker.backoff_s)
        return True

    async def _run_once(self, worker: _Worker) -> int:
        """Start ``worker``'s process, follow it until it exits; its exit code (negative: the
        signal that ended it)."""
        listeners = self._listeners
        assert listeners is not None
        settings_r, settings_w = os.pipe()
        status_r, status_w = os.pipe()
        spec = {"index": worker.index, "listen": listeners.listen,
                "tls_listen": listeners.tls_listen, "settings": settings_r, "status": status_w,
                "metrics_port": self.metrics_port, "reload_snapshot": str(self.snapshot)}
        env = dict(os.environ, **{WORKER_ENV: json.dumps(spec)})
        if self.metrics_dir is not None:
            env["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir
        try:
            proc = spawn_worker(
                [sys.executable, "-c", _WORKER_COMMAND.format(supervisor=os.getpid())],
                env=env, pass_fds=(*listeners.listen, *listeners.tls_listen, settings_r,
                                   status_w))
        finally:
            os.close(settings_r)
            os.close(status_w)
        worker.proc = proc
        if self._signal is not None:  # came while it was being spawned
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(self._signal)
        # a worker that died at once (BrokenPipeError): its exit code tells why
        with contextlib.suppress(BrokenPipeError), os.fdopen(settings_w, "wb") as out:
            payload = pickle.dumps((self._worker_settings(), self.source))
            await asyncio.to_thread(out.write, payload)
        reader = asyncio.create_task(self._read_status(worker, status_r))
        code = await exited(proc)
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        if self.metrics_dir is not None:
            worker_gone(self.metrics_dir, proc.pid)
        return code

    async def _read_status(self, worker: _Worker, fd: int) -> None:
        """Follow ``worker``'s status pipe until its process exits: ``serving`` marks it
        serving; ``reloaded`` / ``reload failed`` confirm a configuration reload."""
        reader = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
        try:
            while line := await reader.readline():
                status = line.strip()
                if status == b"serving":
                    worker.serving = True
                    worker.since = time.monotonic()
                    worker.served.set()
                elif status in (b"reloaded", b"reload failed"):
                    async with self._confirmed:
                        worker.reloads += 1
                        worker.reload_ok = status == b"reloaded"
                        self._confirmed.notify_all()
        finally:
            transport.close()

    async def _stop_workers(self) -> None:
        """Wait for every worker's graceful shutdown; SIGKILL what outlives its bound."""
        s = self.settings
        bound_s = s.shutdown_grace + AFTER_DOT_WAIT_S + 4 * s.store_timeout + 10.0
        try:
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), bound_s)
        except TimeoutError:
            for worker in self.workers:
                if worker.proc is not None and worker.proc.returncode is None:
                    log.error("worker %d did not stop within %.0f s: killed", worker.index,
                              bound_s)
                    with contextlib.suppress(ProcessLookupError):
                        worker.proc.kill()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _cleanup(self) -> None:
        for task in self._tasks:
            if not task.done():
                task.cancel()
        for worker in self.workers:
            if worker.proc is not None and worker.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
                await exited(worker.proc)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._stop_ops()
        if self._listeners is not None:
            self._listeners.close()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        if self._snapshot_dir is not None:
            shutil.rmtree(self._snapshot_dir, ignore_errors=True)


def _unused(sock: socket.socket | None) -> None:
    if sock is not None:
        sock.close()


def _bound(host: str, port: int, setting: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet). Raises :class:`StartupError`
    naming ``setting``."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        raise bind_error(host, port, setting, exc) from exc
    return sock


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"


def _write_pid(path: Path | None) -> None:
    """Write this process's id to the pid file ``path`` (None: none); an error is logged."""
    if path is None:
        return
    try:
        write_pid_file(path)
    except OSError as exc:
        log.error("cannot write the pid file %s: %s (`dedup-relay reload` needs --pid)",
                  path, exc)


def spawn_worker(args: list[str], *, env: dict[str, str], pass_fds: tuple[int, ...]
                 ) -> subprocess.Popen[bytes]:
    """Start a worker process (``args``, stdin from /dev/null) with SIGHUP blocked until its
    handler is set: until then SIGHUP's default action would end it, and a reload (or a
    SIGHUP to the process group) while it starts would count as a failed start. The mask is
    set for this thread around the fork and survives ``execve(2)``; the worker unblocks it
    (:data:`_WORKER_COMMAND`), and a SIGHUP that came meanwhile is delivered then.

    subprocess, not the event loop's spawn: libuv (uvloop) empties the child's signal mask.
    Raises OSError when the process cannot be started."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        # args: this interpreter and the relay's own worker command
        return subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL,  # noqa: S603
                                pass_fds=pass_fds)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


async def exited(proc: subprocess.Popen[bytes]) -> int:
    """Wait, without blocking the event loop, until ``proc`` exits; its exit code (negative:
    the signal that ended it). Waits on a pidfd (Linux >= 5.3), else in a thread."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return await asyncio.to_thread(proc.wait)
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await gone
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return proc.wait()


async def supervise(settings: Settings, source: SettingsSource | None = None) -> int:
    """Run ``settings.effective_workers`` workers under a :class:`Supervisor`; the exit code.
    ``source``: where the settings came from, read again on SIGHUP. Raises
    :class:`StartupError` when a listener cannot be bound."""
    return await Supervisor(settings, settings.effective_workers, source).run()


def worker_main(early: list[int]) -> None:
    """A worker process's entry (``python -c``): read its settings and sockets from the
    descriptors :data:`WORKER_ENV` names, serve until SIGTERM/SIGINT (SIGHUP: apply the
    reloadable settings, confirmed on the status pipe); exit 69 or 78 with one
    ``dedup-relay: ...`` line on stderr when it cannot start. ``early``: the signals that
    arrived before the event loop's handlers were installed (sent again once they are)."""
    spec = json.loads(os.environ.pop(WORKER_ENV))
    with os.fdopen(spec["settings"], "rb") as pipe:
        # a pipe from the parent process only
        settings, source = pickle.load(pipe)  # noqa: S301
    index = int(spec["index"])
    setproctitle(f"dedup-relay: worker {index}")  # not a `python3 -c "..."` blob in ps
    setup_logging(settings.log_level, settings.log_format, worker=index,
                  mask_addresses=not settings.log_recipients)
    status = os.fdopen(spec["status"], "wb", buffering=0)

    def socks(fds: list[int]) -> tuple[socket.socket, ...]:
        return tuple(socket.socket(fileno=fd) for fd in fds)

    def serving(_: object) -> None:
        with contextlib.suppress(OSError):
            status.write(b"serving\n")

    def confirm(applied: bool) -> None:
        with contextlib.suppress(OSError):
            status.write(b"reloaded\n" if applied else b"reload failed\n")

    # a worker applies what its supervisor read and checked (SnapshotSource), never the file
    hangup = None if source is None else worker_hangup(
        Reloader(SnapshotSource(Path(spec["reload_snapshot"])), settings), confirm)

    inherited = Inherited(listen=socks(spec["listen"]), tls_listen=socks(spec["tls_listen"]),
                          index=index, metrics_port=int(spec["metrics_port"]))
    async def main() -> None:
        serve = asyncio.create_task(run(settings, inherited=inherited, started=serving,
                                        hangup=hangup))
        await asyncio.sleep(0)  # run() installed its signal handlers: what came early, again
        for sig in early:
            os.kill(os.getpid(), sig)
        await serve

    try:
        run_loop_for(settings, main())
    except ConfigError as exc:
        sys.stderr.write(f"dedup-relay: invalid configuration:\n{exc}\n")
        sys.exit(EX_CONFIG)
    except StartupError as exc:
        sys.stderr.write(f"dedup-relay: cannot start: {exc}\n")
        sys.exit(EX_UNAVAILABLE)
