"""The supervisor of ``workers`` > 1 worker processes (design.md §8): binds the listeners
once, starts worker 0 and then the others, restarts them by :mod:`~relay.supervision.policy`,
forwards SIGTERM and SIGINT and waits for their graceful shutdown, hands SIGHUP to
:mod:`~relay.supervision.reloads`, hosts the :mod:`~relay.supervision.servers` and runs the
relay's one reconciler (:mod:`relay.admin.reconciler`, with a ledger)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

from setproctitle import setproctitle

from relay.admin.reconciler import RunningReconciler, start_reconciler
from relay.core.cancellation import AFTER_DOT_WAIT_S
from relay.listen import Listeners, bind_listeners
from relay.ops.metrics import ReconcileMetrics, worker_gone
from relay.ops.notify import keep_watchdog, notify, watchdog_interval_s
from relay.ops.pidfile import remove_pid_file, write_pid_file
from relay.reload import SettingsSource
from relay.settings import Settings
from relay.supervision.policy import EX_UNAVAILABLE
from relay.supervision.readiness import WorkersReadiness
from relay.supervision.reloads import ReloadForwarder
from relay.supervision.servers import HostedServers
from relay.supervision.slots import WorkerSlot
from relay.supervision.spawn import exited, hand_settings, start_worker, worker_share
from relay.supervision.status import follow_status

log = logging.getLogger("relay.supervisor")

FORWARDED = (signal.SIGTERM, signal.SIGINT)


class Supervisor:
    """Starts ``count`` workers on shared sockets and keeps them running until a signal;
    ``await run()`` returns the exit code. ``source``: where the settings came from, read
    again on SIGHUP (None: a reload is refused)."""

    def __init__(self, settings: Settings, count: int, source: SettingsSource | None = None
                 ) -> None:
        self.settings = settings
        self.count = count
        self.source = source
        self.workers = [WorkerSlot(i) for i in range(count)]
        self._reloads = ReloadForwarder(source, settings, self.workers)
        self._servers = HostedServers()
        self._listeners: Listeners | None = None
        self._stopping = asyncio.Event()
        self._signal: int | None = None
        self._give_up: int | None = None
        self._codes: list[int] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._reconciling: RunningReconciler | None = None  # with a ledger, once serving

    @property
    def metrics_dir(self) -> str | None:
        """The workers' multiprocess metrics directory (None: metrics off)."""
        return self._servers.metrics_dir

    def not_serving(self) -> list[int]:
        """The indexes of the workers that do not serve now."""
        return [w.index for w in self.workers if not w.serving]

    async def run(self) -> int:
        """Bind, start the workers, supervise until SIGTERM/SIGINT, stop them; returns the exit
        code. Raises :class:`StartupError` when a listener cannot be bound."""
        loop = asyncio.get_running_loop()
        for sig in FORWARDED:
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._reloads.hangups.put_nowait, None)
        pid_file = Path(self.settings.pid_file) if self.settings.pid_file else None
        served: list[asyncio.Task[None]] = []
        setproctitle("dedup-relay: supervisor")  # ps, top; `reload` knows the title too
        self._reloads.make_snapshot_dir()
        try:
            self._listeners = await bind_listeners(self.settings)
            self._servers.bind(self.settings, WorkersReadiness(self), self._worker_pids)
            if self._servers.registry is not None:
                self._reloads.count_on(self._servers.registry)
            self._tasks = [asyncio.create_task(self._keep(w)) for w in self.workers]
            await self._await_first_start()
            if not self._stopping.is_set() and self.workers[0].served.is_set():
                served = await self._serve(pid_file)
            await self._stopping.wait()
            notify("STOPPING=1")
            if served:
                served[0].cancel()  # the reloads (first): none while the workers stop
            await self._stop_workers()
        finally:
            for task in served:
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

    async def _serve(self, pid_file: Path | None) -> list[asyncio.Task[None]]:
        """Worker 0 serves: start the hosted servers (last, as one process's), log the start,
        write the pid file; the tasks of the reloads and of the readiness announcement."""
        if not await self._servers.start(self.settings):
            self._give_up = EX_UNAVAILABLE  # the console cannot start: stop, gracefully
            self._on_signal(signal.SIGTERM)
        listeners = self._listeners
        assert listeners is not None
        log.info("supervisor %d: %d workers on SMTP port %d, %s", os.getpid(), self.count,
                 listeners.port, self._servers.describe(self.settings))
        _write_pid(pid_file)
        self._reconciling = start_reconciler(
            lambda: self.settings, store=None,
            metrics=lambda: ReconcileMetrics(registry=self._servers.registry),
            instance=f"{self.settings.hostname}/reconciler")
        return [asyncio.create_task(self._reloads.serve(self._applied)),
                asyncio.create_task(self._announce_ready())]

    async def _applied(self, settings: Settings, changed: frozenset[str]) -> None:
        """A reload read and checked ``settings``: a worker started from now on gets them, and
        the console applies them."""
        self.settings = settings
        await self._servers.reload(settings, changed)

    async def _announce_ready(self) -> None:
        """Tell systemd the relay serves (``Type=notify``) once every worker serves, then keep
        its watchdog (``WatchdogSec``) until cancelled."""
        await asyncio.gather(*(w.served.wait() for w in self.workers))
        notify("READY=1", f"STATUS=serving with {self.count} workers")
        interval = watchdog_interval_s()
        if interval is not None:
            await keep_watchdog(interval)

    async def _await_first_start(self) -> None:
        """Worker 0 serves (then the others start), the relay stops, or worker 0 ended."""
        waits = {asyncio.create_task(self.workers[0].served.wait()),
                 asyncio.create_task(self._stopping.wait()),
                 asyncio.create_task(self.workers[0].ended.wait())}
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()

    def _worker_pids(self) -> dict[int, int]:
        """Each live worker's pid by its index (the metrics of every worker)."""
        return {w.index: w.proc.pid for w in self.workers
                if w.proc is not None and w.proc.poll() is None}

    def _on_signal(self, sig: int) -> None:
        self._signal = sig
        self._stopping.set()
        if self._listeners is not None:  # the workers close theirs: the port is closed
            self._listeners.close()
        for worker in self.workers:
            worker.signal(sig)

    async def _keep(self, worker: WorkerSlot) -> None:
        """Run ``worker``'s process, restarting it, until the relay stops."""
        if worker.index > 0:
            await self._await_first_start()
        while not self._stopping.is_set():
            code = await self._run_once(worker)
            if self._stopping.is_set():
                self._codes.append(code)
                break
            give_up = worker.restarts.after_exit(code, worker.left())
            if give_up is not None:
                self._give_up = give_up
                self._stopping.set()
                self._on_signal(signal.SIGTERM)
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), worker.restarts.backoff_s)
            worker.restarts.waited()
        worker.ended.set()

    async def _run_once(self, worker: WorkerSlot) -> int:
        """Start ``worker``'s process, follow it until it exits; its exit code (negative: the
        signal that ended it)."""
        assert self._listeners is not None
        proc, settings_w, status_r = start_worker(
            worker.index, self._listeners, metrics_port=self._servers.metrics_port,
            metrics_dir=self.metrics_dir, snapshot=self._reloads.snapshot)
        worker.proc = proc
        if self._signal is not None:  # came while it was being spawned
            worker.signal(self._signal)
        await hand_settings(settings_w, worker_share(self.settings, self.count), self.source)
        reader = asyncio.create_task(follow_status(worker, status_r, self._reloads.confirmed))
        code = await exited(proc)
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        if self.metrics_dir is not None:
            worker_gone(self.metrics_dir, proc.pid)
        return code

    async def _stop_workers(self) -> None:
        """Wait for every worker's graceful shutdown; SIGKILL what outlives its bound
        (``shutdown_grace`` + the wait for replies to final dots + 4 store timeouts + 10 s)."""
        s = self.settings
        bound_s = s.shutdown_grace + AFTER_DOT_WAIT_S + 4 * s.store_timeout + 10.0
        try:
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), bound_s)
        except TimeoutError:
            for worker in self.workers:
                if worker.alive:
                    log.error("worker %d did not stop within %.0f s: killed", worker.index,
                              bound_s)
                    worker.kill()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _cleanup(self) -> None:
        """Stop the reconciler, kill what still runs, stop the hosted servers, close the
        listeners, remove the private directories."""
        if self._reconciling is not None:
            await self._reconciling.stop()
        for task in self._tasks:
            if not task.done():
                task.cancel()
        for worker in self.workers:
            if worker.proc is not None and worker.alive:
                worker.kill()
                await exited(worker.proc)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._servers.stop()
        if self._listeners is not None:
            self._listeners.close()
        self._servers.remove_files()
        self._reloads.remove_files()


def _write_pid(path: Path | None) -> None:
    """Write this process's id to the pid file ``path`` (None: none); an error is logged."""
    if path is None:
        return
    try:
        write_pid_file(path)
    except OSError as exc:
        log.error("cannot write the pid file %s: %s (`dedup-relay reload` needs --pid)",
                  path, exc)


async def supervise(settings: Settings, source: SettingsSource | None = None) -> int:
    """Run ``settings.effective_workers`` workers under a :class:`Supervisor`; the exit code.
    ``source``: where the settings came from, read again on SIGHUP. Raises
    :class:`StartupError` when a listener cannot be bound."""
    return await Supervisor(settings, settings.effective_workers, source).run()
