"""The smarthosts: where messages go (in failover order), TLS and AUTH to them (password,
XOAUTH2, OAUTHBEARER with an OAuth2 token), timeouts (RFC 5321 section 4.5.3.2), the
connection pool, cool-downs, and the RFC 3464 notice for recipients refused after a 250; built
into :class:`relay.upstream.failover.FailoverUpstream`."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from relay.core.errors import ConfigError
from relay.core.http_rules import is_loopback_host
from relay.settings.common import (
    FileCheck,
    SecretFile,
    Section,
    SettingsRuleError,
    ca_bundle,
    check_domain_name,
    client_pair,
    read_secret_file,
    secret_setting,
    setting_names,
    split_host_port,
)

if TYPE_CHECKING:
    from relay.core.dsn import DsnSender
    from relay.core.interfaces import Upstream
    from relay.ops.metrics import PrometheusMetrics
    from relay.upstream.failover import FailoverMetrics, FailoverUpstream
    from relay.upstream.oauth import TokenProvider
    from relay.upstream.smtp import SmtpUpstreamConfig


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
    """One upstream of the ``upstream`` list, tried in the order given: its ``address``
    (``HOST:PORT``, ``[v6]:PORT`` or ``maildir:PATH``, the last only as the single upstream);
    in the config file also an inline table whose other keys override the global
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


# the upstreams in order: a TOML array (of strings or inline tables), or in an env var / flag a
# comma-separated list of HOST:PORT / maildir:PATH
UpstreamList = Annotated[tuple[UpstreamEntry, ...], NoDecode]


def entry_secret(path: Path, name: str) -> str:
    """The password in the file ``path`` of the upstream entry ``name`` (stripped). Raises
    ConfigError naming the entry when it cannot be read or is empty."""
    return read_secret_file(path, f"upstream {name}: password_file")


class UpstreamSettings(Section):
    """The smarthosts in failover order, TLS and AUTH to them, timeouts, pool, cool-downs."""

    TITLE: ClassVar[str] = "Upstream (smarthost)"
    FILES: ClassVar[tuple[str, ...]] = (
        "upstream_password_file", "upstream_ca_file", "upstream_client_cert",
        "upstream_client_key")

    upstream: UpstreamList = Field(description=(
        "smarthost HOST:PORT, or several tried in this order (comma-separated, or the flag "
        "repeated; a message moves on only on a definite failure before any recipient was "
        "accepted), or maildir:PATH for a local Maildir (staging, CI)"))
    upstream_tls: Literal["none", "starttls", "tls"] = Field("none", description=(
        "TLS to the smarthost: none, starttls (required: 451 4.4.1 when not offered) or tls "
        "(implicit, port 465)"))
    upstream_verify: bool = Field(True, description=(
        "verify the smarthost's certificate and name (turn off for a lab only)"))
    upstream_helo_name: str | None = Field(None, description=(
        "the name the relay gives in EHLO/HELO to the smarthost (Postfix's smtp_helo_name: "
        "a smarthost that checks it against the client's address); unset: hostname"))
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
        "(RFC 7628) with an OAuth2 access token from oauth_provider"))
    dsn_on_partial_failure: bool = Field(True, description=(
        "send the sender an RFC 3464 notice for recipients refused permanently after a 250"))

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

    @field_validator("upstream_helo_name")
    @classmethod
    def _check_helo_name(cls, value: str | None) -> str | None:
        return None if value is None else check_domain_name(value, what="upstream_helo_name")

    @model_validator(mode="after")
    def _check_upstream_rules(self) -> UpstreamSettings:
        if self.upstream_password_file is not None and self.upstream_password is not None:
            raise SettingsRuleError("give upstream_password_file or upstream_password, not both",
                                    "upstream_password_file", "upstream_password")
        self._check_upstream_auth()
        self._check_upstream_entries()
        return self

    def _check_upstream_entries(self) -> None:
        """The cool-down's cap is not below it; each ``upstream`` entry's client certificate
        goes with its key (its own or the global one)."""
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
        # an OAuth2 AUTH's mailbox and token: a rule between sections (relay.settings)

    def _check_upstream_auth(self) -> None:
        """A client key needs its certificate (what OAuth2 AUTH needs is a rule between
        sections: relay.settings)."""
        if (self.upstream_client_cert is None) != (self.upstream_client_key is None):
            raise SettingsRuleError("upstream_client_cert and upstream_client_key go together",
                                    "upstream_client_cert", "upstream_client_key")


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

    def upstream_password_value(self) -> str | None:
        """The upstream AUTH password, read from the password file when one is configured.

        Raises ConfigError when the file cannot be read.
        """
        if self.upstream_password is not None:
            return self.upstream_password.get_secret_value()
        if self.upstream_password_file is None:
            return None
        return secret_setting(self.upstream_password_file, "upstream_password_file")

    def file_checks(self, *, live: bool) -> list[FileCheck]:
        """The password and secret files (read), the CA bundles and client certificates
        (loaded as the relay will load them), each entry's own too."""
        checks: list[FileCheck] = [
            (("upstream_password_file",), self.upstream_password_value)]
        for entry in self.upstream:
            if entry.password_file is not None:
                checks.append((("upstream",), functools.partial(
                    entry_secret, entry.password_file, entry.label)))
        if self.upstream_ca_file is not None:
            path = self.upstream_ca_file
            checks.append((("upstream_ca_file",), ca_bundle(path, f"{path}: no PEM CA file")))
        cert, key = self.upstream_client_cert, self.upstream_client_key
        if cert is not None:
            checks.append((("upstream_client_cert", "upstream_client_key"), client_pair(
                cert, key, f"{cert} and {key}: no PEM certificate chain and its private key")))
        return checks + self._entry_tls_checks()

    def secret_files(self) -> list[SecretFile]:
        """The AUTH password files and the client certificates' private keys (the
        certificate's file when it holds the key), the global ones and each entry's own."""
        files: list[SecretFile] = []
        key = self.upstream_client_key or self.upstream_client_cert
        for name, path in (("upstream_password_file", self.upstream_password_file),
                           ("upstream_client_key", key)):
            if path is not None:
                files.append((name, path))
        for entry in self.upstream:
            # without a key file of its own nor a global one, its certificate's file holds it
            own_key = entry.client_key or (
                entry.client_cert if self.upstream_client_key is None else None)
            for name, path in (("password_file", entry.password_file),
                               ("client_key", own_key)):
                if path is not None:
                    files.append((f"upstream {entry.label}: {name}", path))
        return files

    def _entry_tls_checks(self) -> list[FileCheck]:
        """The CA bundle and client certificate an ``upstream`` entry names itself; each
        problem names the entry."""
        checks: list[FileCheck] = []
        for entry in self.upstream:
            if entry.ca_file is not None:
                checks.append((("upstream",), ca_bundle(
                    entry.ca_file, f"upstream {entry.label}: {entry.ca_file}: no PEM CA file")))
            if entry.client_cert is not None or entry.client_key is not None:
                cert = entry.client_cert or self.upstream_client_cert
                key = entry.client_key or self.upstream_client_key
                if cert is None:
                    continue  # refused by the settings' rules already
                checks.append((("upstream",), client_pair(
                    cert, key, f"upstream {entry.label}: {cert} and {key}: no PEM certificate "
                    "chain and its private key")))
        return checks

    def failover_upstream(self, *, local_hostname: str, default_pool_size: int,
                          health_interval_s: float, metrics: FailoverMetrics | None = None,
                          token_provider: TokenProvider | None = None) -> FailoverUpstream:
        """The upstreams in order behind one :class:`FailoverUpstream` (a single one is always
        tried: no cool-down): the Maildir for ``maildir:PATH``, else an SMTP smarthost per
        entry, each with the entry's own settings over the global ``upstream_*`` ones.
        ``default_pool_size``: idle connections per upstream when ``upstream_pool_size`` is
        unset; ``token_provider``: the OAuth2 tokens of XOAUTH2 / OAUTHBEARER AUTH (the
        ``oauth`` section's). Raises ConfigError when an entry's password file cannot be
        read."""
        from relay.upstream.failover import FailoverUpstream
        from relay.upstream.maildir import MaildirUpstream
        from relay.upstream.smtp import SmtpUpstream

        first = self.upstream[0]
        if first.is_maildir:
            members: list[tuple[str, Upstream]] = [
                (first.label, MaildirUpstream(path=Path(first.address[len("maildir:") :])))]
        else:
            members = [(entry.label, SmtpUpstream(config=self.smtp_upstream_config(
                entry, token_provider, local_hostname=local_hostname,
                default_pool_size=default_pool_size))) for entry in self.upstream]
        return FailoverUpstream(
            members, cooldown_s=self.upstream_cooldown,
            cooldown_max_s=self.upstream_cooldown_max,
            # a probe waits as long as a delivery's connect does: an upstream that greets
            # within upstream_connect_timeout is not cooled down for being slower than a probe
            # (the readiness probe's own bound cancels a slow ping: not ready, no cool-down)
            probe_timeout_s=self.upstream_connect_timeout,
            # each upstream's share of a readiness probe ends within HealthMonitor's own bound
            readiness_timeout_s=0.9 * min(self.upstream_connect_timeout, 3.0,
                                          health_interval_s * 2), metrics=metrics)

    def smtp_upstream_config(self, entry: UpstreamEntry, token_provider: TokenProvider | None,
                             *, local_hostname: str, default_pool_size: int
                             ) -> SmtpUpstreamConfig:
        """The SMTP upstream ``entry`` (``HOST:PORT``): its own keys, else the global
        ``upstream_*`` settings; it says ``upstream_helo_name`` in EHLO, else
        ``local_hostname``. Raises ConfigError when its password file cannot be read, or its
        OAuth2 AUTH has no token provider or user."""
        from relay.upstream.smtp import SmtpUpstreamConfig

        host, port = split_host_port(entry.address, what="upstream")
        password = (entry_secret(entry.password_file, entry.label)
                    if entry.password_file is not None else self.upstream_password_value())
        pool_size = (entry.pool_size if entry.pool_size is not None
                     else default_pool_size if self.upstream_pool_size is None
                     else self.upstream_pool_size)
        try:
            return SmtpUpstreamConfig(
                host=host, port=port, name=entry.label,
                local_hostname=self.upstream_helo_name or local_hostname,
                tls=entry.tls or self.upstream_tls,
                verify=self.upstream_verify if entry.verify is None else entry.verify,
                username=entry.user if entry.user is not None else self.upstream_user,
                password=password,
                connect_timeout_s=self.upstream_connect_timeout,
                command_timeout_s=self.upstream_command_timeout,
                final_timeout_s=self.upstream_timeout,
                pool_size=pool_size, pool_idle_s=self.upstream_pool_idle,
                pool_max_messages=self.upstream_pool_max_messages,
                auth=entry.auth or self.upstream_auth, token_provider=token_provider,
                ca_file=entry.ca_file or self.upstream_ca_file,
                client_cert=entry.client_cert or self.upstream_client_cert,
                client_key=entry.client_key or self.upstream_client_key,
            )
        except ValueError as exc:
            raise ConfigError(f"upstream {entry.label}: {exc} ({setting_names('upstream')})"
                              ) from exc

    def dsn_sender(self, upstream: Upstream, metrics: PrometheusMetrics, *, reporting_mta: str,
                   log_addresses: bool) -> DsnSender | None:
        """The RFC 3464 notifier for recipients refused after a 250, unless
        ``dsn_on_partial_failure`` is off; it sends through ``upstream``."""
        from relay.core.dsn import DsnSender

        if not self.dsn_on_partial_failure:
            return None
        first = self.upstream[0]
        remote = None if first.is_maildir else split_host_port(first.address,
                                                               what="upstream")[0]
        return DsnSender(upstream=upstream, metrics=metrics, reporting_mta=reporting_mta,
                         remote_mta=remote, log_addresses=log_addresses)

    def describe_upstream(self) -> str:
        """The upstreams for the start-up line, with their TLS."""
        summary = self.upstream_summary
        if not self.upstream[0].is_maildir:
            summary += (f" (tls {self.upstream_tls}"
                        f"{'' if self.upstream_verify else ', unverified'})")
        return summary

    def upstream_warnings(self) -> list[str]:
        """What the start-up log warns about: a smarthost whose certificate is not verified,
        AUTH that would cross the network in clear."""
        warnings = []
        unverified = [e.label for e in self.upstream if not e.is_maildir
                      and not (self.upstream_verify if e.verify is None else e.verify)
                      and (e.tls or self.upstream_tls) != "none"]
        if unverified:
            warnings.append(
                "upstream certificate verification is off (upstream_verify = false): anyone on "
                f"the path to {', '.join(unverified)} can read and change the mail and the "
                "AUTH password; use it in a lab only")
        in_clear = self.upstreams_with_clear_credentials
        if in_clear:
            warnings.append(
                f"upstream AUTH without TLS (upstream_tls = none) to {', '.join(in_clear)}: the "
                "password or OAuth2 token goes over the network in clear; set upstream_tls = "
                "starttls or tls")
        return warnings
