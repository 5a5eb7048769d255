"""Prometheus metrics (design.md §6.2), registered on an injected registry.

No label ever holds an address, a key or a fingerprint: labels are small closed sets
(``result``, ``outcome``, ``op``, ``code_class``); ``result`` and ``outcome`` take the
:class:`relay.core.interfaces.Result` / ``Outcome`` / ``DsnResult`` enums only. Base units:
seconds and bytes.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)

from relay import __version__
from relay.core.interfaces import DsnResult, Outcome, Result

STORE_OPS = ("reserve", "settle", "renew")
CODE_CLASSES = ("2xx", "4xx", "5xx", "none")


def register_runtime_collectors(registry: CollectorRegistry) -> None:
    """Register prometheus-client's standard collectors on ``registry``: ``process_*`` (CPU
    seconds, resident and virtual memory bytes, open file descriptors, start time; read from
    ``/proc``, absent elsewhere), ``python_info`` and ``python_gc_*``.

    Raises ``ValueError`` (duplicated timeseries) when ``registry`` already has them.
    """
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


class PrometheusMetrics:
    """Implements :class:`relay.core.interfaces.Metrics` with prometheus-client collectors.

    ``registry`` is injected (tests pass a fresh ``CollectorRegistry``); nothing is registered
    on the global default registry. The standard ``process_*`` and ``python_*`` collectors are
    registered on it too (:func:`register_runtime_collectors`).
    """

    def __init__(self, *, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._messages = Counter(
            "relay_messages", "Messages handled at the final dot, by result",
            ["result"], registry=registry)
        self._recipients = Counter(
            "relay_recipients", "Envelope recipients by dedup outcome", ["outcome"],
            registry=registry)
        self._store_errors = Counter(
            "relay_store_errors", "Store operations that failed or timed out", ["op"],
            registry=registry)
        self._store_seconds = Histogram(
            "relay_store_seconds", "Store round-trip latency in seconds", ["op"],
            registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self._upstream_seconds = Histogram(
            "relay_upstream_seconds", "Upstream transaction latency in seconds",
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600))
        self._upstream_replies = Counter(
            "relay_upstream_replies", "Upstream transactions by deciding reply class",
            ["code_class"], registry=registry)
        self._sessions = Gauge(
            "relay_sessions_active", "Open client SMTP sessions", registry=registry)
        self._bytes = Histogram(
            "relay_message_bytes", "Size of received messages in bytes", registry=registry,
            buckets=(1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864))
        self._mark_sent_failed = Counter(
            "relay_mark_sent_failed",
            "Upstream-accepted fingerprints whose SENT mark had not landed by the lease end",
            registry=registry)
        self._unknown_resent = Counter(
            "relay_unknown_resent",
            "Recipients relayed again while an earlier attempt was in doubt (unknown_policy = "
            "send): possible duplicates", registry=registry)
        self._in_progress = Gauge(
            "relay_messages_in_progress",
            "Messages past the final dot whose reply is not yet sent (reserved, in flight)",
            registry=registry)
        self._up = Gauge(
            "relay_component_up", "1 when the component answered its last readiness probe",
            ["component"], registry=registry)
        self._auth_failures = Counter(
            "relay_auth_failures", "Failed AUTH attempts (each answered slower)",
            registry=registry)
        self._auth_refused = Counter(
            "relay_auth_refused",
            "AUTH attempts refused unchecked: the client address or user name spent its budget",
            registry=registry)
        self._dsn = Counter(
            "relay_dsn", "Delivery status notifications to senders (RFC 3464), by result",
            ["result"], registry=registry)
        Info("relay_build", "Build information", registry=registry).info(
            {"version": __version__})
        register_runtime_collectors(registry)
        # every label value of an enum is shown from the start (at 0), and no other can appear
        for outcome in Outcome:
            self._recipients.labels(outcome.value)
        for result in Result:
            self._messages.labels(result.value)
        for op in STORE_OPS:
            self._store_errors.labels(op)
        for cls in CODE_CLASSES:
            self._upstream_replies.labels(cls)
        for component in ("store", "upstream"):
            self._up.labels(component)
        for dsn_result in DsnResult:
            self._dsn.labels(dsn_result.value)

    def message(self, result: Result) -> None:
        """Count one message by ``result``; raises ``ValueError`` for a value not in
        :class:`Result` (no new label from a typo)."""
        self._messages.labels(Result(result).value).inc()

    def recipients(self, outcome: Outcome, count: int = 1) -> None:
        """Count ``count`` recipients by ``outcome``; raises ``ValueError`` for a value not
        in :class:`Outcome`."""
        self._recipients.labels(Outcome(outcome).value).inc(count)

    def store_call(self, op: str, seconds: float, ok: bool) -> None:
        """Observe one store round trip (seconds) and count it as an error when not ``ok``."""
        self._store_seconds.labels(op).observe(seconds)
        if not ok:
            self._store_errors.labels(op).inc()

    def upstream_call(self, seconds: float, code: int | None) -> None:
        """Observe one upstream transaction (seconds) and its deciding reply class."""
        self._upstream_seconds.observe(seconds)
        label = f"{code // 100}xx" if code is not None and code // 100 in (2, 4, 5) else "none"
        self._upstream_replies.labels(label).inc()

    def message_bytes(self, size: int) -> None:
        """Observe one received message's size in bytes."""
        self._bytes.observe(size)

    def mark_sent_failed(self, count: int = 1) -> None:
        """Count ``count`` accepted fingerprints whose SENT mark had not landed by the lease
        end."""
        self._mark_sent_failed.inc(count)

    def unknown_resent(self, count: int = 1) -> None:
        """Count ``count`` recipients relayed again although an earlier attempt is in doubt."""
        self._unknown_resent.inc(count)

    def session(self, delta: int) -> None:
        """Move the open-session gauge by ``delta``."""
        self._sessions.inc(delta)

    def in_progress(self, delta: int) -> None:
        """Move the in-progress gauge by ``delta``."""
        self._in_progress.inc(delta)

    def auth_failure(self) -> None:
        """Count one failed AUTH attempt."""
        self._auth_failures.inc()

    def auth_refused(self) -> None:
        """Count one AUTH attempt refused unchecked (its failure budget was spent)."""
        self._auth_refused.inc()

    def component_up(self, component: str, up: bool) -> None:
        """Set ``relay_component_up{component}`` to 1 or 0."""
        self._up.labels(component).set(1 if up else 0)

    def dsn(self, result: DsnResult) -> None:
        """Count one delivery status notification by ``result``; raises ``ValueError`` for a
        value not in :class:`DsnResult`."""
        self._dsn.labels(DsnResult(result).value).inc()
