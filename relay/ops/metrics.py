"""Prometheus metrics (design.md §6.2), registered on an injected registry.

No label ever holds an address, a key or a fingerprint: labels are small closed sets
(``result``, ``outcome``, ``op``, ``code_class``); ``result`` and ``outcome`` take the
:class:`relay.core.interfaces.Result` / ``Outcome`` / ``DsnResult`` enums only. Base units:
seconds and bytes.

Worker processes (``workers`` > 1) write their values to ``PROMETHEUS_MULTIPROC_DIR``
(prometheus-client multiprocess mode): counters and histograms add up, the session and
in-progress gauges are summed over live workers (``livesum``), ``relay_component_up`` is the
minimum over live workers (``livemin``: 1 only when every worker's probe answered). The
supervisor reads those files through :class:`relay.ops.worker_files.WorkerFiles`, which skips
one it cannot read (a worker's file created and not yet sized: 0 bytes; one cut short), so
``/metrics`` and ``/readyz`` never fail on it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from relay import __version__
from relay.core.interfaces import DsnResult, Outcome, Result
from relay.ops.worker_files import worker_files

STORE_OPS = ("reserve", "settle", "renew")
REUSE_TEMPLATES = 100
"""Distinct ``template`` label values ``relay_key_reuse_total`` takes per process; the
templates met after them count under :data:`OTHER_TEMPLATES` (a template is the application's
text: the label set must stay bounded)."""
OTHER_TEMPLATES = "_other"
TEMPLATE_LABEL_CHARS = 64
"""Characters of a template kept in the label (the rest is cut)."""
CODE_CLASSES = ("2xx", "4xx", "5xx", "none")
TLS_LISTENERS = ("starttls", "implicit")


# a counter's ``_created`` series (a gauge per counter, in the text format) tells a scraper
# nothing a counter reset does not: the relay exports none
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client: no annotation


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
            "relay_upstream_replies",
            "Upstream transactions by deciding reply class and upstream (its configured name)",
            ["code_class", "upstream"], registry=registry)
        self._upstream_up = Gauge(
            "relay_upstream_up",
            "1 when the upstream is ready (not cooling down, answered its last probe)",
            ["upstream"], registry=registry, multiprocess_mode="livemin")
        self._failovers = Counter(
            "relay_upstream_failovers",
            "Messages moved on to the next upstream after a definite failure before any "
            "recipient was accepted, by the upstream that failed", ["from_upstream"],
            registry=registry)
        self._sessions = Gauge(
            "relay_sessions_active", "Open client SMTP sessions", registry=registry,
            multiprocess_mode="livesum")
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
            registry=registry, multiprocess_mode="livesum")
        self._up = Gauge(
            "relay_component_up", "1 when the component answered its last readiness probe",
            ["component"], registry=registry, multiprocess_mode="livemin")
        self._auth_failures = Counter(
            "relay_auth_failures", "Failed AUTH attempts (each answered slower)",
            registry=registry)
        self._auth_refused = Counter(
            "relay_auth_refused",
            "AUTH attempts refused unchecked: the client address or user name spent its budget",
            registry=registry)
        self._token_failures = Counter(
            "relay_oauth_token_failures",
            "OAuth2 token fetches for smarthost AUTH that got no token, by reason", ["reason"],
            registry=registry)
        self._tls_handshake_failures = Counter(
            "relay_tls_handshake_failures",
            "Client TLS handshakes that failed or did not end in time, by listener "
            "(starttls, implicit)", ["listener"], registry=registry)
        self._dsn = Counter(
            "relay_dsn", "Delivery status notifications to senders (RFC 3464), by result",
            ["result"], registry=registry)
        self._rate_limited = Counter(
            "relay_rate_limited", "Messages refused by a rate limit, by the limit's label",
            ["limit"], registry=registry)
        self._key_rule_misses = Counter(
            "relay_key_rule_misses", "Messages a key rule matched without deriving a key "
            "(relayed without dedup), by rule", ["rule"], registry=registry)
        self._key_reuse = Counter(
            "relay_key_reuse", "Recipients whose dedupe key held a record of other content "
            "(handled per key_reuse: suppressed, rejected or relayed), by template",
            ["template"], registry=registry)
        self._ledger_written = Counter(
            "relay_ledger_rows", "Audit ledger rows written", registry=registry)
        self._ledger_dropped = Counter(
            "relay_ledger_dropped",
            "Audit ledger rows dropped: full (the queue was full while the ledger was slow or "
            "down), shutdown (not written before the relay stopped) or rejected (the database "
            "refused the row's data)", ["reason"],
            registry=registry)
        self._ledger_queued = Gauge(
            "relay_ledger_queue_rows", "Audit ledger rows waiting to be written",
            registry=registry, multiprocess_mode="livesum")
        self._in_doubt_unresolved = Gauge(
            "relay_ledger_in_doubt_unresolved",
            "Fingerprints in doubt in the audit ledger (an unknown decision, or a retry answered "
            "as in doubt) that no later row resolved, older than in_doubt_alert_after",
            registry=registry, multiprocess_mode="livemax")
        Info("relay_build", "Build information", registry=registry).info(
            {"version": __version__})
        register_runtime_collectors(registry)
        # every label value of an enum is shown from the start (at 0), and no other can appear;
        # the children are made once here, not per call (.labels() costs a lock and a lookup)
        self._recipients_by = {o: self._recipients.labels(o.value) for o in Outcome}
        self._messages_by = {r: self._messages.labels(r.value) for r in Result}
        self._store_errors_by = {op: self._store_errors.labels(op) for op in STORE_OPS}
        self._store_seconds_by = {op: self._store_seconds.labels(op) for op in STORE_OPS}
        self._replies_by: dict[tuple[str, str], Counter] = {}
        self._upstream_up_by: dict[str, Gauge] = {}
        self._failovers_by: dict[str, Counter] = {}
        self._up_by = {c: self._up.labels(c) for c in ("store", "upstream")}
        self._dsn_by = {r: self._dsn.labels(r.value) for r in DsnResult}
        self._rate_limited_by: dict[str, Counter] = {}
        self._key_rule_misses_by: dict[str, Counter] = {}
        self._key_reuse_by: dict[str, Counter] = {}
        self._token_failures_by: dict[str, Counter] = {}
        self._handshakes_failed_by = {listener: self._tls_handshake_failures.labels(listener)
                                      for listener in TLS_LISTENERS}

    def declare_rate_limits(self, labels: Iterable[str]) -> None:
        """Make ``relay_rate_limited_total{limit}`` children (at 0) for the configured limits'
        ``labels`` (at start and after a reload; a label no longer configured keeps its
        count)."""
        for label in labels:
            if label not in self._rate_limited_by:
                self._rate_limited_by[label] = self._rate_limited.labels(label)

    def rate_limited(self, label: str) -> None:
        """Count one message refused by the rate limit ``label`` (a configured limit's, so
        the label set stays bounded)."""
        child = self._rate_limited_by.get(label)
        if child is None:
            child = self._rate_limited_by[label] = self._rate_limited.labels(label)
        child.inc()

    def declare_key_rules(self, names: Iterable[str]) -> None:
        """Make ``relay_key_rule_misses_total{rule}`` children (at 0) for the configured key
        rules' ``names`` (at start and after a reload; a rule no longer configured keeps its
        count)."""
        for name in names:
            if name not in self._key_rule_misses_by:
                self._key_rule_misses_by[name] = self._key_rule_misses.labels(name)

    def key_rule_miss(self, rule: str) -> None:
        """Count one message the key rule ``rule`` matched without deriving a key."""
        child = self._key_rule_misses_by.get(rule)
        if child is None:
            child = self._key_rule_misses_by[rule] = self._key_rule_misses.labels(rule)
        child.inc()

    def key_reused(self, template: str, count: int = 1) -> None:
        """Count ``count`` recipients of a ``template`` message whose key held a record of
        other content. The label is the template (several values comma-joined, at most
        :data:`TEMPLATE_LABEL_CHARS` characters), :data:`OTHER_TEMPLATES` once
        :data:`REUSE_TEMPLATES` values were counted."""
        label = template.replace("\x1f", ",")[:TEMPLATE_LABEL_CHARS]
        child = self._key_reuse_by.get(label)
        if child is None:
            if len(self._key_reuse_by) >= REUSE_TEMPLATES:
                label = OTHER_TEMPLATES
            child = self._key_reuse_by.get(label)
            if child is None:
                child = self._key_reuse_by[label] = self._key_reuse.labels(label)
        child.inc(count)

    def message(self, result: Result) -> None:
        """Count one message by ``result``; raises ``ValueError`` for a value not in
        :class:`Result` (no new label from a typo)."""
        self._messages_by[Result(result)].inc()

    def recipients(self, outcome: Outcome, count: int = 1) -> None:
        """Count ``count`` recipients by ``outcome``; raises ``ValueError`` for a value not
        in :class:`Outcome`."""
        self._recipients_by[Outcome(outcome)].inc(count)

    def store_call(self, op: str, seconds: float, ok: bool) -> None:
        """Observe one store round trip (seconds) and count it as an error when not ``ok``."""
        seconds_child = self._store_seconds_by.get(op)
        if seconds_child is None:  # an op outside STORE_OPS: made now, as before
            seconds_child = self._store_seconds_by[op] = self._store_seconds.labels(op)
        seconds_child.observe(seconds)
        if not ok:
            errors_child = self._store_errors_by.get(op)
            if errors_child is None:
                errors_child = self._store_errors_by[op] = self._store_errors.labels(op)
            errors_child.inc()

    def declare_upstreams(self, names: Iterable[str]) -> None:
        """Make the per-upstream children (at 0) for the configured upstream ``names``:
        ``relay_upstream_replies_total{code_class,upstream}``, ``relay_upstream_up{upstream}``
        and ``relay_upstream_failovers_total{from_upstream}`` (the names are the only values
        these labels take, so the label sets stay bounded)."""
        for name in names:
            for cls in CODE_CLASSES:
                if (cls, name) not in self._replies_by:
                    self._replies_by[cls, name] = self._upstream_replies.labels(cls, name)
            if name not in self._upstream_up_by:
                self._upstream_up_by[name] = self._upstream_up.labels(name)
            if name not in self._failovers_by:
                self._failovers_by[name] = self._failovers.labels(name)

    def upstream_call(self, seconds: float, code: int | None, upstream: str = "") -> None:
        """Observe one upstream transaction (seconds) and its deciding reply class, counted
        for ``upstream`` (the configured name of the upstream that decided it)."""
        self._upstream_seconds.observe(seconds)
        label = f"{code // 100}xx" if code is not None and code // 100 in (2, 4, 5) else "none"
        child = self._replies_by.get((label, upstream))
        if child is None:
            child = self._replies_by[label, upstream] = self._upstream_replies.labels(
                label, upstream)
        child.inc()

    def upstream_up(self, upstream: str, up: bool) -> None:
        """Set ``relay_upstream_up{upstream}`` to 1 (ready) or 0 (cooling down or down)."""
        child = self._upstream_up_by.get(upstream)
        if child is None:
            child = self._upstream_up_by[upstream] = self._upstream_up.labels(upstream)
        child.set(1 if up else 0)

    def failover(self, from_upstream: str) -> None:
        """Count one message moved on from ``from_upstream`` to the next upstream."""
        child = self._failovers_by.get(from_upstream)
        if child is None:
            child = self._failovers_by[from_upstream] = self._failovers.labels(from_upstream)
        child.inc()

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

    def declare_token_failures(self, reasons: Iterable[str]) -> None:
        """Show ``relay_oauth_token_failures_total{reason}`` at 0 for each of ``reasons``
        (the kinds of token failure: a relay whose smarthost AUTH takes a token)."""
        for reason in reasons:
            self._token_failures_by.setdefault(reason, self._token_failures.labels(reason))

    def oauth_token_failure(self, reason: str) -> None:
        """Count one token fetch that got no token, by ``reason`` (a declared one)."""
        child = self._token_failures_by.get(reason)
        if child is None:
            child = self._token_failures_by[reason] = self._token_failures.labels(reason)
        child.inc()

    def tls_handshake_failed(self, listener: str) -> None:
        """Count one failed client TLS handshake on ``listener`` (``starttls`` or
        ``implicit``); raises KeyError for another."""
        self._handshakes_failed_by[listener].inc()

    def component_up(self, component: str, up: bool) -> None:
        """Set ``relay_component_up{component}`` to 1 or 0."""
        child = self._up_by.get(component)
        if child is None:
            child = self._up_by[component] = self._up.labels(component)
        child.set(1 if up else 0)

    def declare_ledger(self) -> None:
        """Show the audit ledger's series from the start (at 0): the relay has a ledger."""
        for reason in ("full", "shutdown", "rejected"):
            self._ledger_dropped.labels(reason)
        self.component_up("ledger", True)

    def ledger_written(self, rows: int) -> None:
        """Count ``rows`` audit ledger rows written."""
        self._ledger_written.inc(rows)

    def ledger_dropped(self, reason: str, rows: int) -> None:
        """Count ``rows`` audit ledger rows dropped for ``reason`` (full, shutdown,
        rejected)."""
        self._ledger_dropped.labels(reason).inc(rows)

    def ledger_queued(self, rows: int) -> None:
        """Set the audit ledger rows waiting in this process."""
        self._ledger_queued.set(rows)

    def in_doubt_unresolved(self, count: int) -> None:
        """Set the unresolved in-doubt ledger decisions older than the operator's window."""
        self._in_doubt_unresolved.set(count)

    def dsn(self, result: DsnResult) -> None:
        """Count one delivery status notification by ``result``; raises ``ValueError`` for a
        value not in :class:`DsnResult`."""
        self._dsn_by[DsnResult(result)].inc()


RELOAD_RESULTS = ("applied", "refused", "partial")


class ConfigReloadMetrics:
    """``relay_config_reloads_total{result}`` (``applied`` | ``refused`` | ``partial``: the
    supervisor applied it and some worker did not, so the relay is split until the next
    reload) and
    ``relay_config_last_reload_timestamp_seconds`` (Unix time of the last applied reload; 0
    before one), registered on ``registry``: the single process's, or the supervisor's own
    (``workers`` > 1: counted once per reload of the whole relay, not once per worker); None:
    a private one (metrics off)."""

    def __init__(self, *, registry: CollectorRegistry | None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        reloads = Counter(
            "relay_config_reloads", "Configuration reloads (SIGHUP) by result",
            ["result"], registry=registry)
        self._last = Gauge(
            "relay_config_last_reload_timestamp_seconds",
            "Unix time of the last configuration reload that was applied", registry=registry,
            multiprocess_mode="max")
        self._by = {r: reloads.labels(r) for r in RELOAD_RESULTS}

    def reloaded(self, *, applied: bool, now: float, partial: bool = False) -> None:
        """Count one reload (``partial``: some worker did not apply it); when ``applied``, set
        the timestamp to ``now`` (Unix seconds)."""
        self._by["partial" if partial else "applied" if applied else "refused"].inc()
        if applied:
            self._last.set(now)


RECONCILE_RESULTS = ("sent", "released", "given_up")
NO_SOURCE = "none"
"""The ``source`` of a record given up that no configured source speaks for."""


class ReconcileMetrics:
    """``relay_reconciled_total{source,result}``: in-doubt records the reconciler resolved on
    a source's evidence (``sent``, ``released``) or gave up (``given_up``, counted under the
    first source that speaks for its upstream, :data:`NO_SOURCE` when none does), registered
    on ``registry``: the single process's, or the supervisor's own (one reconciler per relay);
    None: a private one (metrics off)."""

    def __init__(self, *, registry: CollectorRegistry | None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self._reconciled = Counter(
            "relay_reconciled", "In-doubt records resolved (or given up) by the reconciler, "
            "by evidence source and result", ["source", "result"], registry=registry)

    def declare(self, sources: Iterable[str]) -> None:
        """Show each configured source's series from the start (at 0)."""
        for source in sources:
            for result in RECONCILE_RESULTS:
                self._reconciled.labels(source, result)

    def reconciled(self, source: str, result: str) -> None:
        """Count one record: ``result`` one of :data:`RECONCILE_RESULTS`."""
        self._reconciled.labels(source, result).inc()


CONSOLE_SIGN_INS = ("succeeded", "failed", "refused")
CONSOLE_REFUSALS = ("anonymous", "csrf", "role", "expired")
CONSOLE_ACTIONS = ("release", "mark_sent")


class ConsoleMetrics:
    """The web console's counters, registered on ``registry`` (the single process's, or the
    supervisor's own; None: a private one, metrics off):
    ``relay_console_sign_ins_total{result}`` (``succeeded``, ``failed``: a wrong user or
    password, ``refused``: the address's guess budget was spent, unchecked),
    ``relay_console_refusals_total{reason}`` (requests refused: ``anonymous`` without a
    session, ``expired`` session, ``csrf`` token missing or wrong, ``role`` a viewer's action)
    and ``relay_console_actions_total{action}`` (``release``, ``mark_sent`` done)."""

    def __init__(self, *, registry: CollectorRegistry | None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        sign_ins = Counter("relay_console_sign_ins", "Console sign-ins by result", ["result"],
                           registry=registry)
        refusals = Counter("relay_console_refusals", "Console requests refused by reason",
                           ["reason"], registry=registry)
        actions = Counter("relay_console_actions", "Console actions done by kind", ["action"],
                          registry=registry)
        self._sign_ins = {r: sign_ins.labels(r) for r in CONSOLE_SIGN_INS}
        self._refusals = {r: refusals.labels(r) for r in CONSOLE_REFUSALS}
        self._actions = {a: actions.labels(a) for a in CONSOLE_ACTIONS}

    def signed_in(self, result: str) -> None:
        """Count one sign-in attempt (a :data:`CONSOLE_SIGN_INS` value)."""
        self._sign_ins[result].inc()

    def refused(self, reason: str) -> None:
        """Count one refused request (a :data:`CONSOLE_REFUSALS` value)."""
        self._refusals[reason].inc()

    def acted(self, action: str) -> None:
        """Count one action done (a :data:`CONSOLE_ACTIONS` value)."""
        self._actions[action].inc()


def workers_registry(path: str, worker_pids: Callable[[], Mapping[int, int]]
                     ) -> CollectorRegistry:
    """The supervisor's registry (``workers`` > 1): every worker's metrics read from the
    multiprocess directory ``path`` (``PROMETHEUS_MULTIPROC_DIR`` of the workers), with
    ``relay_build``, the supervisor's own ``process_*`` / ``python_*`` collectors, and each
    live worker's memory and CPU (:class:`WorkerProcesses` over ``worker_pids``)."""
    registry = CollectorRegistry()
    registry.register(worker_files(path))
    Info("relay_build", "Build information", registry=registry).info({"version": __version__})
    register_runtime_collectors(registry)
    registry.register(WorkerProcesses(worker_pids))
    return registry


class WorkerProcesses:
    """``relay_worker_resident_memory_bytes{worker}`` and ``relay_worker_cpu_seconds_total
    {worker}`` of the live worker processes (``pids``: worker index -> pid), read from
    ``/proc/PID/statm`` and ``/proc/PID/stat`` at scrape time: the supervisor's ``process_*``
    describe the supervisor alone. A worker restarted under the same index starts its CPU
    counter again (a counter reset); one whose files cannot be read (it just exited) is
    left out. Absent where there is no ``/proc``."""

    _TICKS = os.sysconf("SC_CLK_TCK")
    _PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, pids: Callable[[], Mapping[int, int]]) -> None:
        self._pids = pids

    def collect(self) -> Iterator[Metric]:
        """The two families, one sample per live worker."""
        memory = GaugeMetricFamily("relay_worker_resident_memory_bytes",
                                   "Resident memory of each worker process", labels=["worker"])
        cpu = CounterMetricFamily("relay_worker_cpu_seconds",
                                  "User and system CPU time of each worker process",
                                  labels=["worker"])
        for index, pid in sorted(self._pids().items()):
            usage = self._usage(pid)
            if usage is not None:
                memory.add_metric([str(index)], usage[0])
                cpu.add_metric([str(index)], usage[1])
        yield memory
        yield cpu

    def _usage(self, pid: int) -> tuple[float, float] | None:
        """``(resident bytes, CPU seconds)`` of ``pid``, None when /proc does not say."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/statm", encoding="ascii") as statm:
                resident = int(statm.read().split()[1]) * self._PAGE
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
                # the fields after the command name (which may hold blanks and parentheses):
                # utime and stime are the 14th and 15th of the whole line (proc(5))
                fields = stat.read().rsplit(")", 1)[1].split()
            return float(resident), (int(fields[11]) + int(fields[12])) / self._TICKS
        return None


def worker_gone(path: str, pid: int) -> None:
    """Drop the live-only gauge values (``livesum``, ``livemin``) of the exited worker ``pid``
    from the multiprocess directory ``path``; its counters and histograms stay counted."""
    multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


def components_up(path: str) -> dict[str, float]:
    """``relay_component_up`` by component over the live workers of the multiprocess directory
    ``path``: 1.0 when every worker's last probe of it answered, 0.0 otherwise; {} before any
    worker set it."""
    for metric in worker_files(path).collect():
        if metric.name == "relay_component_up":
            return {s.labels["component"]: float(s.value) for s in metric.samples}
    return {}


def ledger_totals(path: str) -> tuple[int, int]:
    """``relay_ledger_dropped_total`` summed over every worker (live or gone) and
    ``relay_ledger_queue_rows`` over the live ones, of the multiprocess directory ``path``:
    (dropped, queued)."""
    dropped = queued = 0
    for metric in worker_files(path).collect():
        if metric.name == "relay_ledger_dropped":
            dropped = int(sum(s.value for s in metric.samples if s.name.endswith("_total")))
        elif metric.name == "relay_ledger_queue_rows":
            queued = int(sum(s.value for s in metric.samples))
    return dropped, queued


def upstreams_up(path: str) -> dict[str, float]:
    """``relay_upstream_up`` by upstream name over the live workers of the multiprocess
    directory ``path``: 1.0 when the upstream is ready in every worker, 0.0 otherwise; {}
    before any worker set it."""
    for metric in worker_files(path).collect():
        if metric.name == "relay_upstream_up":
            return {s.labels["upstream"]: float(s.value) for s in metric.samples}
    return {}
