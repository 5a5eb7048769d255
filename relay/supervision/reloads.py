"""Forwarding a configuration reload to the workers (SIGHUP; design.md §8, :mod:`relay.reload`).

The supervisor reads and checks the configuration, and refuses it (one ERROR line, nothing
changed) or writes what it read to a snapshot file and forwards SIGHUP to every worker, which
applies that snapshot and confirms on its status pipe; the supervisor then logs one INFO line
for the whole relay and counts the reload (``relay_config_reloads_total``, in its own
registry). Reloads run one at a time; one asked for during start-up runs once the relay serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from relay.core.errors import ConfigError
from relay.ops.logs import set_level
from relay.ops.metrics import ConfigReloadMetrics
from relay.reload import Changes, Reloader, SettingsSource, one_line, write_snapshot
from relay.settings import Settings
from relay.supervision.slots import WorkerSlot
from relay.supervision.spawn import worker_share

log = logging.getLogger("relay.supervisor")

RELOAD_CONFIRM_S = 10.0  # how long the supervisor waits for its workers to apply a reload
# the supervisor's own part of an applied reload (its settings, the console), before the
# workers are told
Applied = Callable[[Settings, frozenset[str]], Awaitable[None]]


class ReloadForwarder:
    """The reloads of a supervisor of ``workers`` whose settings came from ``source`` (None:
    not started by ``serve``, a reload is refused). Put one item on :attr:`hangups` per SIGHUP;
    :meth:`serve` runs them."""

    def __init__(self, source: SettingsSource | None, settings: Settings,
                 workers: list[WorkerSlot]) -> None:
        self._reloader = Reloader(source, settings) if source is not None else None
        self._workers = workers
        self.hangups: asyncio.Queue[None] = asyncio.Queue()
        self.confirmed = asyncio.Condition()  # notified on each worker's confirmation
        self.metrics = ConfigReloadMetrics(registry=None)
        # the settings a reload read and checked, for the workers to apply (SnapshotSource);
        # in a private directory made by make_snapshot_dir()
        self._snapshot_dir: str | None = None
        self.snapshot = Path("/nonexistent/dedup-relay-reload-snapshot")

    def make_snapshot_dir(self) -> None:
        """Make the private directory of :attr:`snapshot` (removed by :meth:`remove_files`)."""
        self._snapshot_dir = tempfile.mkdtemp(prefix="dedup-relay-reload-")
        self.snapshot = Path(self._snapshot_dir) / "settings.pickle"

    def count_on(self, registry: CollectorRegistry) -> None:
        """Count the reloads on ``registry`` (the supervisor's: once per reload, not per worker)."""
        self.metrics = ConfigReloadMetrics(registry=registry)

    async def serve(self, applied: Applied) -> None:
        """One configuration reload per SIGHUP (those of the start-up too), one at a time,
        until cancelled; ``applied`` gets the new settings and the names changed live."""
        while True:
            await self.hangups.get()
            try:
                await self.reload(applied)
            except Exception:
                log.exception("configuration reload failed")

    async def reload(self, applied: Applied) -> None:
        """Read and check the configuration again; refused: one ERROR line, nothing changed;
        else ``applied``, forward SIGHUP to every worker, wait for them to confirm (up to
        :data:`RELOAD_CONFIRM_S`), log one INFO line and count it."""
        changes = await self._prepared()
        if changes is None:
            self.metrics.reloaded(applied=False, now=time.time())
            return
        assert self._reloader is not None
        self._reloader.commit(changes)
        set_level(changes.merged.log_level)
        await applied(changes.merged, frozenset(changes.applied))
        missing = await self._forward()
        if missing:  # they keep the rules they had: the relay is split until they apply it
            log.error("configuration reload partly applied: %s; worker(s) %s did not apply it "
                      "(see their log; send SIGHUP again)", changes.describe(),
                      ", ".join(map(str, missing)))
            self.metrics.reloaded(applied=False, now=time.time(), partial=True)
            return
        log.info("configuration reloaded: %s", changes.describe())
        self.metrics.reloaded(applied=True, now=time.time())

    async def _prepared(self) -> Changes | None:
        """The changes read, checked and written to :attr:`snapshot`; None when refused
        (logged)."""
        if self._reloader is None:
            log.error("configuration reload refused: this relay was not started by "
                      "`dedup-relay serve` (no configuration to read again)")
            return None
        log.debug("SIGHUP: reading the settings again from %s",
                  self._reloader.source.describe())
        try:
            changes = await asyncio.to_thread(self._reloader.prepare)
        except ConfigError as exc:
            log.error("configuration reload refused: %s", one_line(exc))
            return None
        try:  # every worker applies this one reading, not the file as it is when it looks
            await asyncio.to_thread(write_snapshot, self.snapshot, worker_share(
                changes.merged, len(self._workers)))
        except OSError as exc:
            log.error("configuration reload refused: cannot hand the settings to the workers "
                      "(%s)", exc)
            return None
        return changes

    async def _forward(self) -> list[int]:
        """SIGHUP every live worker process; wait until each serving one confirmed it. The
        indexes of the serving workers that did not apply it (failed, or silent too long)."""
        before = {w.index: w.reloads for w in self._workers}
        waiting = []
        for worker in self._workers:
            if worker.alive:
                worker.signal(signal.SIGHUP)
                if worker.serving:  # one still starting applies it once it serves
                    waiting.append(worker)

        def done() -> bool:
            return all(w.reloads > before[w.index] or not w.serving for w in waiting)

        async with self.confirmed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.confirmed.wait_for(done), RELOAD_CONFIRM_S)
        return [w.index for w in waiting
                if w.serving and (w.reloads <= before[w.index] or not w.reload_ok)]

    def remove_files(self) -> None:
        """Remove the snapshot's directory."""
        if self._snapshot_dir is not None:
            shutil.rmtree(self._snapshot_dir, ignore_errors=True)
