"""Who may use the listener and how: client networks, senders, connection limits, TLS
(STARTTLS, RFC 3207; implicit TLS, RFC 8314), AUTH (RFC 4954) and the PROXY protocol; built
into :class:`relay.smtp.handler.ListenerSecurity` and the AUTH users under the guess rule
(:class:`relay.credentials.Attempts`, which the composition root hands to the SMTP adapter's
SASL mechanisms, and the console's sign-in uses too). Who may connect and send, the AUTH users
and the certificate change live on reload."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Set
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from relay.settings.common import (
    CsvList,
    FileCheck,
    SecretFile,
    Section,
    SettingsRuleError,
    host_port,
    split_csv,
    split_host_port,
)

if TYPE_CHECKING:
    from relay.credentials import Attempts, CredentialFile
    from relay.smtp.handler import ListenerSecurity, RelayHandler


class AccessSettings(Section):
    """Client networks and senders, connection limits, TLS, AUTH and PROXY of the listener."""

    TITLE: ClassVar[str] = "Listener security"
    LIVE: ClassVar[tuple[str, ...]] = (
        "allowed_networks", "allowed_senders", "auth_file", "tls_cert", "tls_key")
    FILES: ClassVar[tuple[str, ...]] = ("tls_cert", "tls_key", "auth_file")

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
    # needs a restart, as proxy_protocol (not in LIVE): every listener reads it at start
    proxy_protocol_timeout: float = Field(default=10.0, gt=0, le=300, description=(
        "seconds (at most 300) a connection from a balancer has to send its PROXY header, "
        "then it is closed; one that closes first frees its slot at once"))

    @field_validator("allowed_networks", "proxy_networks", "allowed_senders", mode="before")
    @classmethod
    def _split_access_lists(cls, value: object) -> object:
        return split_csv(value)

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
            split_host_port(value, what="tls_listen")
        return value

    @model_validator(mode="after")
    def _check_security(self) -> AccessSettings:
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
        return self

    @property
    def tls_listen_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the implicit-TLS listener, None when there is none."""
        if self.tls_listen is None or self.tls_cert is None or self.tls_key is None:
            return None
        return split_host_port(self.tls_listen, what="tls-listen")

    def file_checks(self, *, live: bool) -> list[FileCheck]:
        """The TLS certificate and key (loaded as a pair) and the credentials file (parsed)."""
        from relay.credentials import CredentialFile
        from relay.smtp.tls import server_context

        checks: list[FileCheck] = []
        cert, key, auth_file = self.tls_cert, self.tls_key, self.auth_file
        if cert is not None and key is not None:
            checks.append((("tls_cert", "tls_key"),
                           lambda: server_context(cert, key, self.tls_min_version)))
        if auth_file is not None:
            checks.append((("auth_file",), lambda: CredentialFile.load(auth_file)))
        return checks

    def secret_files(self) -> list[SecretFile]:
        """The listener's TLS private key and the AUTH credentials file (password hashes)."""
        return [(name, path) for name in ("tls_key", "auth_file")
                for path in [getattr(self, name)] if path is not None]

    def restart_needed(self, new: AccessSettings) -> set[str]:
        """The live settings that need a restart going from these to ``new`` all the same:
        TLS or AUTH switched on or off (the listeners offer STARTTLS and AUTH as they
        started)."""
        switched = set()
        if (self.tls_cert is None) != (new.tls_cert is None):
            switched |= {"tls_cert", "tls_key"}
        if (self.auth_file is None) != (new.auth_file is None):
            switched.add("auth_file")
        return switched

    def security(self) -> ListenerSecurity:
        """Client networks, connection limits, TLS, AUTH and PROXY of the listener. Raises
        ConfigError when the certificate pair does not load."""
        from relay.smtp.access import ConnectionGate, parse_networks
        from relay.smtp.handler import ListenerSecurity
        from relay.smtp.tls import server_context

        tls_context = None
        if self.tls_cert is not None and self.tls_key is not None:
            tls_context = server_context(self.tls_cert, self.tls_key, self.tls_min_version)
        return ListenerSecurity(
            gate=ConnectionGate(allowed=parse_networks(self.allowed_networks),
                                max_total=self.max_connections,
                                max_per_ip=self.max_connections_per_ip),
            tls_context=tls_context, tls_required=self.tls_required,
            auth_enabled=self.auth_file is not None, auth_required=self.auth_required,
            proxy_networks=(parse_networks(self.proxy_networks) if self.proxy_protocol
                            else None),
            proxy_timeout_s=self.proxy_protocol_timeout,
        )

    def auth_users(self) -> CredentialFile | None:
        """The AUTH users (``auth_file`` loaded), None when AUTH is not configured. Raises
        ConfigError (naming the line) as :meth:`relay.credentials.CredentialFile.load`."""
        from relay.credentials import CredentialFile

        return None if self.auth_file is None else CredentialFile.load(self.auth_file)

    def auth_attempts(self, users: CredentialFile) -> Attempts:
        """Password attempts against ``users`` under the guess rule (``auth_failure_delay``,
        ``auth_max_failures`` within ``auth_failure_window``): SMTP AUTH's and the console's
        sign-in's."""
        from relay.credentials import Attempts

        return Attempts(credentials=users, failure_delay_s=self.auth_failure_delay,
                        max_failures=self.auth_max_failures,
                        failure_window_s=self.auth_failure_window)

    async def apply_access_live(self, applied: Set[str], *, security: ListenerSecurity,
                                auth_users: CredentialFile | None, handler: RelayHandler
                                ) -> None:
        """Apply the :attr:`LIVE` settings named in ``applied``: the AUTH users
        (``auth_users``: those in use, None when AUTH is off) from the next AUTH, the
        certificate (read again every time: a file replaced in place) from the next
        handshake, ``allowed_networks`` from the next connection, ``allowed_senders`` from the
        next MAIL. Raises ConfigError when a file does not load; then nothing was applied."""
        from relay.credentials import CredentialFile
        from relay.smtp.access import parse_networks
        from relay.smtp.tls import rotate_certificate

        credentials = None
        if auth_users is not None and self.auth_file is not None and "auth_file" in applied:
            credentials = await asyncio.to_thread(CredentialFile.load, self.auth_file)
        if security.tls_context is not None and self.tls_cert is not None \
                and self.tls_key is not None:
            rotate_certificate(security.tls_context, self.tls_cert, self.tls_key,
                               self.tls_min_version)
        if credentials is not None and auth_users is not None:
            auth_users.replace_with(credentials)
        if "allowed_networks" in applied:
            security.gate.set_allowed(parse_networks(self.allowed_networks))
        if "allowed_senders" in applied:
            handler.set_allowed_senders(self.allowed_senders)

    def describe_listeners(self, smtp: tuple[str, int], implicit_tls: tuple[str, int] | None
                           ) -> str:
        """The listeners for the start-up line: ``SMTP HOST:PORT (STARTTLS offered, AUTH after
        STARTTLS)`` and the implicit-TLS one, from the bound addresses."""
        auth = self.auth_file is not None
        smtp_mode = ["STARTTLS required" if self.tls_required else "STARTTLS offered"
                     ] if self.tls_cert is not None else ["plain, no TLS"]
        if auth:
            smtp_mode.append("AUTH required after STARTTLS" if self.auth_required
                             else "AUTH after STARTTLS")
        listeners = [f"SMTP {host_port(*smtp)} ({', '.join(smtp_mode)})"]
        if implicit_tls is not None:
            tls_auth = ("AUTH required" if self.auth_required else "AUTH on") if auth \
                else "no AUTH"
            listeners.append(f"implicit TLS {host_port(*implicit_tls)} ({tls_auth})")
        return ", ".join(listeners)
