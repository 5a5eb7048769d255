"""Composition root: :class:`Relay` builds each part from its settings section, enters the
parts in order and stops them in the reverse order; a reload is handed to each part's live
settings (:meth:`Relay.apply`). Binding and serving the process (signals, the run loop) are
:mod:`relay.serving`'s; each part's builder is its section's (:mod:`relay.settings`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from relay.core.dedup import DedupCore
from relay.core.dsn import DsnSender
from relay.core.errors import ConfigError
from relay.core.gates import Gates, RateLimits
from relay.core.interfaces import FingerprintStore
from relay.core.observers import OweNotices, RecordDecisions
from relay.listen import Inherited, SmtpListeners, bind_error, serve_smtp
from relay.ops.health import HealthMonitor
from relay.ops.measured import MeasuredLimiter
from relay.ops.metrics import ConfigReloadMetrics, PrometheusMetrics
from relay.ops.observed import observed_core
from relay.ops.tracing import FLUSH_S, OtelTracer, start_tracing
from relay.settings import Settings, file_warnings
from relay.smtp.auth import SaslMechanisms
from relay.smtp.drain import drain
from relay.smtp.handler import ListenerSecurity, RelayHandler, smtp_factory
from relay.store.journal import SettleJournal
from relay.upstream.failover import FailoverUpstream
from relay.upstream.oauth import TOKEN_FAILURES, TokenProvider
from relay.upstream.pool import default_pool_size

if TYPE_CHECKING:  # the postgres extra: imported only where a ledger is configured
    from relay.console.server import Console
    from relay.store.postgres.ledger import PostgresLedger

log = logging.getLogger("relay.app")

LEDGER_FLUSH_S = 5.0
"""Seconds the audit ledger's queued rows, and a token request in flight, get to land when
the relay stops."""


@dataclass(frozen=True)
class Parts:
    """The parts of a started relay that a reload reaches and the tests look at."""

    store: FingerprintStore
    ledger: PostgresLedger | None
    upstream: FailoverUpstream
    core: DedupCore
    security: ListenerSecurity
    sasl: SaslMechanisms | None
    handler: RelayHandler
    console: Console | None


class Relay:
    """One running relay: ``await start()``, then ``await stop()``.

    ``registry`` lets tests inject a fresh prometheus registry. After start, ``port`` is the
    bound SMTP port (useful with ``listen = 127.0.0.1:0``), ``tls_port`` the implicit-TLS one,
    ``metrics_port`` the metrics server's, and :attr:`parts` its parts. ``inherited``: a
    worker's sockets (:class:`relay.listen.Inherited`), served instead of binding ``listen``
    and ``tls_listen``."""

    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None,
                 inherited: Inherited | None = None) -> None:
        self.settings = settings
        self.inherited = inherited
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = PrometheusMetrics(registry=self.registry)
        # a worker's reloads are counted by its supervisor (one per reload of the relay)
        self.reloads = ConfigReloadMetrics(registry=self.registry) if inherited is None else None
        self._stack = contextlib.AsyncExitStack()  # the parts entered, closed in reverse
        self._parts: Parts | None = None
        self._stopped = False
        self.port = self.tls_port = self.metrics_port = 0

    @property
    def parts(self) -> Parts:
        """Raises RuntimeError before :meth:`start` ends."""
        if self._parts is None:
            raise RuntimeError("the relay has not started")
        return self._parts

    @property
    def store(self) -> FingerprintStore:
        return self.parts.store

    @property
    def core(self) -> DedupCore:
        return self.parts.core

    @property
    def ledger(self) -> PostgresLedger | None:
        return self.parts.ledger

    @property
    def console(self) -> Console | None:
        return self.parts.console

    async def start(self) -> None:
        """Open the store and the ledger, build the upstream, the core and the listener, pay
        the settle journal, then serve SMTP and (without a supervisor) metrics; each part
        entered on the exit stack that :meth:`stop` closes (at once when a later one fails)."""
        s, metrics = self.settings, self.metrics
        async with contextlib.AsyncExitStack() as stack:
            tracer = start_tracing(os.environ)
            if tracer is not None:
                stack.push_async_callback(_end_tracing, tracer)
            metrics.declare_upstreams(entry.label for entry in s.upstream)
            tokens = s.smarthost_tokens(on_failure=metrics.oauth_token_failure)
            if tokens is not None:
                metrics.declare_token_failures(TOKEN_FAILURES)
            store = await s.open_store(window_s=s.dedup_window)
            stack.push_async_callback(store.close)
            policy = s.dedup_policy()
            ledger = await s.open_ledger(metrics, instance=f"{s.hostname}/{os.getpid()}",
                                         policy=policy, timeout_s=s.ledger_timeout)
            stack.push_async_callback(_land, tokens, ledger)
            upstream = s.failover_upstream(
                local_hostname=s.hostname, health_interval_s=s.health_interval,
                metrics=metrics, token_provider=tokens,
                default_pool_size=default_pool_size(s.max_connections, s.effective_workers))
            stack.push_async_callback(upstream.close)
            dsn = s.dsn_sender(upstream, metrics, reporting_mta=s.hostname,
                               log_addresses=s.log_recipients)
            metrics.declare_rate_limits(r.label for r in s.rate_limit)
            metrics.declare_key_rules(r.name for r in s.key_rule)
            journal = SettleJournal(Path(s.settle_journal) if s.settle_journal else None,
                                    store, prefix=s.store_prefix, url_name=s.store_url_name)
            limiter = s.rate_limiter(store)
            core, message_core = observed_core(
                store=store, upstream=upstream, metrics=metrics, policy=policy, tracer=tracer,
                # the rate limits' ``upstream`` scope: the upstream a message is tried on first
                gates=Gates(admissions=() if ledger is None else (ledger,),
                            rate_limits=None if limiter is None else RateLimits(
                                MeasuredLimiter(limiter, metrics), s.rate_rules(),
                                upstream.preferred_name)),
                observers=[*([OweNotices(dsn)] if dsn is not None else []),
                           *([RecordDecisions(ledger)] if ledger is not None else [])],
                journal=journal)
            security = s.security()
            sasl = None if (users := s.auth_users()) is None else SaslMechanisms.under(
                s.auth_attempts(users), on_failure=metrics.auth_failure,
                on_refused=metrics.auth_refused)
            await journal.pay(core)  # every process, every start: a killed one's lines
            stack.push_async_callback(journal.write, core)
            # the metrics server, health probes and console: closed once the listener drained
            services = await stack.enter_async_context(contextlib.AsyncExitStack())
            limits = s.listener_limits(allowed_senders=s.allowed_senders,
                                       local_part_case_sensitive=s.local_part_case_sensitive,
                                       log_recipients=s.log_recipients, console_url=s.console_url)
            handler = RelayHandler(core=message_core, metrics=metrics, limits=limits,
                                   sasl=sasl)
            served = await serve_smtp(s, self.inherited, security, smtp_factory(
                handler, limits, security, s.processing_s), smtp_factory(
                handler, limits, security, s.processing_s, implicit_tls=True))
            stack.push_async_callback(self._drain, handler, served, core, dsn)
            self.port, self.tls_port = served.port, served.tls_port
            await self._start_health(services, store, upstream, ledger)
            self._parts = Parts(store, ledger, upstream, core, security, sasl, handler,
                                 await self._start_console(services, store))
            self._stack = stack.pop_all()
        self._log_started()

    async def _start_console(self, stack: contextlib.AsyncExitStack,
                             store: FingerprintStore) -> Console | None:
        """The console of a relay without a supervisor (a worker's is its supervisor's)."""
        s, address = self.settings, self.settings.console_address
        if address is None or self.inherited is not None:
            return None
        from relay.console.server import Console  # a worker never serves it
        console = Console(s, store=store, registry=self.registry)
        try:
            await console.start()
        except OSError as exc:
            raise bind_error(*address, "console_listen", exc) from exc
        stack.push_async_callback(console.stop)
        return console

    async def _start_health(self, stack: contextlib.AsyncExitStack, store: FingerprintStore,
                            upstream: FailoverUpstream, ledger: PostgresLedger | None) -> None:
        """Probe the store, the upstreams and the ledger (``relay_component_up``); without a
        supervisor serve /metrics, /healthz and /readyz too (a worker's are its supervisor's)."""
        s, address = self.settings, self.settings.metrics_address
        if address is None:
            return
        health = HealthMonitor(
            store=store, upstream=upstream, metrics=self.metrics,
            interval_s=s.health_interval, timeout_s=s.health_timeout,
            ledger=ledger, upstream_states=lambda: {  # the /readyz body
                name: dataclasses.asdict(state) for name, state in upstream.states().items()})
        await health.start()
        stack.push_async_callback(health.stop)
        if self.inherited is not None:
            return
        from relay.ops.http import OpsServer  # a worker never serves it
        ops = OpsServer(registry=self.registry, health=health, host=address[0],
                        port=address[1])
        try:
            await ops.start()
        except OSError as exc:
            raise bind_error(*address, "metrics_listen", exc) from exc
        stack.push_async_callback(ops.stop)
        self.metrics_port = ops.port

    def _log_started(self) -> None:
        """The start-up line (every listener with its TLS and AUTH, the upstream, the store,
        the metrics address and the event loop) and each section's warnings."""
        s = self.settings
        tls = s.tls_listen_address
        listeners = s.describe_listeners(
            (s.listen_address[0], self.port),
            (tls[0], self.tls_port) if tls is not None and self.tls_port else None)
        metrics_port = self.metrics_port if self.inherited is None else \
            self.inherited.metrics_port
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
        if self.inherited is None or self.inherited.index == 0:  # the first worker
            for warning in [*s.dedup_warnings(), *file_warnings(s)]:
                log.warning("%s", warning)
        log.info("listening on %s; upstream %s, store %s, %s%s", listeners,
                 s.describe_upstream(), s.describe_store(),
                 s.describe_operations(metrics_port,
                                       "uvloop" if loop == "uvloop" else "asyncio"),
                 "" if self.console is None else f", {self.console.describe()}")
        for warning in s.upstream_warnings():
            log.warning("%s", warning)

    async def apply(self, merged: Settings, applied: Set[str]) -> None:
        """Apply the reloadable settings named in ``applied`` (their values in ``merged``) to
        the running parts, each by its section: access from the next connection, MAIL, AUTH
        or handshake; the dedup rules and rate limits from the next message; the log level at
        once. Raises :class:`ConfigError` when a file does not load; then nothing was
        applied."""
        parts = self._parts
        if parts is not None:
            await merged.apply_access_live(
                applied, security=parts.security, handler=parts.handler,
                auth_users=None if parts.sasl is None else parts.sasl.credentials)
            merged.apply_dedup_live(applied, core=parts.core, metrics=self.metrics)
        merged.apply_operations_live(applied)
        if parts is not None and parts.console is not None:
            try:
                await parts.console.reload(merged, applied)
            except ConfigError as exc:  # checked by the reload already: a file changed since
                log.error("console not reloaded: %s", exc)
        self.settings = merged

    def count_reload(self, *, applied: bool) -> None:
        """Count a reload in ``relay_config_reloads_total`` (a worker's: by its supervisor)."""
        if self.reloads is not None:
            self.reloads.reloaded(applied=applied, now=time.time())

    async def stop(self) -> None:
        """Graceful shutdown (design.md §6.6), the parts closed in the reverse order of their
        start: the listener drained (:func:`relay.smtp.drain.drain`); the console, metrics
        server and health probes; the settle retries (what they owe stays in the settle
        journal); the upstream, the token request and the ledger, the store, the spans. A
        second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        await self._stack.aclose()

    async def _drain(self, handler: RelayHandler, served: SmtpListeners, core: DedupCore,
                     dsn: DsnSender | None) -> None:
        """Drain the listener within ``shutdown_grace``; copies waiting are answered at once."""
        core.stop_waiting()
        await drain(handler, served.servers, served.tls_factory,
                    lambda: {*handler.tasks, *core.background,
                             *(dsn.background if dsn is not None else ())},
                    grace_s=self.settings.shutdown_grace,
                    store_timeout_s=self.settings.store_timeout)


async def _land(tokens: TokenProvider | None, ledger: PostgresLedger | None) -> None:
    """Wait for the OAuth2 token request in flight (its reply may rotate the refresh token)
    while the ledger's queued rows land, both within :data:`LEDGER_FLUSH_S`."""
    await asyncio.gather(*([] if tokens is None else [tokens.close(timeout_s=LEDGER_FLUSH_S)]),
                         *([] if ledger is None else [ledger.close(flush_s=LEDGER_FLUSH_S)]))


async def _end_tracing(tracer: OtelTracer) -> None:
    """Export the spans still queued, within :data:`relay.ops.tracing.FLUSH_S`."""
    if not await asyncio.to_thread(tracer.shutdown):
        log.warning("tracing: the spans still queued were not exported within %.0f s: "
                    "dropped", FLUSH_S)
