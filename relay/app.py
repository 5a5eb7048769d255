"""Composition root: builds the store, upstream, metrics, core and listener from Settings.

:class:`Relay` starts and stops them in order (stop accepting, let in-flight messages finish
within the shutdown grace, close the upstream and the store); :func:`run` serves until
SIGTERM or SIGINT. Only this module constructs concrete parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import signal
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from prometheus_client import CollectorRegistry

from relay.config import (
    Settings,
    UpstreamEntry,
    read_secret_file,
    redact_url,
    setting_names,
    split_host_port,
)
from relay.core.cancellation import AFTER_DOT_WAIT_S
from relay.core.dedup import DedupCore, Policy, TemplateRule
from relay.core.dsn import DsnSender
from relay.core.errors import ConfigError, StartupError, StoreError
from relay.core.interfaces import FingerprintStore, RateLimiter, Upstream
from relay.core.limits import RateRule
from relay.ops.health import HealthMonitor
from relay.ops.http import OpsServer
from relay.ops.metrics import ConfigReloadMetrics, PrometheusMetrics
from relay.smtp.access import ConnectionGate, parse_networks
from relay.smtp.auth import CredentialFile, SaslMechanisms
from relay.smtp.handler import ListenerLimits, ListenerSecurity, RelayHandler, smtp_factory
from relay.smtp.implicit_tls import ImplicitTlsFactory, implicit_tls_factory
from relay.smtp.tls import server_context
from relay.store.journal import add_to_journal, read_journal, remove_from_journal
from relay.store.postgres.ledger import LedgerOptions, PostgresLedger
from relay.store.postgres.store import PostgresStore, is_postgres_url
from relay.store.redis.store import RedisStore
from relay.store.sqlite import SqliteStore, sqlite_path_from_url
from relay.upstream.failover import FailoverMetrics, FailoverUpstream
from relay.upstream.maildir import MaildirUpstream
from relay.upstream.oauth import OAuthConfig, TokenProvider
from relay.upstream.oauth import tls_context as oauth_tls_context
from relay.upstream.pool import default_pool_size
from relay.upstream.smtp import SmtpUpstream, SmtpUpstreamConfig

log = logging.getLogger("relay.app")

# redis-py URL options that name a file (the CA bundle, a client certificate and its key)
_STORE_FILE_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
_SQLITE_HEADER = b"SQLite format 3\x00"
# libpq URL parameters that name a file (asyncpg reads them at connect time)
_POSTGRES_FILE_OPTIONS = ("sslrootcert", "sslcert", "sslkey", "sslcrl", "passfile")


def check_settings(settings: Settings, *, store: bool = True) -> None:
    """Check what the settings name outside themselves, as :meth:`Relay.start` reads it, without
    opening the store or binding a port: the upstream password file, the TLS certificate and
    key (loaded as a pair), the credentials file (parsed), the files a store URL names
    (``ssl_ca_certs=`` ...), an existing SQLite file's format, and that the SQLite file's and
    the settle journal's directories exist or can be made and are writable.

    ``serve`` and ``check-config`` both call it. ``store=False`` (a reload: the store cannot
    change live) leaves the store's files alone: a process that has the SQLite file open must
    never open and close it again, because closing any descriptor of a file drops every POSIX
    lock the process holds on it (fcntl(2)), and another process closing its connection would
    then delete the live WAL (the records in it lost at the next crash). Raises
    :class:`ConfigError` with one line per problem, each naming its setting (flag, env var,
    file key).
    """
    problems: list[str] = []

    def check(fields: tuple[str, ...], action: Any) -> None:
        try:
            action()
        except ConfigError as exc:
            text = str(exc).removeprefix("tls-cert/tls-key: ")  # relay.smtp.tls's own prefix
            names = "; ".join(setting_names(f) for f in fields)
            problems.append(text if names in text else f"{', '.join(fields)}: {text} ({names})")

    s = settings
    check(("upstream_password_file",), s.upstream_password_value)
    for entry in s.upstream:
        if entry.password_file is not None:
            check(("upstream",), functools.partial(_entry_secret, entry.password_file,
                                                   entry.label))
    check(("fingerprint_secret_file",), lambda: s.fingerprint_secret_bytes)
    check(("oauth_client_secret_file", "oauth_refresh_token_file"), s.oauth_secret_values)
    _check_tls_files(s, check)
    _check_entry_tls_files(s, check)
    if s.tls_cert is not None and s.tls_key is not None:
        cert, key = s.tls_cert, s.tls_key
        check(("tls_cert", "tls_key"), lambda: server_context(cert, key, s.tls_min_version))
    if s.auth_file is not None:
        auth_file = s.auth_file
        check(("auth_file",), lambda: CredentialFile.load(auth_file))
    check(("store",), lambda: _store_files(s.store) if store else None)
    check(("ledger",), lambda: postgres_files(s.ledger or ""))
    if s.settle_journal:
        journal = Path(s.settle_journal)
        check(("settle_journal",), lambda: _writable_file(journal, "the settle journal"))
    if s.pid_file:
        pid_file = Path(s.pid_file)
        check(("pid_file",), lambda: _writable_file(pid_file, "the pid file"))
    if problems:
        raise ConfigError("\n".join(problems))


def _check_tls_files(s: Settings, check: Callable[[tuple[str, ...], Any], None]) -> None:
    """The upstream's CA bundle and client certificate (loaded as a pair), the token
    endpoint's CA bundle: each must load into an SSLContext as the relay will load it."""
    def verify_with(path: Path) -> Callable[[], None]:
        return lambda: _load_tls(lambda: oauth_tls_context(path), f"{path}: no PEM CA file")

    if s.upstream_ca_file is not None:
        check(("upstream_ca_file",), verify_with(s.upstream_ca_file))
    if s.oauth_ca_file is not None:
        check(("oauth_ca_file",), verify_with(s.oauth_ca_file))
    cert, key = s.upstream_client_cert, s.upstream_client_key
    if cert is not None:
        context = ssl.create_default_context()
        check(("upstream_client_cert", "upstream_client_key"), lambda: _load_tls(
            lambda: context.load_cert_chain(cert, key, password=lambda: b""),
            f"{cert} and {key}: no PEM certificate chain and its private key"))


def _check_entry_tls_files(s: Settings, check: Callable[[tuple[str, ...], Any], None]
                           ) -> None:
    """The CA bundle and client certificate an ``upstream`` entry names itself, loaded as
    the relay will load them; each problem names the entry."""
    for entry in s.upstream:
        if entry.ca_file is not None:
            ca_file = entry.ca_file
            check(("upstream",), functools.partial(_load_tls, functools.partial(
                oauth_tls_context, ca_file), f"upstream {entry.label}: {ca_file}: no PEM CA file"))
        if entry.client_cert is not None or entry.client_key is not None:
            cert = entry.client_cert or s.upstream_client_cert
            key = entry.client_key or s.upstream_client_key
            if cert is None:
                continue  # refused by the settings' rules already
            context = ssl.create_default_context()
            check(("upstream",), functools.partial(_load_tls, functools.partial(
                context.load_cert_chain, cert, key, password=lambda: b""),
                f"upstream {entry.label}: {cert} and {key}: no PEM certificate chain and its "
                "private key"))


def _load_tls(load: Callable[[], object], what: str) -> None:
    """Run ``load``; raise ConfigError saying ``what`` when it fails with an SSL/OS error."""
    try:
        load()
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{what} ({exc})") from exc


def _store_files(store: str) -> None:
    """Raise ConfigError unless the files a store URL names are usable: a Redis URL's TLS
    files readable and its ``ssl_ca_certs`` PEM certificates; a SQLite file's directory."""
    if is_postgres_url(store):
        postgres_files(store)
        return
    if not store.startswith("redis"):
        _sqlite_file(Path(sqlite_path_from_url(store)))
        return
    for name, value in parse_qsl(urlsplit(store).query):
        if name in _STORE_FILE_OPTIONS:
            _readable(Path(value), f"{name}={value}")
        if name == "ssl_ca_certs":
            _ca_file(value)


def postgres_files(store: str) -> None:
    """Raise ConfigError unless the files a postgresql:// URL names (``sslrootcert``,
    ``sslcert``, ``sslkey``, ``sslcrl``, ``passfile``) are readable (no connection opened)."""
    for name, value in parse_qsl(urlsplit(store).query):
        if name in _POSTGRES_FILE_OPTIONS and value != "system":  # sslrootcert=system: the CAs
            _readable(Path(value).expanduser(), f"{name}={value}")


def _ca_file(path: str) -> None:
    """Raise ConfigError unless ``path`` holds PEM CA certificates (``ssl_ca_certs=``)."""
    try:
        ssl.create_default_context(cafile=path)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"ssl_ca_certs={path}: not a PEM CA certificate file ({exc})") from exc


def _readable(path: Path, what: str) -> None:
    """Raise ConfigError unless ``path`` is a file this process can read."""
    if not path.exists():
        raise ConfigError(f"{what}: no such file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{what}: not readable by this user")


def _writable_file(path: Path, what: str) -> None:
    """Raise ConfigError unless the file ``path`` can be written: it is a writable file, or it
    is missing and its nearest existing parent is a writable directory (the rest is made)."""
    if path.exists():
        if not path.is_file() or not os.access(path, os.R_OK | os.W_OK):
            raise ConfigError(f"{what} {path} is not a file this user can read and write")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path} cannot be made: {parent} is not a directory this "
                          "user can write")


def _sqlite_file(path: Path) -> None:
    """Raise ConfigError unless ``path`` is a SQLite database, empty, or can be made."""
    _writable_file(path, "the SQLite file")
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as file:
            if file.read(len(_SQLITE_HEADER)) != _SQLITE_HEADER:
                raise ConfigError(f"{path} is not a SQLite database")


LEDGER_FLUSH_S = 5.0
"""Seconds the audit ledger's queued rows get to land when the relay stops."""


def ledger_options(settings: Settings) -> LedgerOptions:
    """How this process writes ledger rows (``instance``: the relay's hostname and pid)."""
    return LedgerOptions(
        instance=f"{settings.hostname}/{os.getpid()}",
        recipients_full=settings.ledger_recipients == "full",
        keys_plain=settings.ledger_keys == "plain", secret=settings.fingerprint_secret_bytes,
        queue_max=settings.ledger_queue, required=settings.ledger_required,
        retention_s=settings.ledger_retention, in_doubt_after_s=settings.in_doubt_alert_after)


async def build_ledger(settings: Settings, metrics: PrometheusMetrics) -> PostgresLedger | None:
    """Open the audit ledger ``settings.ledger`` names (None without one). Raises
    :class:`StartupError` when its schema is missing or old, :class:`StoreError` for a URL
    the driver refuses."""
    if settings.ledger is None:
        return None
    metrics.declare_ledger()
    return await PostgresLedger.open(settings.ledger, metrics=metrics,
                                     options=ledger_options(settings),
                                     op_timeout_s=settings.ledger_timeout)


async def build_store(settings: Settings) -> FingerprintStore:
    """Open the store named by ``settings.store``: sqlite:///, or one Redis server (redis://,
    rediss://), a Redis Cluster (redis+cluster://) or a Sentinel-managed master
    (redis+sentinel://), the last two also as rediss+ (TLS), or PostgreSQL (postgresql://,
    postgres://: raises StartupError when its schema is missing or old)."""
    if is_postgres_url(settings.store):
        return await PostgresStore.open(settings.store, op_timeout_s=settings.store_timeout)
    if settings.store.startswith("redis"):  # redis, rediss and their +cluster, +sentinel forms
        store = RedisStore.from_url(settings.store, op_timeout_s=settings.store_timeout,
                                    window_s=settings.dedup_window)
        try:
            await store.ping()
            for warning in await store.check_server():
                log.warning("redis: %s", warning)
        except StoreError as exc:
            if "DB index is out of range" in str(exc):  # a setting error, not an outage
                await store.close()
                raise ConfigError(f"store: the Redis server has no database of that number "
                                  f"({redact_url(settings.store)})") from exc
            log.warning("redis not reachable at start-up (%s); will fail closed until it is", exc)
        return store
    return await SqliteStore.open(
        sqlite_path_from_url(settings.store), op_timeout_s=settings.store_timeout)


def build_upstream(settings: Settings, metrics: FailoverMetrics | None = None
                   ) -> FailoverUpstream:
    """The upstreams of ``settings.upstream`` in order, behind one :class:`FailoverUpstream`
    (a single one is always tried: no cool-down): the Maildir for ``maildir:PATH``, else an
    SMTP smarthost per entry, each with the entry's own settings over the global
    ``upstream_*`` ones. Raises ConfigError when an entry's password file cannot be read."""
    if settings.upstream[0].is_maildir:
        path = Path(settings.upstream[0].address[len("maildir:") :])
        members: list[tuple[str, Upstream]] = [
            (settings.upstream[0].label, MaildirUpstream(path=path))]
    else:
        provider = build_token_provider(settings)
        members = [(entry.label, SmtpUpstream(config=smtp_upstream_config(
            settings, entry, provider))) for entry in settings.upstream]
    return FailoverUpstream(
        members, cooldown_s=settings.upstream_cooldown,
        cooldown_max_s=settings.upstream_cooldown_max,
        # a probe waits as long as a delivery's connect does: an upstream that greets within
        # upstream_connect_timeout is not cooled down for being slower than a probe (the
        # readiness probe's own bound cancels a slow ping: not ready then, but no cool-down)
        probe_timeout_s=settings.upstream_connect_timeout,
        # each upstream's share of a readiness probe ends within HealthMonitor's own bound
        readiness_timeout_s=0.9 * min(settings.upstream_connect_timeout, 3.0,
                                      settings.health_interval * 2), metrics=metrics)


def smtp_upstream_config(settings: Settings, entry: UpstreamEntry,
                         token_provider: TokenProvider | None) -> SmtpUpstreamConfig:
    """The SMTP upstream ``entry`` (``HOST:PORT``): its own keys, else the global
    ``upstream_*`` settings. Raises ConfigError when its password file cannot be read, or
    its OAuth2 AUTH has no token provider or user."""
    s = settings
    host, port = split_host_port(entry.address, what="upstream")
    password = (_entry_secret(entry.password_file, entry.label)
                if entry.password_file is not None else s.upstream_password_value())
    try:
        return SmtpUpstreamConfig(
            host=host, port=port, local_hostname=s.hostname, name=entry.label,
            tls=entry.tls or s.upstream_tls,
            verify=s.upstream_verify if entry.verify is None else entry.verify,
            username=entry.user if entry.user is not None else s.upstream_user,
            password=password,
            connect_timeout_s=s.upstream_connect_timeout,
            command_timeout_s=s.upstream_command_timeout,
            final_timeout_s=s.upstream_timeout,
            pool_size=(entry.pool_size if entry.pool_size is not None
                       else default_pool_size(s.max_connections, s.effective_workers)
                       if s.upstream_pool_size is None else s.upstream_pool_size),
            pool_idle_s=s.upstream_pool_idle,
            pool_max_messages=s.upstream_pool_max_messages,
            auth=entry.auth or s.upstream_auth, token_provider=token_provider,
            ca_file=entry.ca_file or s.upstream_ca_file,
            client_cert=entry.client_cert or s.upstream_client_cert,
            client_key=entry.client_key or s.upstream_client_key,
        )
    except ValueError as exc:
        raise ConfigError(f"upstream {entry.label}: {exc} ({setting_names('upstream')})"
                          ) from exc


def _entry_secret(path: Path, name: str) -> str:
    """The password in the file ``path`` of the upstream entry ``name`` (stripped). Raises
    ConfigError naming the entry when it cannot be read or is empty."""
    return read_secret_file(path, f"upstream {name}: password_file")


def build_token_provider(settings: Settings) -> TokenProvider | None:
    """The OAuth2 token provider of smarthost AUTH XOAUTH2 / OAUTHBEARER (one per process,
    shared by every upstream that uses it), None without ``oauth_token_url``. Reads the
    secret files once (a new secret needs a restart); raises ConfigError when one is bad."""
    if settings.oauth_token_url is None or settings.oauth_client_id is None:
        return None
    secret, refresh = settings.oauth_secret_values()
    if secret is None and refresh is None:
        return None
    return TokenProvider(OAuthConfig(
        token_url=settings.oauth_token_url, client_id=settings.oauth_client_id,
        client_secret=secret, refresh_token=refresh, scope=settings.oauth_scope,
        ca_file=settings.oauth_ca_file, timeout_s=settings.upstream_connect_timeout))


def build_policy(settings: Settings) -> Policy:
    """The dedup policy of design.md §2-4 from the settings."""
    return Policy(
        lease_s=settings.lease, window_s=settings.dedup_window, key_prefix=settings.store_prefix,
        key_names=settings.dedupe_headers, template_names=settings.template_headers,
        max_key_chars=settings.max_key_chars,
        local_part_case_sensitive=settings.local_part_case_sensitive,
        secret=settings.fingerprint_secret_bytes,
        missing_key=settings.missing_key, unknown=settings.unknown_policy,
        store_down=settings.store_down, strip_headers=settings.strip_dedupe_headers,
        scope_by_auth=settings.scope_by_auth, key_format=settings.store_key_format,
        duplicate_reply=settings.duplicate_reply, mode=settings.mode,
        templates=tuple(
            TemplateRule(match=t.match, dedup=t.dedup, window_s=t.dedup_window,
                         missing_key=t.missing_key, unknown=t.unknown_policy,
                         duplicate_reply=t.duplicate_reply, mode=t.mode)
            for t in settings.template_policy),
    )


def build_rate_limits(settings: Settings) -> tuple[RateRule, ...]:
    """The ``[[rate_limit]]`` tables as the core's rules (:mod:`relay.core.limits`)."""
    return tuple(RateRule(label=r.label, scope=r.scope, per_s=r.per, messages=r.messages,
                          recipients=r.recipients, match=r.match) for r in settings.rate_limit)


def build_rate_limiter(store: FingerprintStore, prefix: str) -> RateLimiter | None:
    """The store's rate limiter (its counters under ``prefix``), built even with no limit
    configured (a reload may add some); None for a store that has none."""
    if isinstance(store, RedisStore | SqliteStore | PostgresStore):
        return store.rate_limiter(prefix)
    return None


def build_dsn_sender(settings: Settings, upstream: Upstream,
                     metrics: PrometheusMetrics) -> DsnSender | None:
    """The RFC 3464 notifier for recipients refused after a 250, unless
    ``dsn_on_partial_failure`` is off; it sends through the same upstream."""
    if not settings.dsn_on_partial_failure:
        return None
    remote = None
    first = settings.upstream[0]
    if not first.is_maildir:
        remote = split_host_port(first.address, what="upstream")[0]
    return DsnSender(upstream=upstream, metrics=metrics, reporting_mta=settings.hostname,
                     remote_mta=remote, log_addresses=settings.log_recipients)


def build_security(settings: Settings) -> ListenerSecurity:
    """Client networks, connection limits, TLS, AUTH and PROXY settings of the listener."""
    s = settings
    tls_context = None
    if s.tls_cert is not None and s.tls_key is not None:
        tls_context = server_context(s.tls_cert, s.tls_key, s.tls_min_version)
    return ListenerSecurity(
        gate=ConnectionGate(allowed=parse_networks(s.allowed_networks),
                            max_total=s.max_connections, max_per_ip=s.max_connections_per_ip),
        tls_context=tls_context, tls_required=s.tls_required,
        auth_enabled=s.auth_file is not None, auth_required=s.auth_required,
        proxy_networks=parse_networks(s.proxy_networks) if s.proxy_protocol else None,
    )


def build_sasl(settings: Settings, metrics: PrometheusMetrics) -> SaslMechanisms | None:
    """The AUTH mechanisms over the credentials file, or None when AUTH is not configured."""
    if settings.auth_file is None:
        return None
    return SaslMechanisms(credentials=CredentialFile.load(settings.auth_file),
                          on_failure=metrics.auth_failure, on_refused=metrics.auth_refused,
                          failure_delay_s=settings.auth_failure_delay,
                          max_failures=settings.auth_max_failures,
                          failure_window_s=settings.auth_failure_window)


@dataclass(frozen=True)
class Inherited:
    """What a worker process (``workers`` > 1) gets from its supervisor: the listening sockets
    the supervisor bound (``listen``, and ``tls_listen`` when set; one socket per address the
    host resolved to, shared by every worker) and the worker's ``index`` (0 to N-1). Worker 0
    pays the settle journal at its start; the metrics HTTP server is the supervisor's, on
    ``metrics_port`` (0: off)."""

    listen: tuple[socket.socket, ...]
    tls_listen: tuple[socket.socket, ...]
    index: int
    metrics_port: int = 0


@dataclass
class Listeners:
    """The listening sockets :func:`bind_listeners` bound, not serving (asyncio servers with
    ``start_serving=False`` own them): their file descriptors for the workers to inherit;
    ``close()`` when done."""

    servers: list[asyncio.base_events.Server]
    listen: tuple[int, ...]
    tls_listen: tuple[int, ...]
    port: int  # the bound SMTP port (the one picked for ``listen`` port 0)

    def close(self) -> None:
        """Close the sockets."""
        for server in self.servers:
            server.close()


async def bind_listeners(settings: Settings) -> Listeners:
    """Bind ``listen`` (and ``tls_listen`` when TLS is configured) as :meth:`Relay.start`
    would, without serving: the supervisor's sockets its workers inherit (they listen once the
    first worker serves them, so a port that accepts has a worker behind it). Raises
    :class:`StartupError` naming the setting (a port in use, an address not on this host)."""
    s = settings
    loop = asyncio.get_running_loop()

    async def bind(host: str, port: int, field: str) -> asyncio.base_events.Server:
        try:
            return await loop.create_server(asyncio.Protocol, host=host, port=port,
                                            start_serving=False)
        except OSError as exc:
            raise _bind_error(host, port, field, exc) from exc

    servers = [await bind(*s.listen_address, "listen")]
    if s.tls_listen is not None and s.tls_cert is not None and s.tls_key is not None:
        servers.append(await bind(*split_host_port(s.tls_listen, what="tls-listen"),
                                  "tls_listen"))
    fds = [tuple(sock.fileno() for sock in server.sockets) for server in servers]
    return Listeners(servers=servers, listen=fds[0], tls_listen=fds[1] if len(fds) > 1 else (),
                     port=int(servers[0].sockets[0].getsockname()[1]))


class Relay:
    """One running relay: ``await start()``, then ``await stop()``.

    ``registry`` lets tests inject a fresh prometheus registry. After start, ``port`` is the
    bound SMTP port (useful with ``listen = 127.0.0.1:0``). ``inherited``: a worker's sockets
    (:class:`Inherited`), served instead of binding ``listen`` and ``tls_listen``.
    """

    def __init__(self, settings: Settings, *, registry: CollectorRegistry | None = None,
                 inherited: Inherited | None = None) -> None:
        self.settings = settings
        self.inherited = inherited
        self._more_servers: list[asyncio.base_events.Server] = []
        self._store_id: str | None = None  # FingerprintStore.identity, once the store answered
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = PrometheusMetrics(registry=self.registry)
        # a worker's reloads are counted by its supervisor (one per reload of the relay)
        self.reloads = ConfigReloadMetrics(registry=self.registry) if inherited is None else None
        self.security: ListenerSecurity | None = None  # kept for a configuration reload
        self.sasl: SaslMechanisms | None = None
        self.store: FingerprintStore | None = None
        self.ledger: PostgresLedger | None = None
        self.upstream: Upstream | None = None
        self.handler: RelayHandler | None = None
        self.core: DedupCore | None = None
        self.dsn: DsnSender | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tls_server: asyncio.base_events.Server | None = None
        self._tls_factory: ImplicitTlsFactory | None = None
        self.tls_port = 0
        self._stopped = False
        self.health: HealthMonitor | None = None
        self._ops: OpsServer | None = None
        self.port = 0
        self.metrics_port = 0

    async def start(self) -> None:
        """Open the store, build the parts and start listening (SMTP and metrics)."""
        s = self.settings
        self.store = await build_store(s)
        try:
            self.ledger = await build_ledger(s, self.metrics)
        except BaseException:  # a missing ledger schema: the store opened above is closed
            await self.store.close()
            self.store = None
            raise
        self.metrics.declare_upstreams(entry.label for entry in s.upstream)
        self.upstream = upstream = build_upstream(s, self.metrics)
        self.dsn = build_dsn_sender(s, self.upstream, self.metrics)
        self.metrics.declare_rate_limits(r.label for r in s.rate_limit)
        # the rate limits' ``upstream`` scope: the upstream a message would be tried on first
        core = DedupCore(store=self.store, upstream=self.upstream, metrics=self.metrics,
                         policy=build_policy(s), notifier=self.dsn,
                         limiter=build_rate_limiter(self.store, s.store_prefix),
                         rate_limits=build_rate_limits(s),
                         upstream_name=upstream.preferred_name, ledger=self.ledger)
        limits = ListenerLimits(
            hostname=s.hostname, max_recipients=s.max_recipients,
            max_message_size=s.max_message_size, client_timeout_s=s.client_timeout,
            data_deadline_s=s.data_deadline, session_lifetime_s=s.session_lifetime,
            max_idle_commands=s.max_idle_commands,
            local_part_case_sensitive=s.local_part_case_sensitive,
            log_recipients=s.log_recipients, allowed_senders=s.allowed_senders)
        security = build_security(s)
        sasl = build_sasl(s, self.metrics)
        self.core, self.security, self.sasl = core, security, sasl
        if self.inherited is None or self.inherited.index == 0:
            await self._pay_journal()
        self.handler = RelayHandler(core=core, metrics=self.metrics, limits=limits, sasl=sasl)
        processing_s = (s.upstream_connect_timeout + 4 * s.upstream_command_timeout
                        + s.upstream_timeout + 4 * s.store_timeout + s.client_timeout)
        host, port = s.listen_address
        inherited = self.inherited
        factory = smtp_factory(self.handler, limits, security, processing_s)
        if inherited is None:
            self._server = await _bind(factory, host, port, "listen")
        else:
            self._server = await self._serve_inherited(factory, inherited.listen)
        self.port = self._server.sockets[0].getsockname()[1]
        if s.tls_listen is not None and security.tls_context is not None:
            tls_host, tls_port = split_host_port(s.tls_listen, what="tls-listen")
            # plain TCP: clients are admitted before their handshake (relay.smtp.implicit_tls)
            self._tls_factory = implicit_tls_factory(
                smtp_factory(self.handler, limits, security, processing_s, implicit_tls=True),
                gate=security.gate, proxy_networks=security.proxy_networks,
                context=security.tls_context, handshake_timeout_s=s.tls_handshake_timeout)
            if inherited is None:
                self._tls_server = await _bind(self._tls_factory, tls_host, tls_port,
                                               "tls_listen")
            else:
                self._tls_server = await self._serve_inherited(self._tls_factory,
                                                               inherited.tls_listen)
            self.tls_port = self._tls_server.sockets[0].getsockname()[1]
        if s.metrics_address is not None and inherited is not None:
            # a worker probes its own store client and upstream pool (relay_component_up,
            # livemin over the workers); the supervisor serves /metrics and /readyz
            self.health = HealthMonitor(
                store=self.store, upstream=self.upstream, metrics=self.metrics,
                interval_s=s.health_interval, timeout_s=min(3.0, s.health_interval * 2),
                upstream_states=self._upstream_states, ledger=self.ledger)
            await self.health.start()
        elif s.metrics_address is not None:
            m_host, m_port = s.metrics_address
            self.health = HealthMonitor(
                store=self.store, upstream=self.upstream, metrics=self.metrics,
                interval_s=s.health_interval, timeout_s=min(3.0, s.health_interval * 2),
                upstream_states=self._upstream_states, ledger=self.ledger)
            await self.health.start()
            self._ops = OpsServer(registry=self.registry, health=self.health,
                                  host=m_host, port=m_port)
            try:
                await self._ops.start()
            except OSError as exc:
                raise _bind_error(m_host, m_port, "metrics_listen", exc) from exc
            self.metrics_port = self._ops.port
        self._log_started()

    def _upstream_states(self) -> dict[str, dict[str, object]]:
        """Each upstream's state by name (the ``/readyz`` body)."""
        if not isinstance(self.upstream, FailoverUpstream):
            return {}
        return {name: dataclasses.asdict(state)
                for name, state in self.upstream.states().items()}

    def _log_started(self) -> None:
        """The start-up line: every listener with its TLS and AUTH, the upstream, the store, the
        metrics address and the event loop; a WARNING when the smarthost's certificate is not
        verified."""
        s = self.settings
        host, _ = s.listen_address
        auth = s.auth_file is not None
        smtp = ["STARTTLS required" if s.tls_required else "STARTTLS offered"
                ] if s.tls_cert is not None else ["plain, no TLS"]
        if auth:
            smtp.append("AUTH required after STARTTLS" if s.auth_required
                        else "AUTH after STARTTLS")
        listeners = [f"SMTP {_host_port(host, self.port)} ({', '.join(smtp)})"]
        if self._tls_server is not None and s.tls_listen is not None:
            tls_host, _ = split_host_port(s.tls_listen, what="tls-listen")
            tls_auth = ("AUTH required" if s.auth_required else "AUTH on") if auth else "no AUTH"
            listeners.append(f"implicit TLS {_host_port(tls_host, self.tls_port)} ({tls_auth})")
        upstream = s.upstream_summary
        if not s.upstream[0].is_maildir:
            upstream += f" (tls {s.upstream_tls}{'' if s.upstream_verify else ', unverified'})"
        store_kind = "redis" if s.store.startswith("redis") else \
            "postgresql" if is_postgres_url(s.store) else "embedded sqlite"
        metrics_port = self.metrics_port if self.inherited is None else \
            self.inherited.metrics_port
        metrics = (_host_port(s.metrics_address[0], metrics_port)
                   if metrics_port and s.metrics_address is not None else "off")
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
        shadowed = ["all templates"] if s.mode == "shadow" else [
            t.match for t in s.template_policy if t.mode == "shadow"]
        if shadowed and (self.inherited is None or self.inherited.index == 0):
            log.warning("shadow mode for %s: duplicates are relayed and counted as "
                        "would_suppress, not suppressed (design.md §4.6)", ", ".join(shadowed))
        log.info("listening on %s; upstream %s, store %s (%s), metrics %s, event loop %s",
                 ", ".join(listeners), upstream, redact_url(s.store), store_kind, metrics,
                 "uvloop" if loop == "uvloop" else "asyncio")
        unverified = [e.label for e in s.upstream if not e.is_maildir
                      and not (s.upstream_verify if e.verify is None else e.verify)
                      and (e.tls or s.upstream_tls) != "none"]
        if unverified:
            log.warning("upstream certificate verification is off (upstream_verify = false): "
                        "anyone on the path to %s can read and change the mail and the AUTH "
                        "password; use it in a lab only", ", ".join(unverified))
        in_clear = s.upstreams_with_clear_credentials
        if in_clear:
            log.warning("upstream AUTH without TLS (upstream_tls = none) to %s: the password or "
                        "OAuth2 token goes over the network in clear; set upstream_tls = "
                        "starttls or tls", ", ".join(in_clear))

    async def stop(self) -> None:
        """Graceful shutdown (design.md §6.6), in this order.

        1. Stop accepting connections. 2. Idle sessions are told ``421 4.3.2`` and closed;
        sessions inside DATA finish that transaction, then get the same. 3. Wait up to
        ``shutdown_grace`` seconds for them, for settlements still being retried and for
        DSNs still being sent.
        4. Past the grace, cut what is left: a transaction whose final dot had not gone out is
        released (the client's retry is relayed), one past the dot is marked UNKNOWN.
        5. Close the metrics server, the upstream and the store. A second call does nothing.
        """
        if self._stopped:
            return
        self._stopped = True
        for server in (self._server, self._tls_server, *self._more_servers):
            if server is not None:
                server.close()
        if self._tls_factory is not None:  # a handshake finishing now would start a session
            self._tls_factory.cancel_handshakes()
        handler = self.handler
        if handler is not None:
            for session in list(handler.sessions):
                session.begin_shutdown()
        if not await self._drained(self.settings.shutdown_grace):
            await self._cut()
        await self._write_journal()
        await self._close_parts()

    async def _serve_inherited(self, factory: Any, socks: tuple[socket.socket, ...]
                               ) -> asyncio.base_events.Server:
        """Serve ``factory`` on already bound sockets (a worker's); returns the first server,
        keeps the others (a host that resolved to several addresses) for :meth:`stop`."""
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(factory, sock=sock) for sock in socks]
        self._more_servers.extend(servers[1:])
        return servers[0]

    def _store_url_name(self) -> str:
        """A store's name in the journal when its identity is unknown: its URL (password
        masked) and key prefix."""
        return f"{redact_url(self.settings.store)} prefix={self.settings.store_prefix}"

    async def _store_names(self) -> tuple[str, ...]:
        """The names journal lines may be owed to this relay's store under: its identity
        (asked of the store until it once answers) with the key prefix, then its URL name."""
        if self._store_id is None and self.store is not None:
            try:
                self._store_id = await self.store.identity()
            except StoreError as exc:
                log.warning("the store's identity is unknown (%s): the settle journal names "
                            "it by its URL", exc)
        prefix = f" prefix={self.settings.store_prefix}"
        named = () if self._store_id is None else (self._store_id + prefix,)
        return (*named, self._store_url_name())

    def _journal_path(self) -> Path | None:
        return Path(self.settings.settle_journal) if self.settings.settle_journal else None

    async def _pay_journal(self) -> None:
        """Apply the settles the last run could not land (compare-token: always safe)."""
        path, core = self._journal_path(), self.core
        if path is None or core is None:
            return
        try:
            names = await self._store_names()
            owed = await asyncio.to_thread(read_journal, path, *names)
        except OSError as exc:
            raise StartupError(f"cannot read the settle journal {path}: {exc}") from exc
        if not owed:
            return
        left = await core.pay_owed(owed)
        log.warning("settle journal %s: %d settle(s) owed by the last run, %d landed now, "
                    "the rest retried in the background", path.resolve(), len(owed),
                    len(owed) - len(left))
        # what is left stays in the file (and is owed in memory): a crash before the next stop
        # loses nothing, and applying a settle again later changes nothing
        pending = {(token, op.key, op.action) for token, op in left}
        paid = [(t, op) for t, op in owed if (t, op.key, op.action) not in pending]
        await asyncio.to_thread(remove_from_journal, path, paid, *names)

    async def _write_journal(self) -> None:
        """Stop the background settle retries and write what they still owe to the journal,
        for the next start (the store did not answer in time)."""
        core = self.core
        if core is None:
            return
        for task in list(core.background):
            task.cancel()
        await asyncio.gather(*core.background, return_exceptions=True)
        owed = core.owed_settles()
        if not owed:
            return
        path = self._journal_path()
        if path is None:
            log.error("%d settle(s) still owed at exit and settle_journal is off: those "
                      "records read as in doubt after their lease", len(owed))
            return
        try:
            owner = (await self._store_names())[0]
            await asyncio.to_thread(add_to_journal, path, owed, owner)
        except OSError as exc:
            log.error("cannot write %d owed settle(s) to %s: %s", len(owed), path, exc)
            return
        log.error("%d settle(s) still owed at exit: written to %s for the next start",
                  len(owed), path.resolve())

    async def _close_parts(self) -> None:
        """Close the metrics server, the health probes, the upstream and the store."""
        if self._ops is not None:
            await self._ops.stop()
        if self.health is not None:
            await self.health.stop()
        if self.upstream is not None:
            await self.upstream.close()
        if self.ledger is not None:  # every message is answered: its rows are queued
            await self.ledger.close(flush_s=LEDGER_FLUSH_S)
        if self.store is not None:
            await self.store.close()

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
                    "(what they still owe goes to the settle journal)",
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


async def _bind(factory: Any, host: str, port: int, field: str) -> asyncio.base_events.Server:
    """``loop.create_server`` on host:port; a port in use or an address not on this host is a
    :class:`StartupError` naming the setting ``field`` (flag and env var)."""
    try:
        return await asyncio.get_running_loop().create_server(factory, host=host, port=port)
    except OSError as exc:
        raise _bind_error(host, port, field, exc) from exc


def _bind_error(host: str, port: int, field: str, exc: OSError) -> StartupError:
    if exc.errno == errno.EADDRINUSE:
        why = "the address is already in use (another process listens there)"
    elif isinstance(exc, socket.gaierror):
        why = f"cannot resolve the host ({exc.strerror or exc})"
    else:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
    return StartupError(f"cannot listen on {_host_port(host, port)} for {field} "
                        f"({setting_names(field)}): {why}")


def _host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (RFC 3986 section 3.2.2)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def run(settings: Settings, *, inherited: Inherited | None = None,
              started: Callable[[Relay], None] | None = None,
              hangup: Callable[[Relay], Awaitable[None]] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully.

    The signal handlers are installed before start-up, so a signal during a slow start (a
    store that does not answer) stops the relay too. Raises :class:`StartupError` with one
    readable line when the relay cannot start, :class:`ConfigError` when a setting proves
    wrong only at start (a Redis database number the server does not have). ``inherited``: a
    worker's sockets (:class:`Inherited`); ``started`` is called once the relay serves.
    ``hangup``: the configuration reload (:mod:`relay.reload`), run for each SIGHUP once the
    relay serves (one received during start-up waits for it), one at a time.
    """
    relay = Relay(settings, inherited=inherited)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    hangups: asyncio.Queue[None] = asyncio.Queue()
    if hangup is not None:
        loop.add_signal_handler(signal.SIGHUP, hangups.put_nowait, None)
    starting = asyncio.create_task(_start(relay))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("signal received during start-up: stopping")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
    else:
        try:
            starting.result()
        except (StartupError, ConfigError):
            stopping.cancel()
            await relay.stop()
            raise
        if started is not None:
            started(relay)
        reloads = None if hangup is None else asyncio.create_task(
            _reloads(relay, hangups, hangup))
        await stopping
        log.info("signal received: stopping")
        if reloads is not None:
            reloads.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reloads
    await relay.stop()


async def _reloads(relay: Relay, hangups: asyncio.Queue[None],
                   hangup: Callable[[Relay], Awaitable[None]]) -> None:
    """Run ``hangup`` once per SIGHUP queued in ``hangups``, each to its end before the next;
    an unexpected error is logged, never ends the relay."""
    while True:
        await hangups.get()
        try:
            await hangup(relay)
        except Exception:
            log.exception("configuration reload failed")


async def _start(relay: Relay) -> None:
    """``relay.start()`` with the operator's usual mistakes turned into :class:`StartupError`
    (a :class:`ConfigError` found only now, such as a Redis database number the server does not
    have, stays one)."""
    try:
        await relay.start()
    except StoreError as exc:
        if exc.op.startswith("ledger"):
            raise StartupError(f"cannot open the audit ledger "
                               f"{redact_url(relay.settings.ledger or '')}: {exc}") from exc
        raise StartupError(f"cannot open the store {redact_url(relay.settings.store)}: "
                           f"{exc}") from exc
    except OSError as exc:  # a port in use, an address not on this host, a name unknown
        raise StartupError(f"cannot listen or read a file: {exc}") from exc
