"""``/readyz`` of a supervisor (:class:`WorkersReadiness`): every worker serves and the live
workers' last probes of the store, the upstream (and the audit ledger) answered, read from
the workers' metrics files (``relay_component_up``, ``relay_upstream_up``: livemin). It sees
the supervisor as :class:`SupervisedWorkers`, never imports it."""

from __future__ import annotations

import time
from typing import Protocol

from relay.ops.health import ComponentStatus
from relay.ops.metrics import components_up, ledger_totals, upstreams_up
from relay.settings import Settings


class SupervisedWorkers(Protocol):
    """What readiness reads of a supervisor."""

    @property
    def settings(self) -> Settings:
        """The running settings (``ledger``, ``ledger_required``)."""
        ...

    @property
    def metrics_dir(self) -> str | None:
        """The workers' multiprocess metrics directory; None: metrics off."""
        ...

    def not_serving(self) -> list[int]:
        """The indexes of the workers that do not serve now."""
        ...


class WorkersReadiness:
    """``/readyz`` of the supervisor ``workers`` (a :class:`relay.ops.health.Readiness`):
    every worker serves and the live workers' last probes of the store and the upstream
    answered (``relay_component_up``, livemin)."""

    def __init__(self, workers: SupervisedWorkers) -> None:
        self._workers = workers

    def _up(self) -> dict[str, float]:
        metrics_dir = self._workers.metrics_dir
        return components_up(metrics_dir) if metrics_dir is not None else {}

    def status(self) -> dict[str, ComponentStatus]:
        """``store``, ``upstream`` and ``workers`` (how many of N serve), and ``ledger`` when
        there is one and a worker reported it."""
        now = time.time()
        up = self._up()
        result = {name: ComponentStatus(
            up.get(name) == 1.0, None if up.get(name) == 1.0
            else "not answering in at least one worker", now) for name in ("store", "upstream")}
        if self._workers.settings.ledger is not None and "ledger" in up:
            result["ledger"] = ComponentStatus(
                up["ledger"] == 1.0, None if up["ledger"] == 1.0
                else "not writable in at least one worker", now)
        missing = self._workers.not_serving()
        result["workers"] = ComponentStatus(
            not missing, f"worker(s) {missing} not serving" if missing else None, now)
        return result

    @property
    def ready(self) -> bool:
        """True when every worker serves and every component answered in every worker (the
        audit ledger only when it is required)."""
        required = self._workers.settings.ledger_required
        return all(s.ok for name, s in self.status().items()
                   if name != "ledger" or required)

    def ledger(self) -> dict[str, object]:
        """The audit ledger over the workers: ``state`` (``up`` in every live worker, else
        ``down``), ``required``, the rows ``queued`` in them and ``dropped`` by all of them;
        {} without one."""
        settings, metrics_dir = self._workers.settings, self._workers.metrics_dir
        if settings.ledger is None or metrics_dir is None:
            return {}
        up = components_up(metrics_dir).get("ledger")
        dropped, queued = ledger_totals(metrics_dir)
        return {"state": "up" if up in (None, 1.0) else "down",
                "required": settings.ledger_required, "queued": queued, "dropped": dropped}

    def upstreams(self) -> dict[str, dict[str, object]]:
        """Each upstream by name: ``ready`` when it is in every live worker
        (``relay_upstream_up``, livemin), else ``not ready in at least one worker``."""
        metrics_dir = self._workers.metrics_dir
        up = upstreams_up(metrics_dir) if metrics_dir is not None else {}
        return {name: {"state": "ready" if value == 1.0 else
                       "not ready in at least one worker"} for name, value in up.items()}
