"""How the relay runs as a process: worker processes and their event loop, the metrics and
health listener, logging, the shutdown grace and the pid file. The log level changes live on
reload."""

from __future__ import annotations

import math
import os
from collections.abc import Set
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from relay.settings.common import FileCheck, Section, host_port, split_host_port, writable_file


class OperationsSettings(Section):
    """Processes, metrics, logs, shutdown and the pid file."""

    TITLE: ClassVar[str] = "Operations"
    LIVE: ClassVar[tuple[str, ...]] = ("log_level",)

    workers: int | None = Field(default=None, ge=1, le=256, description=(
        "worker processes sharing the listeners, each with its own event loop, store "
        "client and upstream pool; unset: the CPUs this process may use (its affinity and "
        "cgroup CPU quota, rounded up); 1: one process, no supervisor"))
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field("auto", description=(
        "event loop of the relay's processes: auto (uvloop when it imports, else asyncio's), "
        "uvloop (refuse to start without it) or asyncio"))
    metrics_listen: str | None = Field("127.0.0.1:9725", description=(
        "HOST:PORT of /metrics, /healthz and /readyz; off disables"))
    health_interval: float = Field(default=5.0, gt=0, description=(
        "seconds between readiness probes of the store and the upstream"))
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description=(
        "lowest level logged"))
    log_format: Literal["json", "text"] = Field("json", description=(
        "json (one object per line on stderr) or text"))
    log_recipients: bool = Field(False, description=(
        "log recipients in full (they are masked as j***@example.com otherwise)"))
    shutdown_grace: float = Field(default=30.0, ge=0, description=(
        "seconds in-flight messages get to finish on SIGTERM"))
    pid_file: str = Field("", description=(
        "file the relay writes its process id to (for `dedup-relay reload`, which sends it "
        "SIGHUP); empty: none"))

    @field_validator("metrics_listen")
    @classmethod
    def _check_metrics_listen(cls, value: str | None) -> str | None:
        if value is None or value.lower() in ("", "off", "none"):
            return None
        split_host_port(value, what="metrics_listen")
        return value

    @property
    def effective_workers(self) -> int:
        """How many worker processes serve: ``workers``, or when unset the number of CPUs this
        process may run on: its affinity mask (``os.cpu_count()`` where there is none), and no
        more than its cgroup's CPU quota allows, rounded up (a container limited to 2 CPUs
        on a 64-CPU node runs 2 workers, :func:`cgroup_cpu_limit`)."""
        if self.workers is not None:
            return self.workers
        affinity = getattr(os, "sched_getaffinity", None)
        cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
        quota = cgroup_cpu_limit()
        if quota is not None:
            cpus = min(cpus, math.ceil(quota))
        return max(1, cpus)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the metrics HTTP server, or None when disabled."""
        if self.metrics_listen is None:
            return None
        return split_host_port(self.metrics_listen, what="metrics_listen")

    @property
    def health_timeout(self) -> float:
        """Seconds one readiness probe of a part may take."""
        return min(3.0, self.health_interval * 2)

    def file_checks(self, *, live: bool) -> list[FileCheck]:
        """The pid file can be written."""
        if not self.pid_file:
            return []
        pid_file = Path(self.pid_file)
        return [(("pid_file",), lambda: writable_file(pid_file, "the pid file"))]

    def apply_operations_live(self, applied: Set[str]) -> None:
        """Apply the log level (at once)."""
        from relay.ops.logs import set_level

        set_level(self.log_level)

    def describe_operations(self, metrics_port: int, event_loop: str) -> str:
        """The metrics listener and the event loop for the start-up line (``metrics_port``:
        the bound port, 0 when off)."""
        address = self.metrics_address
        metrics = host_port(address[0], metrics_port) if metrics_port and address else "off"
        return f"metrics {metrics}, event loop {event_loop}"


def cgroup_cpu_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                     root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs this process's cgroup quota allows (quota / period; the smallest along its
    cgroup's ancestry: a limit on a parent holds its children too), None when there is none or
    it cannot be read. cgroup v2: ``cpu.max`` (``"200000 100000"``, or ``"max 100000"``: no
    limit); v1: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota -1: no limit)."""
    try:
        lines = proc_cgroup.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    found: list[float] = []
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":  # v2: one hierarchy
            found += [q for d in _ancestry(root, path) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):
            base = root / controllers if (root / controllers).is_dir() else root / "cpu"
            found += [q for d in _ancestry(base, path) if (q := _v1_quota(d)) is not None]
    return min(found) if found else None


def _ancestry(base: Path, path: str) -> list[Path]:
    """``base/path`` and its parents up to ``base``."""
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text(encoding="ascii").split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text(encoding="ascii"))
        period = int((folder / "cpu.cfs_period_us").read_text(encoding="ascii"))
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
