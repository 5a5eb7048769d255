"""The one frozen, validated settings object of dedup-relay.

Sources, highest priority first: command-line flags ``--<field-in-kebab-case>`` (every field is
one, :func:`flag_name`), environment variables ``RELAY_<FIELD>`` (:func:`env_name`, for example
``RELAY_UPSTREAM``, ``RELAY_DEDUP_WINDOW``), the TOML file named by ``--config`` /
``RELAY_CONFIG`` (keys are the field names, see ``config/dedup-relay.example.toml``), defaults.
Each field's ``description`` is its ``--help`` text.
Durations are seconds (floats), sizes bytes.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from relay.core.errors import ConfigError
from relay.core.policy import Policy, TemplateRule
from relay.core.rules import DuplicateReply, MissingKeyPolicy, Mode, StoreDownPolicy, UnknownPolicy

DEFAULT_STORE_URL = "sqlite:///data/dedup-relay.db"

# a list setting: a TOML array, or in an env var / flag a comma-separated string
CsvList = Annotated[tuple[str, ...], NoDecode]


_SECRET_PARAM = re.compile(r"(?i)([?&][^=&#]*password[^=&#]*=)[^&#]*")


def redact_url(url: str) -> str:
    """``url`` fit for logs: the password of the userinfo and of any query parameter whose
    name holds "password" (``sentinel_password=``) become ``***``; for a sqlite:/// URL the
    file's absolute path (a relative one depends on the working directory)."""
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        return f"sqlite:///{Path(path).absolute()}" if path and not path.startswith("/") else url
    scheme, sep, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    creds, at, hosts = authority.rpartition("@")
    if at and ":" in creds:  # a user without a password is shown as it is
        user = creds.split(":", 1)[0]
        authority = f"{user}:***@{hosts}"
    return _SECRET_PARAM.sub(r"\1***", f"{scheme}{sep}{authority}{slash}{tail}")


def _check_postgres_url(value: str, *, what: str = "store") -> str:
    """``value`` when it is a usable ``postgresql://USER@HOST:PORT/DB`` URL (libpq's query
    parameters are asyncpg's to judge at connect time); ValueError naming the fault, never the
    password."""
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018  # raises ValueError for a port that is no number
    except ValueError:
        raise ValueError(f"{what} URL port must be a number from 0 to 65535") from None
    if not parts.path.strip("/") and "dbname=" not in parts.query \
            and "database=" not in parts.query:
        raise ValueError(f"a postgresql:// {what} URL must name its database: "
                         "postgresql://USER@HOST:PORT/DB")
    return value


_HOSTNAME = re.compile(r"[A-Za-z0-9_.:\-\[\]]+")

ENV_PREFIX = "RELAY_"


def flag_name(field: str) -> str:
    """The command-line flag of the setting ``field``: ``lease`` -> ``--lease``,
    ``store_timeout`` -> ``--store-timeout`` (a bool's negation is ``--no-`` + that)."""
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    """The env var of the setting ``field``: ``store_timeout`` -> ``RELAY_STORE_TIMEOUT``."""
    return ENV_PREFIX + field.upper()


def setting_names(field: str, flagged: AbstractSet[str] | None = None) -> str:
    """Where an operator sets ``field``, for messages: flag (when the command offers it:
    ``flagged`` holds the field names it does; None: all), env var and file key."""
    names = f"{env_name(field)} or `{field}` in the file"
    if flagged is None or field in flagged:
        names = f"{flag_name(field)}, {names}"
    return names


class SettingsRuleError(ValueError):
    """A rule between settings is broken; ``fields`` are the settings it names (the error
    message then says where each one is set)."""

    def __init__(self, message: str, *fields: str) -> None:
        super().__init__(message)
        self.fields = fields


def split_host_port(value: str, *, what: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` for IPv6) into ``(host, port)``.

    Raises ValueError with a readable message when the form or the port (0-65535) is wrong.
    """
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"{what} must be HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        ipaddress.IPv6Address(host)
    return host, int(port_text)


class TemplatePolicy(BaseModel):
    """One ``[[template_policy]]`` entry of the config file: the dedup rules for the messages
    whose template matches ``match`` (a shell glob, case-sensitive, on the normalized template
    value; ``*`` for the default entry). A key left out takes the global setting of that name.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    match: str = Field(min_length=0, description="shell glob on the template value")
    dedup: bool | None = Field(None, description=(
        "false: relay these messages without dedup (one-time codes, password resets)"))
    dedup_window: float | None = Field(None, gt=0, description=(
        "seconds a sent fingerprint of this template suppresses copies"))
    missing_key: MissingKeyPolicy | None = None
    unknown_policy: UnknownPolicy | None = None
    duplicate_reply: DuplicateReply | None = Field(None, description=(
        '"250" (accepted, not relayed again) or "550" (550 5.7.1, the caller is told)'))
    mode: Mode | None = None


class RateLimit(BaseModel):
    """One ``[[rate_limit]]`` entry of the config file (issue 12): at most ``messages``
    messages (and ``recipients`` envelope recipients) per ``per`` seconds for each value of
    ``scope`` (each upstream, AUTH user, sender domain or template), shared by every relay on
    the store. ``match`` (a shell glob on the scope's value) limits the entry to some values;
    ``name`` is its ``limit`` label in ``relay_rate_limited_total`` (default
    ``<scope>-<messages>-per-<per>s``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scope: Literal["upstream", "auth_user", "sender_domain", "template"]
    messages: int | None = Field(default=None, ge=1)
    recipients: int | None = Field(default=None, ge=1)
    per: float = Field(gt=0, description="seconds")
    match: str = "*"
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,64}$")

    @model_validator(mode="after")
    def _some_limit(self) -> RateLimit:
        if self.messages is None and self.recipients is None:
            raise ValueError("a rate_limit needs messages or recipients (or both)")
        return self

    @property
    def label(self) -> str:
        """The ``limit`` label value: ``name``, or ``<scope>-<count>-per-<per>s``."""
        if self.name is not None:
            return self.name
        count = f"{self.messages}" if self.messages is not None else f"{self.recipients}r"
        return f"{self.scope}-{count}-per-{self.per:g}s"


def check_upstream_address(value: str) -> str:
    """``value`` when it is ``HOST:PORT``, ``[v6]:PORT`` or ``maildir:PATH``; raises
    ValueError naming it otherwise."""
    if value.startswith("maildir:"):
        if not value[len("maildir:") :]:
            raise ValueError("upstream maildir:PATH needs a path")
        return value
    split_host_port(value, what="upstream")
    return value


class UpstreamEntry(BaseModel):
    """One upstream of the ``upstream`` list (issue 12), tried in the order given: its
    ``address`` (``HOST:PORT``, ``[v6]:PORT`` or ``maildir:PATH``, the last only as the single
    upstream); in the config file also an inline table whose other keys override the global
    ``upstream_*`` setting of the same name for this upstream (``tls``, ``verify``, ``user``,
    ``password_file``, ``pool_size``, ``auth``, ``ca_file``, ``client_cert``, ``client_key``;
    left out: the global one). ``name`` is its label in metrics, logs and ``/readyz``
    (default: the address)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:\[\]-]{1,64}$")
    tls: Literal["none", "starttls", "tls"] | None = None
    verify: bool | None = None
    user: str | None = None
    password_file: Path | None = None
    pool_size: int | None = Field(default=None, ge=0)
    auth: Literal["password", "xoauth2", "oauthbearer"] | None = None
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        return check_upstream_address(value)

    @property
    def label(self) -> str:
        """The name of this upstream: ``name``, else the address."""
        return self.name if self.name is not None else self.address

    @property
    def is_maildir(self) -> bool:
        """Whether this is a ``maildir:PATH`` upstream."""
        return self.address.startswith("maildir:")

    def __str__(self) -> str:
        return self.address if self.name is None else f"{self.name}={self.address}"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an IP literal or a name) is this machine: a loopback address
    (127.0.0.0/8, ::1) or ``localhost`` / ``*.localhost`` (RFC 6761 section 6.3)."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# the upstreams in order: a TOML array (of strings or inline tables), or in an env var / flag a
# comma-separated list of HOST:PORT / maildir:PATH
UpstreamList = Annotated[tuple[UpstreamEntry, ...], NoDecode]

# settings that only the config file sets (a table or an array of tables): no flag
FILE_ONLY_SETTINGS = frozenset({"template_policy", "rate_limit"})


class Settings(BaseSettings):
    """Every setting of the relay (see ``config/dedup-relay.example.toml`` for each one).

    Raises pydantic's ValidationError on construction; :func:`load_settings` turns that into
    :class:`relay.core.errors.ConfigError` with one readable line per problem.
    """

    model_config = SettingsConfigDict(
        env_prefix="RELAY_", frozen=True, extra="forbid", toml_file=None
    )

    # listener
    listen: str = Field("127.0.0.1:2525", description=(
        "SMTP listener HOST:PORT ([::1]:2525 for IPv6; port 0: any free port)"))
    hostname: str = Field(default_factory=socket.getfqdn, description=(
        "name in the greeting, the EHLO reply and the Received: header"))
    max_message_size: int = Field(default=10 * 1024 * 1024, ge=1024, description=(
        "bytes; advertised as SIZE, a larger message is refused with 552 5.3.4"))
    max_recipients: int = Field(default=100, ge=1, description=(
        "RCPT TO per message; more are refused with 452 4.5.3 (RFC 5321 section 4.5.3.1.8)"))
    client_timeout: float = Field(default=300.0, gt=0, description=(
        "seconds a client may stay silent; then 421 4.4.2 and the connection is closed"))
    data_deadline: float = Field(default=600.0, gt=0, description=(
        "seconds a client has from DATA's 354 to the final dot; then 421 4.4.2"))
    session_lifetime: float = Field(default=3600.0, gt=0, description=(
        "seconds a session may last; then 421 4.4.2 (a message in DATA is answered first)"))
    max_idle_commands: int = Field(default=100, ge=1, description=(
        "commands since the session's last message (NOOP, RSET, refused MAIL/RCPT/DATA...); "
        "then 421 4.7.0"))

    # listener security
    allowed_networks: CsvList = Field(("127.0.0.0/8", "::1/128"), description=(
        "client CIDRs, comma-separated; any other client is told 421 4.7.0 at connect"))
    allowed_senders: CsvList = Field((), description=(
        "shell globs of the MAIL FROM addresses allowed, comma-separated (e.g. *@example.com); "
        "empty: any; others get 550 5.7.1"))
    max_connections: int = Field(default=200, ge=1, description=(
        "client connections open at once; more are told 421 4.7.0"))
    max_connections_per_ip: int = Field(default=20, ge=1, description=(
        "client connections open at once from one address; more are told 421 4.7.0"))
    tls_cert: Path | None = Field(None, description=(
        "PEM certificate chain: enables STARTTLS (RFC 3207); needs tls_key"))
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")
    tls_listen: str | None = Field(None, description=(
        "HOST:PORT of an implicit-TLS listener (port 465 style, RFC 8314); needs tls_cert"))
    tls_min_version: Literal["TLSv1.2", "TLSv1.3"] = Field("TLSv1.2", description=(
        "oldest TLS version a client may use"))
    tls_handshake_timeout: float = Field(default=10.0, gt=0, description=(
        "seconds an implicit-TLS client has for its handshake"))
    tls_required: bool = Field(False, description=(
        "refuse MAIL before STARTTLS with 530 5.7.0"))
    auth_file: Path | None = Field(None, description=(
        "user:hash lines (see hash-password): enables AUTH PLAIN and LOGIN, over TLS only"))
    auth_required: bool = Field(False, description=(
        "refuse MAIL before AUTH with 530 5.7.0 (needs auth_file)"))
    auth_failure_delay: float = Field(default=1.0, ge=0, description=(
        "seconds; a failed AUTH is answered after this x (1 + the recent failures of the "
        "address or the user), at most 5 s; a right password at once"))
    auth_max_failures: int = Field(default=5, ge=1, description=(
        "AUTH attempts per client address within auth_failure_window (successes refunded); "
        "then AUTH is 421 4.7.0 unchecked. A user name is never locked out"))
    auth_failure_window: float = Field(default=600.0, gt=0, description=(
        "seconds over which auth_max_failures counts"))
    proxy_protocol: bool = Field(False, description=(
        "expect a PROXY v1/v2 header from a load balancer in proxy_networks"))
    proxy_networks: CsvList = Field(("127.0.0.0/8", "::1/128"), description=(
        "CIDRs of the load balancers allowed to send a PROXY header, comma-separated"))

    # upstream / smarthost
    upstream: UpstreamList = Field(description=(
        "smarthost HOST:PORT, or several tried in this order (comma-separated, or the flag "
        "repeated; a message moves on only on a definite failure before any recipient was "
        "accepted), or maildir:PATH for a local Maildir (staging, CI)"))
    upstream_tls: Literal["none", "starttls", "tls"] = Field("none", description=(
        "TLS to the smarthost: none, starttls (required: 451 4.4.1 when not offered) or tls "
        "(implicit, port 465)"))
    upstream_verify: bool = Field(True, description=(
        "verify the smarthost's certificate and name (turn off for a lab only)"))
    upstream_user: str | None = Field(None, description="AUTH user at the smarthost")
    upstream_password_file: Path | None = Field(None, description=(
        "file holding the smarthost AUTH password (read at start)"))
    upstream_password: SecretStr | None = Field(None, description=(
        "the smarthost AUTH password itself; prefer upstream_password_file or the env var: "
        "a flag is visible to every user of the host in the process list"))
    upstream_timeout: float = Field(default=600.0, gt=0, description=(
        "seconds to wait for the reply to the final dot (RFC 5321 section 4.5.3.2.6)"))
    upstream_command_timeout: float = Field(default=60.0, gt=0, description=(
        "seconds to wait for each other reply, and that the message transfer may make no "
        "progress (RFC 5321 section 4.5.3.2.5)"))
    upstream_connect_timeout: float = Field(default=30.0, gt=0, description=(
        "seconds for TCP connect, greeting and EHLO (and TLS, AUTH)"))
    upstream_pool_size: int | None = Field(default=None, ge=0, description=(
        "idle smarthost connections kept for reuse per worker; unset: sized for the "
        "sessions a worker serves (bounded); 0: one connection per message"))
    upstream_pool_idle: float = Field(default=30.0, gt=0, description=(
        "seconds an idle pooled connection waits before it is closed"))
    upstream_pool_max_messages: int = Field(default=100, ge=1, description=(
        "transactions per pooled connection before a fresh one"))
    upstream_cooldown: float = Field(default=30.0, gt=0, description=(
        "seconds a failed upstream is skipped before it is probed again (doubling on each "
        "failed probe, up to upstream_cooldown_max)"))
    upstream_cooldown_max: float = Field(default=600.0, gt=0, description=(
        "the longest cool-down of a failed upstream, seconds"))
    upstream_ca_file: Path | None = Field(None, description=(
        "PEM CA certificates that sign the smarthost's certificate (a private or corporate CA) "
        "instead of the system's"))
    upstream_client_cert: Path | None = Field(None, description=(
        "PEM client certificate chain for smarthosts that require one; needs "
        "upstream_client_key"))
    upstream_client_key: Path | None = Field(None, description=(
        "PEM private key of upstream_client_cert"))
    upstream_auth: Literal["password", "xoauth2", "oauthbearer"] = Field("password", description=(
        "smarthost AUTH: password (upstream_user and its password), xoauth2 or oauthbearer "
        "(RFC 7628) with an OAuth2 access token fetched from oauth_token_url"))
    oauth_token_url: str | None = Field(None, description=(
        "OAuth2 token endpoint (https://login.microsoftonline.com/TENANT/oauth2/v2.0/token, "
        "https://oauth2.googleapis.com/token)"))
    oauth_client_id: str | None = Field(None, description="OAuth2 client (application) id")
    oauth_client_secret_file: Path | None = Field(None, description=(
        "file holding the OAuth2 client secret"))
    oauth_refresh_token_file: Path | None = Field(None, description=(
        "file holding an OAuth2 refresh token: the refresh-token grant (Google style); "
        "without it, the client-credentials grant (Microsoft 365 style)"))
    oauth_scope: str | None = Field(None, description=(
        "OAuth2 scope (https://outlook.office365.com/.default, https://mail.google.com/)"))
    oauth_ca_file: Path | None = Field(None, description=(
        "PEM CA certificates that sign the token endpoint's certificate (private endpoints, "
        "tests); default: the system's"))

    # store and dedup
    store: str = Field(DEFAULT_STORE_URL, description=(
        "redis://, rediss://, redis+cluster://H:P,..., redis+sentinel://H:P,.../SERVICE or "
        "sqlite:///PATH (relative to the working directory; sqlite:////abs/path.db)"))
    store_prefix: str = Field("email:fp:", description="key prefix of every fingerprint")
    store_key_format: Literal["hex", "compact"] = Field("hex", description=(
        "fingerprint form in a store key: hex (64 characters, the seed formula an application "
        "can compute) or compact (base64url, 43 characters: less store memory)"))
    store_timeout: float = Field(default=2.0, gt=0, description=(
        "seconds per store round trip; a timeout counts as the store being down"))
    dedup_window: float = Field(default=86400.0, gt=0, description=(
        "seconds a sent fingerprint suppresses copies"))
    lease: float = Field(default=900.0, gt=0, description=(
        "seconds a reservation lives without renewal (a working attempt renews it every "
        "third); at least 3 x store_timeout"))
    dedupe_headers: CsvList = Field(("X-Dedupe-Key", "Idempotency-Key"), description=(
        "header field names of the dedupe key (aliases of one field), comma-separated"))
    template_headers: CsvList = Field(("X-Template",), description=(
        "header field names of the template, comma-separated"))
    max_key_chars: int = Field(default=256, ge=1, description=(
        "characters of a key or template; longer ones are refused with 554 5.6.0"))
    local_part_case_sensitive: bool = Field(False, description=(
        "John@x and john@x are different recipients"))
    fingerprint_secret: SecretStr | None = Field(None, description=(
        "HMAC-SHA-256 key of the fingerprint instead of plain SHA-256; prefer "
        "fingerprint_secret_file or the env var: a flag is visible in the process list"))
    fingerprint_secret_file: Path | None = Field(None, description=(
        "file holding fingerprint_secret (a Docker or systemd secret; surrounding whitespace "
        "and the final newline are not part of it)"))
    missing_key: MissingKeyPolicy = Field("relay", description=(
        "a message without a dedupe key: relay (without dedup) or reject (554 5.6.0)"))
    strip_dedupe_headers: bool = Field(False, description=(
        "leave the dedupe key and template fields out of the relayed message"))
    scope_by_auth: bool = Field(False, description=(
        "the AUTH identity is part of the fingerprint"))
    unknown_policy: UnknownPolicy = Field("suppress", description=(
        "a retry of an in-doubt (UNKNOWN) message: suppress (250, not relayed), hold (451) "
        "or send (relayed again, a possible duplicate)"))
    store_down: StoreDownPolicy = Field("fail_closed", description=(
        "the store does not answer: fail_closed (451 4.3.0) or fail_open (relay without "
        "dedup)"))
    duplicate_reply: DuplicateReply = Field("250", description=(
        'a message whose every recipient is a duplicate: "250" (accepted, not relayed again) '
        'or "550" (550 5.7.1: the caller is told it was a duplicate)'))
    mode: Mode = Field("enforce", description=(
        "enforce (suppress duplicates) or shadow (decide, reserve and settle as enforce does, "
        "but deliver duplicates anyway, counted as would_suppress)"))
    rate_limit: tuple[RateLimit, ...] = Field((), description=(
        "[[rate_limit]] tables of the config file: scope (upstream, auth_user, sender_domain, "
        "template), messages and/or recipients per `per` seconds, shared through the store"))
    template_policy: tuple[TemplatePolicy, ...] = Field((), description=(
        "[[template_policy]] tables of the config file: per-template dedup, dedup_window, "
        "missing_key, unknown_policy, duplicate_reply and mode; first match wins"))
    dsn_on_partial_failure: bool = Field(True, description=(
        "send the sender an RFC 3464 notice for recipients refused permanently after a 250"))

    # audit ledger (issue 13; design.md §6.7)
    ledger: str | None = Field(None, description=(
        "postgresql://USER@HOST:PORT/DB of the audit ledger: one row per recipient decision, "
        "written off the hot path in batches (any store; `dedup-relay db upgrade --ledger URL` "
        "creates its table); unset: no ledger"))
    ledger_required: bool = Field(False, description=(
        "fail closed: while the ledger cannot take rows (down, or its queue full) new messages "
        "are answered 451 4.3.0; false: relaying goes on and the rows are dropped and counted "
        "(relay_ledger_dropped_total)"))
    ledger_queue: int = Field(default=10000, ge=1, description=(
        "ledger rows a worker keeps in memory while the ledger is slow or down; more are "
        "dropped (or, with ledger_required, new messages refused)"))
    ledger_retention: float = Field(default=400 * 86400.0, gt=0, description=(
        "seconds a ledger row is kept (from when it was written); older rows are deleted in "
        "bounded batches"))
    ledger_recipients: Literal["masked", "full"] = Field("masked", description=(
        "recipients in ledger rows: masked (j***@example.com) or full"))
    ledger_keys: Literal["hash", "plain"] = Field("hash", description=(
        "dedupe keys in ledger rows: hash (SHA-256 hex, HMAC with fingerprint_secret when "
        "set) or plain"))
    in_doubt_alert_after: float = Field(default=3600.0, gt=0, description=(
        "seconds after which an in-doubt (unknown) ledger decision no later row resolved "
        "counts in relay_ledger_in_doubt_unresolved (the DedupRelayInDoubtUnresolved alert)"))

    # operations
    workers: int | None = Field(default=None, ge=1, le=256, description=(
        "worker processes sharing the listeners, each with its own event loop, store "
        "client and upstream pool; unset: the number of CPUs; 1: one process, no supervisor"))
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
    settle_journal: str = Field("data/owed-settles.jsonl", description=(
        "file for the settles the store did not take before the relay stopped, applied at the "
        "next start (relative to the working directory); empty: kept in memory only"))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags beat env vars, env vars beat the TOML file."""
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        split_host_port(value, what="listen")
        return value

    @field_validator("metrics_listen")
    @classmethod
    def _check_metrics_listen(cls, value: str | None) -> str | None:
        if value is None or value.lower() in ("", "off", "none"):
            return None
        split_host_port(value, what="metrics_listen")
        return value

    @field_validator("allowed_networks", "proxy_networks", "allowed_senders",
                     "dedupe_headers", "template_headers", mode="before")
    @classmethod
    def _split_csv(cls, value: object) -> object:
        if isinstance(value, str):  # env var / flag: comma-separated
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value

    @field_validator("dedupe_headers", "template_headers")
    @classmethod
    def _check_header_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # imported here: only this validator uses it (pure, no I/O)
        from relay.core.fingerprint import check_field_names

        check_field_names(value)  # ValueError names the bad one: non-ASCII, blank, colon
        return value

    @field_validator("dedupe_headers")
    @classmethod
    def _check_some_dedupe_header(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:  # no header could carry a key: every message would relay undeduplicated
            raise ValueError("dedupe_headers must name at least one header")
        return value

    @field_validator("hostname")
    @classmethod
    def _check_hostname(cls, value: str) -> str:
        # a Domain or address-literal (RFC 5321 section 4.1.2): it goes into the greeting and
        # the Received: header verbatim, where a blank or line break would break the header
        if not _HOSTNAME.fullmatch(value):
            raise ValueError(
                f"hostname {value!r} is not a domain name or [address literal] (ASCII letters, "
                "digits, '-', '.', '_', ':' and brackets; an IDN in its xn-- form)")
        return value

    @field_validator("fingerprint_secret")
    @classmethod
    def _check_fingerprint_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value():
            raise ValueError("fingerprint_secret must not be empty (leave it unset for SHA-256)")
        return value

    @field_validator("allowed_networks", "proxy_networks")
    @classmethod
    def _check_networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for net in value:
            ipaddress.ip_network(net, strict=False)  # ValueError names the bad one
        return value

    @field_validator("rate_limit")
    @classmethod
    def _check_rate_limit_labels(cls, value: tuple[RateLimit, ...]) -> tuple[RateLimit, ...]:
        """Each limit's label names its counters in the store and its metric: two entries
        with one label would share (and double-count) their buckets."""
        labels = [r.label for r in value]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(f"[[rate_limit]] entries share the label {', '.join(twice)}: "
                             "give each a distinct name")
        return value

    @field_validator("tls_listen")
    @classmethod
    def _check_tls_listen(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value, what="tls_listen")
        return value

    @field_validator("upstream", mode="before")
    @classmethod
    def _split_upstreams(cls, value: object) -> object:
        if isinstance(value, str):  # env var / flag: comma-separated
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            return tuple({"address": v} if isinstance(v, str) else v for v in value)
        return value

    @field_validator("upstream")
    @classmethod
    def _check_upstream(cls, value: tuple[UpstreamEntry, ...]) -> tuple[UpstreamEntry, ...]:
        if not value:
            raise ValueError("upstream needs at least one HOST:PORT (or maildir:PATH)")
        if len(value) > 1 and any(entry.is_maildir for entry in value):
            raise ValueError("a maildir:PATH upstream must be the only upstream (no failover "
                             "to or from a local Maildir), got " +
                             ", ".join(entry.address for entry in value))
        names = [entry.label for entry in value]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"upstream names must be unique (an entry's name, else its "
                             f"address): {', '.join(twice)} given twice")
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        schemes = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://",
                   "redis+sentinel://", "rediss+sentinel://", "sqlite:///", "postgresql://",
                   "postgres://")
        if not value.startswith(schemes):
            raise ValueError(
                "store must be a redis://, rediss:// or sqlite:///path URL, a postgresql:// "
                "URL, or a redis+cluster://host:port,... or "
                "redis+sentinel://host:port,.../service URL (rediss+ for TLS), got " + repr(value)
            )
        if value.startswith(("postgresql://", "postgres://")):
            return _check_postgres_url(value)
        # imported here: only this validator uses it (a pure parser, no I/O library)
        from relay.store.redis.urls import is_multi_host_url, parse_multi_host_url

        if is_multi_host_url(value):
            parse_multi_host_url(value)  # its ValueError names the fault, never the password
        elif value.startswith("sqlite:///"):
            from relay.store.sqlite import sqlite_path_from_url

            sqlite_path_from_url(value)  # "sqlite:///" alone names no file
        else:  # redis:// or rediss://: redis-py would quietly take db 0 for /abc
            parts = urlsplit(value)
            db = parts.path.strip("/")
            if db and not db.isdigit():
                raise ValueError(f"store URL database must be a number, got /{db}")
            try:
                parts.port  # noqa: B018  # raises ValueError for a port that is no number
            except ValueError:
                raise ValueError("store URL port must be a number from 0 to 65535") from None
        return value

    @field_validator("ledger")
    @classmethod
    def _check_ledger(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("ledger must be a postgresql:// (or postgres://) URL, got "
                             + repr(redact_url(value)))
        return _check_postgres_url(value, what="ledger")

    @model_validator(mode="after")
    def _check_relations(self) -> Settings:
        # an attempt renews its lease every third of it while it works, each renewal bounded
        # by store-timeout: two renewals must fit before the lease lapses
        if self.lease < 3 * self.store_timeout:
            raise SettingsRuleError(
                f"lease ({self.lease:g} s) must be at least three times store_timeout "
                f"({self.store_timeout:g} s): a working attempt renews its lease every third "
                "of it, and a renewal may take store_timeout", "lease", "store_timeout")
        if self.dedup_window < self.lease:
            raise SettingsRuleError(
                f"dedup_window ({self.dedup_window:g} s) must not be shorter than the lease "
                f"({self.lease:g} s)", "dedup_window", "lease")
        for index, entry in enumerate(self.template_policy):
            if entry.dedup_window is not None and entry.dedup_window < self.lease:
                raise SettingsRuleError(
                    f"template_policy.{index} (match {entry.match!r}): dedup_window "
                    f"({entry.dedup_window:g} s) must not be shorter than the lease "
                    f"({self.lease:g} s)", "template_policy", "lease")
        if self.ledger_required and self.ledger is None:
            raise SettingsRuleError(
                "ledger_required is set but no ledger is: name the audit ledger's database "
                "(postgresql://...) or leave ledger_required off", "ledger_required", "ledger")
        if self.fingerprint_secret_file is not None and self.fingerprint_secret is not None:
            raise SettingsRuleError("give fingerprint_secret_file or fingerprint_secret, not both",
                                    "fingerprint_secret_file", "fingerprint_secret")
        if self.upstream_password_file is not None and self.upstream_password is not None:
            raise SettingsRuleError("give upstream_password_file or upstream_password, not both",
                                    "upstream_password_file", "upstream_password")
        self._check_security()
        self._check_upstream_auth()
        self._check_upstream_entries()
        self._check_listeners_apart()
        return self

    def _check_upstream_entries(self) -> None:
        """The cool-down's cap is not below it; each ``upstream`` entry's own settings hold
        together with the global ones (OAuth2 AUTH needs its mailbox and the token endpoint;
        a client certificate goes with its key)."""
        if self.upstream_cooldown_max < self.upstream_cooldown:
            raise SettingsRuleError(
                f"upstream_cooldown_max ({self.upstream_cooldown_max:g} s) must not be below "
                f"upstream_cooldown ({self.upstream_cooldown:g} s)",
                "upstream_cooldown_max", "upstream_cooldown")
        for entry in self.upstream:
            cert = entry.client_cert or self.upstream_client_cert
            key = entry.client_key or self.upstream_client_key
            if (cert is None) != (key is None):
                raise SettingsRuleError(
                    f"upstream {entry.label}: client_cert and client_key go together",
                    "upstream", "upstream_client_cert", "upstream_client_key")
            auth = entry.auth or self.upstream_auth
            if auth == "password" or entry.auth is None:
                continue  # the global upstream_auth is checked above
            user = entry.user if entry.user is not None else self.upstream_user
            missing = [name for name, value in (
                ("user", user), ("oauth_token_url", self.oauth_token_url),
                ("oauth_client_id", self.oauth_client_id)) if not value]
            if self.oauth_refresh_token_file is None and self.oauth_client_secret_file is None:
                missing.append("oauth_client_secret_file or oauth_refresh_token_file")
            if missing:
                raise SettingsRuleError(
                    f"upstream {entry.label}: auth {auth} needs {', '.join(missing)}",
                    "upstream", "oauth_token_url", "oauth_client_id")

    def _check_upstream_auth(self) -> None:
        """OAuth2 AUTH needs the mailbox, the token endpoint (HTTPS: a secret goes to it), the
        client and a grant; a client key needs its certificate."""
        if (self.upstream_client_cert is None) != (self.upstream_client_key is None):
            raise SettingsRuleError("upstream_client_cert and upstream_client_key go together",
                                    "upstream_client_cert", "upstream_client_key")
        if self.oauth_token_url is not None and not self.oauth_token_url.startswith("https://"):
            raise SettingsRuleError("oauth_token_url must be an https:// URL: the client "
                                    "secret and the tokens cross it", "oauth_token_url")
        if self.upstream_auth == "password":
            return
        needed = ("upstream_user", "oauth_token_url", "oauth_client_id")
        missing = [name for name in needed if not getattr(self, name)]
        if missing:
            why = (" (upstream_user is the mailbox the token is for)"
                   if "upstream_user" in missing else "")
            raise SettingsRuleError(
                f"upstream_auth {self.upstream_auth} needs {', '.join(missing)}{why}",
                "upstream_auth", *missing)
        if self.oauth_refresh_token_file is None and self.oauth_client_secret_file is None:
            raise SettingsRuleError(
                f"upstream_auth {self.upstream_auth} needs oauth_client_secret_file (the "
                "client-credentials grant) or oauth_refresh_token_file (the refresh-token "
                "grant)", "upstream_auth", "oauth_client_secret_file",
                "oauth_refresh_token_file")

    def _check_listeners_apart(self) -> None:
        """Two listeners of this relay on one address would make the second bind fail."""
        wildcard = {"0.0.0.0", "::", "*"}  # noqa: S104 (compared, not bound)
        bound: list[tuple[str, int, str]] = []
        for field in ("listen", "tls_listen", "metrics_listen"):
            value = getattr(self, field)
            if value is None or value == "off":
                continue
            host, port = split_host_port(value, what=field)
            for other_host, other_port, other in bound:
                if port != 0 and port == other_port and (
                        host == other_host or host in wildcard or other_host in wildcard):
                    raise SettingsRuleError(
                        f"{other} and {field} would listen on one address ({value})",
                        other, field)
            bound.append((host, port, field))

    def _check_security(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingsRuleError("tls_cert and tls_key go together", "tls_cert", "tls_key")
        tls = self.tls_cert is not None
        if self.tls_listen and not tls:
            raise SettingsRuleError("tls_listen needs tls_cert and tls_key",
                                    "tls_listen", "tls_cert", "tls_key")
        if self.tls_required and not tls:
            raise SettingsRuleError("tls_required needs tls_cert and tls_key",
                                    "tls_required", "tls_cert", "tls_key")
        if self.auth_required and self.auth_file is None:
            raise SettingsRuleError("auth_required needs an auth_file",
                                    "auth_required", "auth_file")
        if self.auth_file is not None and not tls:
            raise SettingsRuleError(
                "auth_file needs TLS (tls_cert, tls_key): AUTH is offered only over TLS, so "
                "credentials never cross the network in clear", "auth_file", "tls_cert",
                "tls_key")

    def template_rules(self) -> tuple[TemplateRule, ...]:
        """The ``[[template_policy]]`` entries as the core's rules (design.md §4.6)."""
        return tuple(
            TemplateRule(match=t.match, dedup=t.dedup, window_s=t.dedup_window,
                         missing_key=t.missing_key, unknown=t.unknown_policy,
                         duplicate_reply=t.duplicate_reply, mode=t.mode)
            for t in self.template_policy)

    def window_for(self, templates: Sequence[str]) -> float:
        """The dedup window (seconds) of a message whose normalized template values are
        ``templates``: its ``[[template_policy]]`` entry's, else ``dedup_window``."""
        return Policy(window_s=self.dedup_window, templates=self.template_rules()
                      ).for_templates(templates).window_s

    @property
    def upstreams_with_clear_credentials(self) -> list[str]:
        """The labels of the upstreams to which a password or an OAuth2 token would go in clear:
        AUTH configured (a user for password AUTH, or xoauth2 / oauthbearer), TLS ``none``,
        and a host that is not this machine (:func:`is_loopback_host`)."""
        found = []
        for entry in self.upstream:
            if entry.is_maildir or (entry.tls or self.upstream_tls) != "none":
                continue
            auth = entry.auth or self.upstream_auth
            if auth == "password" and not (entry.user or self.upstream_user):
                continue
            host, _ = split_host_port(entry.address, what="upstream")
            if not is_loopback_host(host):
                found.append(entry.label)
        return found

    @property
    def upstream_summary(self) -> str:
        """The upstreams for messages: ``name=address`` (or the address) in order, joined by
        ``, ``."""
        return ", ".join(str(entry) for entry in self.upstream)

    @property
    def listen_address(self) -> tuple[str, int]:
        """``(host, port)`` of the SMTP listener."""
        return split_host_port(self.listen, what="listen")

    @property
    def ledger_timeout(self) -> float:
        """Seconds a call on the audit ledger may take: ``store_timeout``, at least 5 s (the
        ledger is off the message's path; its rows may wait)."""
        return max(5.0, self.store_timeout)

    @property
    def effective_workers(self) -> int:
        """How many worker processes serve: ``workers``, or when unset the number of CPUs this
        process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
        if self.workers is not None:
            return self.workers
        affinity = getattr(os, "sched_getaffinity", None)
        return max(1, len(affinity(0)) if affinity is not None else (os.cpu_count() or 1))

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the metrics HTTP server, or None when disabled."""
        if self.metrics_listen is None:
            return None
        return split_host_port(self.metrics_listen, what="metrics_listen")

    @property
    def fingerprint_secret_bytes(self) -> bytes | None:
        """The HMAC key of the fingerprint (UTF-8 of ``fingerprint_secret``, or of the
        ``fingerprint_secret_file``'s text without surrounding whitespace), or None.

        Raises ConfigError when the file cannot be read or holds nothing.
        """
        if self.fingerprint_secret_file is not None:
            return _secret_file(self.fingerprint_secret_file, "fingerprint_secret_file").encode()
        secret = self.fingerprint_secret
        return secret.get_secret_value().encode() if secret is not None else None

    def upstream_password_value(self) -> str | None:
        """The upstream AUTH password, read from the password file when one is configured.

        Raises ConfigError when the file cannot be read.
        """
        if self.upstream_password is not None:
            return self.upstream_password.get_secret_value()
        if self.upstream_password_file is None:
            return None
        return _secret_file(self.upstream_password_file, "upstream_password_file")

    def oauth_secret_values(self) -> tuple[str | None, str | None]:
        """The OAuth2 client secret and refresh token, read from their files (None where no
        file is set). Raises ConfigError when a file cannot be read or holds nothing."""
        secret = refresh = None
        if self.oauth_client_secret_file is not None:
            secret = _secret_file(self.oauth_client_secret_file, "oauth_client_secret_file")
        if self.oauth_refresh_token_file is not None:
            refresh = _secret_file(self.oauth_refresh_token_file, "oauth_refresh_token_file")
        return secret, refresh


def _secret_file(path: Path, field: str) -> str:
    """The text of the secret file ``path`` (setting ``field``) without surrounding whitespace.

    Raises ConfigError naming the setting when it cannot be read or holds nothing.
    """
    return read_secret_file(path, field, f" ({setting_names(field)})")


def read_secret_file(path: Path, label: str, where: str = "") -> str:
    """The text of the secret file ``path`` without surrounding whitespace (a Docker or
    systemd secret's final newline is not part of it). Raises ConfigError
    ``<label>: <why>: <path><where>`` when it cannot be read or holds nothing."""
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8"
        raise ConfigError(f"{label}: {reason}: {path}{where}") from exc
    if not secret:
        raise ConfigError(f"{label}: {path} is empty{where}")
    return secret


def _describe(exc: ValidationError, flagged: AbstractSet[str] | None = None) -> str:
    """One line per problem, naming each setting as it is set: flag (when the command has it:
    ``flagged`` holds the field names it offers; None: all), env var and file key. A rule
    between settings (a model-level check) is one line of its own that names each of them."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not where:
            cause = err.get("ctx", {}).get("error")
            fields = cause.fields if isinstance(cause, SettingsRuleError) else ()
            named = "; ".join(setting_names(f, flagged) for f in fields)
            lines.append(f"invalid combination of settings: {msg}"
                         + (f" (set by {named})" if named else ""))
            continue
        if err["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown setting (see config/dedup-relay.example.toml)")
            continue
        if err["type"] == "missing":
            msg = "required"
        field = str(err["loc"][0])
        lines.append(f"{where}: {msg} ({setting_names(field, flagged)})")
    return "\n".join(lines)


def unknown_env_vars(environ: Mapping[str, str]) -> list[str]:
    """``RELAY_*`` names in ``environ`` that are no setting (a typo is otherwise ignored)."""
    known = {f"RELAY_{name.upper()}" for name in Settings.model_fields} | {"RELAY_CONFIG"}
    return sorted(k for k in environ if k.upper().startswith("RELAY_") and k.upper() not in known)


class AdminSettings(Settings):
    """The settings as the admin commands read them: they talk to the store only, so the
    upstream (required to serve) may be absent."""

    upstream: UpstreamList = (UpstreamEntry(address="maildir:unused-by-admin-commands"),)


def load_settings(overrides: dict[str, Any], config_file: Path | None = None, *,
                  base: type[Settings] = Settings) -> Settings:
    """Build the settings from flags (``overrides``), env vars and an optional TOML file.

    Keys of ``overrides`` are field names; entries whose value is None are ignored. ``base``
    is :class:`Settings` or :class:`AdminSettings`. Raises ConfigError with one readable line
    per invalid setting.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    cls: type[Settings] = base
    if config_file is not None:
        if not config_file.is_file():
            raise ConfigError(f"config: no such file: {config_file} (--config or RELAY_CONFIG)")
        cls = type(
            "FileSettings",
            (base,),
            {"model_config": SettingsConfigDict(**{**Settings.model_config,
                                                   "toml_file": config_file})},
        )
    try:
        return cls(**given)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, frozenset(overrides))) from exc
    except ValueError as exc:  # e.g. TOML syntax errors from the file source
        raise ConfigError(f"config file {config_file}: {exc}") from exc
