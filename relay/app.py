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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from relay.console.server import Console
from relay.core.cancellation import AFTER_DOT_WAIT_S
from relay.core.dedup import DedupCore
from relay.core.dsn import DsnSender
from relay.core.errors import ConfigError
from relay.core.interfaces import FingerprintStore
from relay.core.message import DecisionObserver
from relay.core.observers import OweNotices, RecordDecisions
from relay.core.tracing import NO_TRACING
from relay.listen import Inherited, bind, bind_error, serve_on
from relay.ops.health import HealthMonitor
from relay.ops.http import OpsServer
from relay.ops.metrics import ConfigReloadMetrics, PrometheusMetrics
from relay.ops.tracing import FLUSH_S, OtelTracer, start_tracing
from relay.settings import Settings, file_warnings
from relay.smtp.auth import SaslMechanisms
from relay.smtp.handler import ListenerSecurity, RelayHandler, smtp_factory
from relay.smtp.implicit_tls import ImplicitTlsFactory, implicit_tls_factory
from relay.store.journal import SettleJournal
from relay.upstream.failover import FailoverUpstream
from relay.upstream.oauth import TOKEN_FAILURES, TokenProvider
from relay.upstream.pool import default_pool_size

if TYPE_CHECKING:  # the postgres extra: imported only where a ledger is configured
    from relay.store.postgres.ledger import PostgresLedger

log = logging.getLogger("relay.app")

LEDGER_FLUSH_S = 5.0
"""Seconds the audit ledger's queued rows, and a token request in flight, get to land when
the relay stops."""


class Relay:
    """One running relay: ``await start()``, then ``await stop()``.

    ``registry`` lets tests inject a fresh prometheus registry. After start, ``port`` is the
    bound SMTP port (useful with ``listen = 127.0.0.1:0``), ``tls_port`` the implicit-TLS one
    and ``metrics_port`` the metrics server's. ``inherited``: a worker's sockets
    (:class:`relay.listen.Inherited`), served instead of binding ``listen`` and ``tls_listen``.
    """

    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None,
                 inherited: Inherited | None = None) -> None:
        self.settings = settings
        self.inherited = inherited
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = PrometheusMetrics(registry=self.registry)
        # a worker's reloads are counted by its supervisor (one per reload of the relay)
        self.reloads = ConfigReloadMetrics(registry=self.registry) if inherited is None else None
        self.store: FingerprintStore | None = None
        self.ledger: PostgresLedger | None = None
        self.upstream: FailoverUpstream | None = None
        self.tokens: TokenProvider | None = None  # OAuth2 tokens of smarthost AUTH
        self.dsn: DsnSender | None = None
        self.core: DedupCore | None = None
        self.security: ListenerSecurity | None = None
        self.sasl: SaslMechanisms | None = None
        self.handler: RelayHandler | None = None
        self.journal: SettleJournal | None = None
        self.health: HealthMonitor | None = None
        self.tracer: OtelTracer | None = None  # None: tracing off (no OTEL_* exporter)
        self._servers: list[asyncio.base_events.Server] = []
        self._tls_factory: ImplicitTlsFactory | None = None
        self._ops: OpsServer | None = None
        self.console: Console | None = None  # without a supervisor, with console_listen
        self._stopped = False
        self.port = self.tls_port = self.metrics_port = 0

    @property
    def _first_worker(self) -> bool:
        return self.inherited is None or self.inherited.index == 0

    async def start(self) -> None:
        """Open the store and the ledger, build the upstream, the core and the listener, pay
        the settle journal, then serve SMTP and (without a supervisor) metrics."""
        s, metrics = self.settings, self.metrics
        self.tracer = start_tracing(os.environ)
        self.store = await s.open_store(window_s=s.dedup_window)
        policy = s.dedup_policy()
        try:
            self.ledger = await s.open_ledger(metrics, instance=f"{s.hostname}/{os.getpid()}",
                                              secret=policy.secret, timeout_s=s.ledger_timeout)
        except BaseException:  # a missing ledger schema: the store opened above is closed
            await self.store.close()
            self.store = None
            raise
        metrics.declare_upstreams(entry.label for entry in s.upstream)
        self.tokens = s.smarthost_tokens(on_failure=metrics.oauth_token_failure)
        if self.tokens is not None:
            metrics.declare_token_failures(TOKEN_FAILURES)
        self.upstream = s.failover_upstream(
            local_hostname=s.hostname, health_interval_s=s.health_interval, metrics=metrics,
            default_pool_size=default_pool_size(s.max_connections, s.effective_workers),
            token_provider=self.tokens)
        self.dsn = s.dsn_sender(self.upstream, metrics, reporting_mta=s.hostname,
                                log_addresses=s.log_recipients)
        metrics.declare_rate_limits(r.label for r in s.rate_limit)
        metrics.declare_key_rules(r.name for r in s.key_rule)
        self.journal = SettleJournal(Path(s.settle_journal) if s.settle_journal else None,
                                     self.store, prefix=s.store_prefix,
                                     url_name=s.store_url_name)
        observers: list[DecisionObserver] = []
        if self.dsn is not None:
            observers.append(OweNotices(self.dsn))
        if self.ledger is not None:
            observers.append(RecordDecisions(self.ledger))
        self.core = DedupCore(
            store=self.store, upstream=self.upstream, metrics=metrics, policy=policy,
            limiter=s.rate_limiter(self.store), rate_limits=s.rate_rules(),
            # the rate limits' ``upstream`` scope: the upstream a message would be tried on first
            upstream_name=self.upstream.preferred_name,
            gates=() if self.ledger is None else (self.ledger,), observers=observers,
            tracer=self.tracer if self.tracer is not None else NO_TRACING,
            settle_log=self.journal)
        self.security = s.security()
        users = s.auth_users()
        self.sasl = None if users is None else SaslMechanisms.under(
            s.auth_attempts(users), on_failure=metrics.auth_failure,
            on_refused=metrics.auth_refused)
        await self.journal.pay(self.core)  # every process, every start: a killed one's lines
        limits = s.listener_limits(allowed_senders=s.allowed_senders,
                                   local_part_case_sensitive=s.local_part_case_sensitive,
                                   log_recipients=s.log_recipients)
        self.handler = RelayHandler(core=self.core, metrics=metrics, limits=limits,
                                    sasl=self.sasl)
        await self._serve(smtp_factory(self.handler, limits, self.security, s.processing_s),
                          smtp_factory(self.handler, limits, self.security, s.processing_s,
                                       implicit_tls=True))
        await self._start_health()
        await self._start_console()
        self._log_started()

    async def _start_console(self) -> None:
        """Without a supervisor, serve the console on the relay's own store client (a worker's
        is its supervisor's); its metrics go with the relay's."""
        s = self.settings
        address = s.console_address
        if address is None or self.inherited is not None:
            return
        self.console = Console(s, store=self.store, registry=self.registry)
        try:
            await self.console.start()
        except OSError as exc:
            raise bind_error(*address, "console_listen", exc) from exc

    async def _serve(self, factory: Any, tls_factory: Any) -> None:
        """Serve the SMTP listener and, with TLS configured, the implicit-TLS one (plain TCP:
        clients are admitted before their handshake, :mod:`relay.smtp.implicit_tls`)."""
        s, inherited, security = self.settings, self.inherited, self.security
        assert security is not None
        smtp = ([await bind(factory, *s.listen_address, "listen")] if inherited is None
                else await serve_on(factory, inherited.listen, "listen"))
        self._servers += smtp
        self.port = smtp[0].sockets[0].getsockname()[1]
        tls_address = s.tls_listen_address
        if tls_address is None or security.tls_context is None:
            return
        self._tls_factory = implicit_tls_factory(
            tls_factory, gate=security.gate, proxy_networks=security.proxy_networks,
            context=security.tls_context, handshake_timeout_s=s.tls_handshake_timeout)
        tls = ([await bind(self._tls_factory, *tls_address, "tls_listen")] if inherited is None
               else await serve_on(self._tls_factory, inherited.tls_listen, "tls_listen"))
        self._servers += tls
        self.tls_port = tls[0].sockets[0].getsockname()[1]

    async def _start_health(self) -> None:
        """Probe the store, the upstreams and the ledger (``relay_component_up``); without a
        supervisor serve /metrics, /healthz and /readyz too (a worker's are its supervisor's)."""
        s = self.settings
        address = s.metrics_address
        if address is None or self.store is None or self.upstream is None:
            return
        self.health = HealthMonitor(
            store=self.store, upstream=self.upstream, metrics=self.metrics,
            interval_s=s.health_interval, timeout_s=s.health_timeout,
            upstream_states=self._upstream_states, ledger=self.ledger)
        await self.health.start()
        if self.inherited is not None:
            return
        self._ops = OpsServer(registry=self.registry, health=self.health, host=address[0],
                              port=address[1])
        try:
            await self._ops.start()
        except OSError as exc:
            raise bind_error(*address, "metrics_listen", exc) from exc
        self.metrics_port = self._ops.port

    def _upstream_states(self) -> dict[str, dict[str, object]]:
        """Each upstream's state by name (the ``/readyz`` body)."""
        if self.upstream is None:
            return {}
        return {name: dataclasses.asdict(state)
                for name, state in self.upstream.states().items()}

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
        if self._first_worker:
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
        if self.security is not None and self.handler is not None:
            await merged.apply_access_live(
                applied, security=self.security, handler=self.handler,
                auth_users=None if self.sasl is None else self.sasl.credentials)
        if self.core is not None:
            merged.apply_dedup_live(applied, core=self.core,
                                     declare_rate_limits=self.metrics.declare_rate_limits)
        merged.apply_operations_live(applied)
        if self.console is not None:
            try:
                await self.console.reload(merged, applied)
            except ConfigError as exc:  # checked by the reload already: a file changed since
                log.error("console not reloaded: %s", exc)
        self.settings = merged

    def count_reload(self, *, applied: bool) -> None:
        """Count a configuration reload, applied or refused, in ``relay_config_reloads_total``
        (a worker's are counted by its supervisor: nothing then)."""
        if self.reloads is not None:
            self.reloads.reloaded(applied=applied, now=time.time())

    async def stop(self) -> None:
        """Graceful shutdown (design.md §6.6), in this order.

        1. Stop accepting connections. 2. Idle sessions are told ``421 4.3.2`` and closed;
        sessions inside DATA finish that transaction, then get the same. 3. Wait up to
        ``shutdown_grace`` seconds for them, for settlements still being retried and for
        DSNs still being sent.
        4. Past the grace, cut what is left: a transaction whose final dot had not gone out is
        released (the client's retry is relayed), one past the dot is marked UNKNOWN (unless
        its wait for a reply ends with the dot still unsent in the kernel: reset, released).
        5. Stop the settle retries (what they owe is in the settle journal). 6. Close the
        metrics server, the upstream and the store. A second call does nothing.
        """
        if self._stopped:
            return
        self._stopped = True
        for server in self._servers:
            server.close()
        if self._tls_factory is not None:  # a handshake finishing now would start a session
            self._tls_factory.cancel_handshakes()
        if self.handler is not None:
            for session in list(self.handler.sessions):
                session.begin_shutdown()
        if not await self._drained(self.settings.shutdown_grace):
            await self._cut()
        if self.journal is not None and self.core is not None:
            await self.journal.write(self.core)
        await self._close_parts()

    async def _close_parts(self) -> None:
        """Close the metrics server, the health probes, the upstream; wait for the OAuth2
        token request in flight (its reply may rotate the refresh token) while the ledger's
        rows land (both within :data:`LEDGER_FLUSH_S`); close the store; export the spans
        still queued."""
        if self._ops is not None:
            await self._ops.stop()
        if self.console is not None:
            await self.console.stop()
        if self.health is not None:
            await self.health.stop()
        if self.upstream is not None:
            await self.upstream.close()
        closing = []
        if self.tokens is not None:
            closing.append(self.tokens.close(timeout_s=LEDGER_FLUSH_S))
        if self.ledger is not None:  # every message is answered: its rows are queued
            closing.append(self.ledger.close(flush_s=LEDGER_FLUSH_S))
        await asyncio.gather(*closing)
        if self.store is not None:
            await self.store.close()
        if self.tracer is not None and not await asyncio.to_thread(self.tracer.shutdown):
            log.warning("tracing: the spans still queued were not exported within %.0f s: "
                        "dropped", FLUSH_S)

    def _pending(self) -> set[asyncio.Task[Any]]:
        pending: set[asyncio.Task[Any]] = set()
        if self.handler is not None:
            pending |= self.handler.tasks
        if self.core is not None:
            pending |= self.core.background
        if self.dsn is not None:
            pending |= self.dsn.background  # notices owed for mail already answered 250
        return pending

    async def _drained(self, grace_s: float) -> bool:
        """Wait until no session is inside DATA and nothing is pending; False past the grace."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while loop.time() < deadline:
            busy = self.handler is not None and any(s.busy for s in self.handler.sessions)
            if not busy and not self._pending():
                return True
            await asyncio.sleep(0.05)
        return False

    async def _cut(self) -> None:
        """Past the grace: cancel what is left (the core settles cut transactions), close."""
        pending = self._pending()
        messages = len(self.handler.tasks) if self.handler is not None else 0
        log.warning("shutdown grace over: cutting %d message(s) and %d settle retry loop(s) "
                    "(what they still owe stays in the settle journal)",
                    messages, len(pending) - messages)
        for task in pending:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            # a transaction whose final dot is out waits for its reply first
            await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True),
                                   AFTER_DOT_WAIT_S + 4 * self.settings.store_timeout)
        await self._drained(1.0)  # let the cut transactions' sessions send their 451
        if self.handler is not None:
            for session in list(self.handler.sessions):
                session.close_now()
