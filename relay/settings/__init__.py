"""The one frozen, validated settings object of dedup-relay, mixed from one section per part.

Sources, highest priority first: command-line flags ``--<field-in-kebab-case>`` (every field is
one, :func:`flag_name`), environment variables ``RELAY_<FIELD>`` (:func:`env_name`, for example
``RELAY_UPSTREAM``, ``RELAY_DEDUP_WINDOW``), the TOML file named by ``--config`` /
``RELAY_CONFIG`` (keys are the field names, see ``dedup-relay example config``), defaults.
Each field's ``description`` is its ``--help`` text and its line of docs/settings.md.
Durations are seconds (floats), sizes bytes.

Each part's section (:mod:`relay.settings.listener`, ``access``, ``upstream``, ``store``,
``dedup``, ``ledger``, ``console``, ``operations``) holds its fields, its validators, the
builder of its part, its file checks, the settings it applies on reload and its start-up
description. This module holds only what spans sections: the rules between them, the file
checks of all, and loading.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from relay.core.errors import ConfigError
from relay.core.http_rules import is_loopback_host
from relay.core.policy import Policy
from relay.settings.access import AccessSettings
from relay.settings.common import (
    COMPUTED_DEFAULTS,
    ENV_PREFIX,
    FileCheck,
    Section,
    SettingsRuleError,
    choices,
    env_name,
    extra_missing,
    flag_name,
    host_port,
    kind_extra_missing,
    plain_annotation,
    postgres_files,
    read_secret_file,
    redact_url,
    secret_file_exposure,
    setting_names,
    shown_value,
    split_host_port,
)
from relay.settings.console import CONSOLE_ROLES, ConsoleSettings
from relay.settings.dedup import (
    POLICY_SETTINGS,
    DedupSettings,
    KeyRuleEntry,
    RateLimit,
    TemplatePolicy,
)
from relay.settings.ledger import LedgerSettings
from relay.settings.listener import ListenerSettings
from relay.settings.oauth import OAuthSettings
from relay.settings.operations import OperationsSettings
from relay.settings.reconcile import ReconcileSettings, ReconcileSource, reconcile_rule_problem
from relay.settings.store import DEFAULT_STORE_URL, StoreSettings
from relay.settings.upstream import UpstreamEntry, UpstreamList, UpstreamSettings

__all__ = [
    "COMPUTED_DEFAULTS", "CONSOLE_ROLES", "DEFAULT_STORE_URL", "ENV_PREFIX",
    "FILE_ONLY_SETTINGS", "FILE_SETTINGS",
    "POLICY_SETTINGS", "RELOADABLE", "SECTIONS", "AccessSettings", "AdminSettings",
    "ConsoleSettings", "DedupSettings", "KeyRuleEntry", "LedgerSettings", "ListenerSettings",
    "OAuthSettings",
    "OperationsSettings", "RateLimit", "ReconcileSettings", "ReconcileSource",
    "Settings", "SettingsRuleError", "StoreSettings", "TemplatePolicy", "UpstreamEntry",
    "UpstreamSettings", "check_settings", "choices", "env_name", "extra_missing", "file_warnings",
    "flag_name",
    "host_port", "is_loopback_host", "kind_extra_missing", "load_settings", "plain_annotation",
    "postgres_files", "read_secret_file", "redact_url", "section_fields", "setting_names",
    "shown_value", "split_host_port", "unknown_env_vars",
]

if TYPE_CHECKING:
    from relay.upstream.oauth import TokenProvider

# the sections in the order of --help and docs/settings.md
SECTIONS: tuple[type[Section], ...] = (
    ListenerSettings, AccessSettings, UpstreamSettings, OAuthSettings, StoreSettings,
    DedupSettings, LedgerSettings, ReconcileSettings, ConsoleSettings, OperationsSettings)

# settings that only the config file sets (a table or an array of tables): no flag
FILE_ONLY_SETTINGS = frozenset({"template_policy", "rate_limit", "key_rule",
                                "reconcile_source"})
# the settings a reload applies to the running relay; any other that changed needs a restart
RELOADABLE: tuple[str, ...] = tuple(name for section in SECTIONS for name in section.LIVE)
# settings naming a file whose content may change in place (a rotated certificate): a reload
# compares a digest of the content as well as the path
FILE_SETTINGS: tuple[str, ...] = tuple(name for section in SECTIONS for name in section.FILES)


def section_fields(section: type[Section]) -> list[str]:
    """The field names ``section`` declares itself, in their order."""
    return [name for name in section.model_fields
            if name in vars(section).get("__annotations__", {})]


class Settings(OperationsSettings, ConsoleSettings, ReconcileSettings, LedgerSettings,
               DedupSettings,
               StoreSettings, OAuthSettings, UpstreamSettings, AccessSettings, ListenerSettings,
               BaseSettings):
    """Every setting of the relay (see ``config/dedup-relay.example.toml`` for each one): the
    sections of :data:`SECTIONS` mixed into one object (fields in their order: the bases in
    reverse), so every ``RELAY_*`` name, file key and flag is the field's own name.

    Raises pydantic's ValidationError on construction; :func:`load_settings` turns that into
    :class:`relay.core.errors.ConfigError` with one readable line per problem.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="forbid", toml_file=None
    )

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

    @model_validator(mode="after")
    def _check_between_sections(self) -> Settings:
        # an attempt renews its lease every third of it while it works, each renewal bounded
        # by store-timeout: two renewals must fit before the lease lapses
        if self.lease < 3 * self.store_timeout:
            raise SettingsRuleError(
                f"lease ({self.lease:g} s) must be at least three times store_timeout "
                f"({self.store_timeout:g} s): a working attempt renews its lease every third "
                "of it, and a renewal may take store_timeout", "lease", "store_timeout")
        self._check_listeners_apart()
        self._check_oauth_auth()
        self._check_console_in_clear()
        problem = reconcile_rule_problem(self.reconcile_source, ledger=self.ledger,
                                         upstreams=[e.label for e in self.upstream])
        if problem is not None:
            raise problem
        return self

    @property
    def console_certificate(self) -> tuple[Path, Path] | None:
        """The console's (certificate, key): its own, else the SMTP listener's; None when
        neither is set, or with ``console_plain_http``."""
        if self.console_plain_http:
            return None
        if self.console_tls_cert is not None and self.console_tls_key is not None:
            return self.console_tls_cert, self.console_tls_key
        if self.tls_cert is not None and self.tls_key is not None:
            return self.tls_cert, self.tls_key
        return None

    def console_restart_needed(self, new: Settings) -> set[str]:
        """The console's certificate settings when its HTTPS is switched on or off going from
        these settings to ``new`` (it serves as it started; a new pair is taken live)."""
        if (self.console_certificate is None) == (new.console_certificate is None):
            return set()
        return {"console_tls_cert", "console_tls_key", "console_plain_http"}

    def _check_console_in_clear(self) -> None:
        """A console off this host serves HTTPS, unless the operator says a proxy does."""
        if self.console_listen is None or self.console_on_loopback \
                or self.console_plain_http or self.console_certificate is not None:
            return
        raise SettingsRuleError(
            f"console_listen {self.console_listen} is off this host and has no certificate: "
            "passwords would cross the network in clear; set console_tls_cert and "
            "console_tls_key (or the listener's tls_cert), or console_plain_http behind a "
            "proxy that terminates TLS", "console_listen", "console_tls_cert",
            "console_plain_http")

    @property
    def oauth_auth_upstreams(self) -> list[tuple[str, str, str | None]]:
        """``(label, auth, user)`` of each SMTP upstream whose AUTH takes an OAuth2 token
        (xoauth2, oauthbearer): its own ``auth`` and ``user``, else the global ones."""
        return [(entry.label, auth, entry.user if entry.user is not None else self.upstream_user)
                for entry in self.upstream if not entry.is_maildir
                for auth in [entry.auth or self.upstream_auth] if auth != "password"]

    def _check_oauth_auth(self) -> None:
        """An upstream whose AUTH takes an OAuth2 token needs its mailbox (``upstream_user``,
        or the entry's ``user``) and a provider that can fetch a token; a Google token is for
        one mailbox (upstream_user), so every such upstream logs in as it."""
        using = self.oauth_auth_upstreams
        oauth_missing = self.oauth_missing()
        for label, auth, user in using:
            own = any(e.label == label and e.auth is not None for e in self.upstream)
            mailbox = [] if user else ["user" if own else "upstream_user"]
            missing = [*mailbox, *oauth_missing]
            if not missing:
                continue
            where = f"upstream {label}: auth" if own else "upstream_auth"
            why = " (the mailbox the token is for)" if mailbox else ""
            names = [n for m in missing for n in m.split(" or ") if n != "user"]
            raise SettingsRuleError(
                f"{where} {auth} needs {', '.join(missing)}{why} (oauth_provider "
                f"{self.oauth_provider})", "upstream" if own else "upstream_auth", *names)
        others = sorted({user or "" for _, _, user in using} - {self.upstream_user or ""})
        if self.oauth_provider == "google" and others:
            raise SettingsRuleError(
                "oauth_provider google fetches a token for upstream_user only; an upstream "
                f"logs in as {others[0]!r}", "oauth_provider", "upstream")

    def smarthost_tokens(self, on_failure: Callable[[str], None] | None = None
                         ) -> TokenProvider | None:
        """The OAuth2 token provider the SMTP upstreams share (:meth:`OAuthSettings.
        token_provider`, each token request bounded by ``upstream_connect_timeout``, its
        refresh lock required with several workers), None when no upstream's AUTH takes a
        token. ``on_failure``: called with the kind of each failed fetch (the metric). Raises
        ConfigError as that method."""
        if not self.oauth_auth_upstreams:
            return None
        return self.token_provider(mailbox=self.upstream_user,
                                   timeout_s=self.upstream_connect_timeout,
                                   shared=self.effective_workers > 1, on_failure=on_failure)

    def _check_listeners_apart(self) -> None:
        """Two listeners of this relay on one address would make the second bind fail."""
        wildcard = {"0.0.0.0", "::", "*"}  # noqa: S104 (compared, not bound)
        bound: list[tuple[str, int, str]] = []
        for field in ("listen", "tls_listen", "metrics_listen", "console_listen"):
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

    @property
    def ledger_timeout(self) -> float:
        """Seconds a call on the audit ledger may take: ``store_timeout``, at least 5 s (the
        ledger is off the message's path; its rows may wait)."""
        return max(5.0, self.store_timeout)

    def dedup_policy(self) -> Policy:
        """The dedup policy (:meth:`DedupSettings.policy`) with the store's key prefix and key
        form. Raises ConfigError when a fingerprint secret's file cannot be read."""
        return self.policy(key_prefix=self.store_prefix, key_format=self.store_key_format,
                           secret=self.fingerprint_secret_bytes,
                           previous_secret=self.fingerprint_secret_previous_bytes)

    @property
    def processing_s(self) -> float:
        """Seconds a message may take from its final dot to its reply at most: connect, four
        commands and the final reply upstream, four store calls, and the client's timeout; with
        ``in_flight_wait``, that wait and a second transaction (the keys it waited for, relayed
        once released, design.md §4.8) with its four store calls."""
        upstream = (self.upstream_connect_timeout + 4 * self.upstream_command_timeout
                    + self.upstream_timeout + 4 * self.store_timeout)
        waited = self.in_flight_wait + upstream if self.in_flight_wait > 0 else 0.0
        return upstream + waited + self.client_timeout


class AdminSettings(Settings):
    """The settings as the admin commands read them: they talk to the store only, so the
    upstream (required to serve) may be absent."""

    upstream: UpstreamList = (UpstreamEntry(address="maildir:unused-by-admin-commands"),)


def check_settings(settings: Settings, *, store: bool = True) -> None:
    """Check what the settings name outside themselves, as the relay will read it at start,
    without opening the store or binding a port: every section's :meth:`Section.file_checks`
    (the secret files, the TLS pairs, the credentials file, the CA bundles, the files a store
    or ledger URL names, an existing SQLite file's format, the settle journal's and the pid
    file's directories).

    ``serve`` and ``check-config`` both call it; ``store=False`` (a reload: the store cannot
    change live) leaves the store's files alone (see :meth:`StoreSettings.file_checks`).
    Raises :class:`ConfigError` with one line per problem, each naming its setting (flag, env
    var, file key).
    """
    checks: list[FileCheck] = []
    for section in (UpstreamSettings, OAuthSettings, DedupSettings, AccessSettings,
                    StoreSettings, LedgerSettings, ReconcileSettings, ConsoleSettings,
                    OperationsSettings):
        checks += section.file_checks(settings, live=not store)
    checks += _shared_refresh_lock(settings)
    problems: list[str] = []
    for fields, action in checks:
        try:
            action()
        except ConfigError as exc:
            text = str(exc).removeprefix("tls-cert/tls-key: ")  # relay.smtp.tls's own prefix
            names = "; ".join(setting_names(f) for f in fields)
            problems.append(text if names in text else f"{', '.join(fields)}: {text} ({names})")
    if problems:
        raise ConfigError("\n".join(problems))


def _shared_refresh_lock(settings: Settings) -> list[FileCheck]:
    """With several workers, the lock they take turns on to refresh the token of
    ``oauth_refresh_token_file`` must be usable (:func:`relay.upstream.oauth_lock.check_lock`:
    a refresh would fail otherwise)."""
    path = settings.oauth_refresh_token_file
    if path is None or settings.effective_workers == 1:
        return []

    def check() -> None:
        from relay.upstream.oauth_lock import check_lock

        problem = check_lock(path)
        if problem is not None:
            raise ConfigError(f"the workers' refresh-token lock {problem}: with "
                              f"{settings.effective_workers} workers no refresh would run")
    return [(("oauth_refresh_token_file",), check)]


def file_warnings(settings: Settings) -> list[str]:
    """What ``check-config`` prints and the relay logs at start as WARNINGs about the files
    the settings name: each secret file open to its group or others (every section's
    :meth:`Section.secret_files`, one rule: :func:`secret_file_exposure`), and a relay of one
    worker whose refresh-token lock is not usable (it refreshes unlocked)."""
    warnings = [f"{label}: {exposure}" for section in SECTIONS
                for label, path in section.secret_files(settings)
                for exposure in [secret_file_exposure(path)] if exposure is not None]
    path = settings.oauth_refresh_token_file
    if path is not None and settings.effective_workers == 1:
        from relay.upstream.oauth_lock import check_lock

        problem = check_lock(path)
        if problem is not None:
            warnings.append(f"oauth_refresh_token_file: the refresh-token lock {problem}: "
                            "this relay's only worker refreshes unlocked")
    return warnings


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
            lines.append(f"{where}: unknown setting (every setting: `dedup-relay example config`)")
            continue
        if err["type"] == "missing":
            msg = "required"
        field = str(err["loc"][0])
        lines.append(f"{where}: {msg} ({setting_names(field, flagged)})")
    return "\n".join(lines)


def unknown_env_vars(environ: Mapping[str, str]) -> list[str]:
    """``RELAY_*`` names in ``environ`` that are no setting (a typo is otherwise ignored)."""
    known = {env_name(name) for name in Settings.model_fields} | {"RELAY_CONFIG"}
    return sorted(k for k in environ if k.upper().startswith(ENV_PREFIX)
                  and k.upper() not in known)


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
