"""Readiness: a background probe of the store and the upstream (design.md §6.3).

:class:`HealthMonitor` pings both every ``interval_s`` seconds (each ping bounded by
``timeout_s``), keeps the last result for ``/readyz`` and sets the ``relay_component_up``
gauge, so an operator tells "store down" from "upstream down" on the dashboard too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from relay.core.interfaces import FingerprintStore, Metrics, Upstream

log = logging.getLogger("relay.ops.health")


@dataclass(frozen=True)
class ComponentStatus:
    """Last probe of one component: ``ok``, a short ``error`` text, unix time ``checked_at``."""

    ok: bool
    error: str | None
    checked_at: float


class Readiness(Protocol):
    """What ``/readyz`` reads: one process's :class:`HealthMonitor`, or the supervisor's view
    of every worker (:class:`relay.supervision.readiness.WorkersReadiness`)."""

    def status(self) -> dict[str, ComponentStatus]:
        """The last probe result of every component, by name."""
        ...

    @property
    def ready(self) -> bool:
        """True when every component is ready."""
        ...

    def upstreams(self) -> dict[str, dict[str, object]]:
        """Each configured upstream's state by name (``state``: ``ready``, ``cooling down``
        (``until``: unix seconds) or ``down``); {} when not known."""
        ...

    def ledger(self) -> dict[str, object]:
        """The audit ledger's state (``state``: ``up`` / ``down``, ``required``, rows
        ``dropped``...); {} without a ledger."""
        ...


class LedgerProbe(Protocol):
    """What readiness reads of the audit ledger (:class:`relay.store.postgres.ledger.
    PostgresLedger`)."""

    @property
    def required(self) -> bool:
        """Whether a ledger that is down makes the relay not ready (``ledger_required``)."""
        ...

    async def ping(self) -> None:
        """Raise unless the ledger is writable."""
        ...

    def report(self) -> dict[str, object]:
        """The ``ledger`` part of the ``/readyz`` body."""
        ...


class HealthMonitor:
    """Probes the store and the upstream periodically; ``status()`` is what ``/readyz`` shows."""

    def __init__(self, *, store: FingerprintStore, upstream: Upstream, metrics: Metrics,
                 interval_s: float = 5.0, timeout_s: float = 3.0,
                 upstream_states: Callable[[], Mapping[str, Mapping[str, object]]] | None = None,
                 ledger: LedgerProbe | None = None) -> None:
        """``upstream_states``: each upstream's live state by name, for the ``/readyz`` body
        (the failover upstream's); the ``upstream`` component is ready when at least one is.
        ``ledger``: the audit ledger, probed as the component ``ledger``; it counts for
        readiness only when it is required (otherwise the relay relays on without it and
        ``/readyz`` only says so)."""
        self._upstream_states = upstream_states
        self._ledger = ledger
        self._probes: dict[str, Callable[[], Awaitable[None]]] = {
            "store": store.ping, "upstream": upstream.ping}
        if ledger is not None:
            self._probes["ledger"] = ledger.ping
        self._metrics = metrics
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._status: dict[str, ComponentStatus] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Probe once (so ``/readyz`` is meaningful at once), then keep probing in the loop."""
        await self.probe()
        self._task = asyncio.create_task(self._run(), name="health-monitor")

    async def stop(self) -> None:
        """Stop probing."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.probe()

    async def probe(self) -> dict[str, ComponentStatus]:
        """Ping every component now, concurrently; returns and keeps the results."""
        names = list(self._probes)
        results = await asyncio.gather(*(self._probe_one(n) for n in names))
        for name, status in zip(names, results, strict=True):
            previous = self._status.get(name)
            if previous is not None and previous.ok != status.ok:
                log.warning("%s is %s%s", name, "up" if status.ok else "DOWN",
                            f": {status.error}" if status.error else "")
            self._status[name] = status
            self._metrics.component_up(name, status.ok)
        return dict(self._status)

    async def _probe_one(self, name: str) -> ComponentStatus:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._probes[name]()
        except Exception as exc:  # any failure means "not ready"; reported, not raised
            return ComponentStatus(False, f"{type(exc).__name__}: {exc}"[:300], time.time())
        return ComponentStatus(True, None, time.time())

    def status(self) -> dict[str, ComponentStatus]:
        """The last probe result of every component; the ledger's reads down as soon as its
        writer failed, without waiting for the next probe."""
        status = dict(self._status)
        ledger = self._ledger
        report = ledger.report() if ledger is not None else {}
        if ledger is not None and report.get("state") != "up":
            status["ledger"] = ComponentStatus(
                False, str(report.get("error") or "its last write or probe failed"), time.time())
        return status

    @property
    def ready(self) -> bool:
        """True when every component answered its last probe (the ledger only when it is
        required)."""
        ledger = self._ledger
        optional = "ledger" if ledger is not None and not ledger.required else ""
        return bool(self._status) and all(s.ok for name, s in self.status().items()
                                          if name != optional)

    def ledger(self) -> dict[str, object]:
        """The audit ledger's state ({} without one)."""
        return self._ledger.report() if self._ledger is not None else {}

    def upstreams(self) -> dict[str, dict[str, object]]:
        """Each upstream's live state by name ({} without ``upstream_states``)."""
        if self._upstream_states is None:
            return {}
        return {name: dict(state) for name, state in self._upstream_states().items()}
