"""The one frozen, validated settings object of dedup-relay.

Sources, highest priority first: command-line flags, environment variables ``RELAY_<FIELD>``
(for example ``RELAY_UPSTREAM``, ``RELAY_DEDUP_WINDOW``), the TOML file named by ``--config`` /
``RELAY_CONFIG`` (keys are the field names, see ``config/dedup-relay.example.toml``), defaults.
Durations are seconds (floats), sizes bytes.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from relay.core.errors import ConfigError

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
    if at:
        user = creds.split(":", 1)[0]
        authority = f"{user}:***@{hosts}"
    return _SECRET_PARAM.sub(r"\1***", f"{scheme}{sep}{authority}{slash}{tail}")


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


class Settings(BaseSettings):
    """Every setting of the relay (see ``config/dedup-relay.example.toml`` for each one).

    Raises pydantic's ValidationError on construction; :func:`load_settings` turns that into
    :class:`relay.core.errors.ConfigError` with one readable line per problem.
    """

    model_config = SettingsConfigDict(
        env_prefix="RELAY_", frozen=True, extra="forbid", toml_file=None
    )

    # listener
    listen: str = "127.0.0.1:2525"
    hostname: str = Field(default_factory=socket.getfqdn)
    max_message_size: int = Field(default=10 * 1024 * 1024, ge=1024)
    max_recipients: int = Field(default=100, ge=1)
    client_timeout: float = Field(default=300.0, gt=0)
    data_deadline: float = Field(default=600.0, gt=0)
    session_lifetime: float = Field(default=3600.0, gt=0)
    max_idle_commands: int = Field(default=100, ge=1)

    # listener security
    allowed_networks: CsvList = ("127.0.0.0/8", "::1/128")
    allowed_senders: CsvList = ()
    max_connections: int = Field(default=200, ge=1)
    max_connections_per_ip: int = Field(default=20, ge=1)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_listen: str | None = None
    tls_min_version: Literal["TLSv1.2", "TLSv1.3"] = "TLSv1.2"
    tls_handshake_timeout: float = Field(default=10.0, gt=0)
    tls_required: bool = False
    auth_file: Path | None = None
    auth_required: bool = False
    auth_failure_delay: float = Field(default=1.0, ge=0)
    auth_max_failures: int = Field(default=5, ge=1)
    auth_failure_window: float = Field(default=600.0, gt=0)
    proxy_protocol: bool = False
    proxy_networks: CsvList = ("127.0.0.0/8", "::1/128")

    # upstream / smarthost
    upstream: str
    upstream_tls: Literal["none", "starttls", "tls"] = "none"
    upstream_verify: bool = True
    upstream_user: str | None = None
    upstream_password_file: Path | None = None
    upstream_password: SecretStr | None = None
    upstream_timeout: float = Field(default=600.0, gt=0)
    upstream_command_timeout: float = Field(default=60.0, gt=0)
    upstream_connect_timeout: float = Field(default=30.0, gt=0)
    upstream_pool_size: int = Field(default=4, ge=0)
    upstream_pool_idle: float = Field(default=30.0, gt=0)
    upstream_pool_max_messages: int = Field(default=100, ge=1)

    # store and dedup
    store: str = DEFAULT_STORE_URL
    store_prefix: str = "email:fp:"
    store_timeout: float = Field(default=2.0, gt=0)
    dedup_window: float = Field(default=86400.0, gt=0)
    lease: float = Field(default=900.0, gt=0)
    dedupe_headers: CsvList = ("X-Dedupe-Key", "Idempotency-Key")
    template_headers: CsvList = ("X-Template",)
    max_key_chars: int = Field(default=256, ge=1)
    local_part_case_sensitive: bool = False
    fingerprint_secret: SecretStr | None = None
    missing_key: Literal["relay", "reject"] = "relay"
    strip_dedupe_headers: bool = False
    scope_by_auth: bool = False
    unknown_policy: Literal["suppress", "hold", "send"] = "suppress"
    store_down: Literal["fail_closed", "fail_open"] = "fail_closed"
    dsn_on_partial_failure: bool = True  # RFC 3464 notice for recipients refused after a 250

    # operations
    metrics_listen: str | None = "127.0.0.1:9725"
    health_interval: float = Field(default=5.0, gt=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = "json"
    log_recipients: bool = False
    shutdown_grace: float = Field(default=30.0, ge=0)
    # settles still owed when the relay stops (the store did not answer), applied at the next
    # start; "" keeps them in memory only (lost with the process)
    settle_journal: str = "data/owed-settles.jsonl"

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
        split_host_port(value, what="metrics-listen")
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

    @field_validator("allowed_networks", "proxy_networks")
    @classmethod
    def _check_networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for net in value:
            ipaddress.ip_network(net, strict=False)  # ValueError names the bad one
        return value

    @field_validator("tls_listen")
    @classmethod
    def _check_tls_listen(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value, what="tls-listen")
        return value

    @field_validator("upstream")
    @classmethod
    def _check_upstream(cls, value: str) -> str:
        if value.startswith("maildir:"):
            if not value[len("maildir:") :]:
                raise ValueError("upstream maildir:PATH needs a path")
            return value
        split_host_port(value, what="upstream")
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        schemes = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://",
                   "redis+sentinel://", "rediss+sentinel://", "sqlite:///")
        if not value.startswith(schemes):
            raise ValueError(
                "store must be a redis://, rediss:// or sqlite:///path URL, or a "
                "redis+cluster://host:port,... or redis+sentinel://host:port,.../service URL "
                "(rediss+ for TLS), got " + repr(value)
            )
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

    @model_validator(mode="after")
    def _check_relations(self) -> Settings:
        # an attempt renews its lease every third of it while it works, each renewal bounded
        # by store-timeout: two renewals must fit before the lease lapses
        if self.lease < 3 * self.store_timeout:
            raise ValueError(
                f"lease ({self.lease:g} s) must be at least three times store_timeout "
                f"({self.store_timeout:g} s): a working attempt renews its lease every third "
                "of it, and a renewal may take store_timeout"
            )
        if self.dedup_window < self.lease:
            raise ValueError("dedup-window must not be shorter than the lease")
        if self.upstream_password_file is not None and self.upstream_password is not None:
            raise ValueError("give upstream-password-file or upstream-password, not both")
        self._check_security()
        return self

    def _check_security(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls-cert and tls-key go together")
        tls = self.tls_cert is not None
        if (self.tls_listen or self.tls_required) and not tls:
            raise ValueError("tls-listen and tls-required need tls-cert and tls-key")
        if self.auth_required and self.auth_file is None:
            raise ValueError("auth-required needs an auth-file")
        if self.auth_file is not None and not tls:
            raise ValueError("auth-file needs TLS (tls-cert, tls-key): AUTH is offered only "
                             "over TLS, so credentials never cross the network in clear")

    @property
    def listen_address(self) -> tuple[str, int]:
        """``(host, port)`` of the SMTP listener."""
        return split_host_port(self.listen, what="listen")

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the metrics HTTP server, or None when disabled."""
        if self.metrics_listen is None:
            return None
        return split_host_port(self.metrics_listen, what="metrics-listen")

    @property
    def fingerprint_secret_bytes(self) -> bytes | None:
        """The HMAC key of the fingerprint (UTF-8 of ``fingerprint_secret``), or None."""
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
        try:
            password = self.upstream_password_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(
                f"upstream-password-file: {exc.strerror}: {self.upstream_password_file}"
            ) from exc
        if not password:
            raise ConfigError(f"upstream-password-file: {self.upstream_password_file} is empty")
        return password


def _describe(exc: ValidationError, flagged: AbstractSet[str] = frozenset()) -> str:
    """One line per problem, naming the setting as flag (when it has one: ``flagged`` holds
    the field names the command line offers), env var and file key. A rule between settings
    (a model-level check) is one line of its own: its text names the settings."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not where:
            lines.append(f"invalid combination of settings: {msg}")
            continue
        if err["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown setting (see config/dedup-relay.example.toml)")
            continue
        if err["type"] == "missing":
            msg = "required"
        flag = where.replace("_", "-")
        names = f"RELAY_{where.upper()} or `{where}` in the file"
        if where in flagged:
            names = f"--{flag}, {names}"
        lines.append(f"{flag}: {msg} ({names})")
    return "\n".join(lines)


def unknown_env_vars(environ: Mapping[str, str]) -> list[str]:
    """``RELAY_*`` names in ``environ`` that are no setting (a typo is otherwise ignored)."""
    known = {f"RELAY_{name.upper()}" for name in Settings.model_fields} | {"RELAY_CONFIG"}
    return sorted(k for k in environ if k.upper().startswith("RELAY_") and k.upper() not in known)


class AdminSettings(Settings):
    """The settings as the admin commands read them: they talk to the store only, so the
    upstream (required to serve) may be absent."""

    upstream: str = "maildir:unused-by-admin-commands"


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
            raise ConfigError(f"config: no such file: {config_file}")
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
