"""The web console (design.md §6.9, docs/operating/console.md): its listener, who may sign in
(a ``user:hash:role`` file, read again on reload), its HTTPS certificate (its own, or the SMTP
listener's) and how long a session lasts; built into :class:`relay.console.server.Console`."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from relay.core.http_rules import is_loopback_host
from relay.settings.common import (
    FileCheck,
    SecretFile,
    Section,
    SettingsRuleError,
    host_port,
    split_host_port,
)

if TYPE_CHECKING:
    from relay.credentials import CredentialFile

CONSOLE_ROLES: tuple[str, ...] = ("viewer", "operator")
"""The console's roles: a viewer reads every page; an operator also releases and marks sent."""


def console_base_url(value: str) -> str:
    """``value`` as the console's base URL: ``http(s)://HOST[:PORT][/PATH]`` without a
    trailing slash, a query, a fragment or credentials. Raises ``ValueError`` naming what is
    wrong."""
    text = value.strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("console_url must be an http:// or https:// URL with a host, as "
                         f"people open the console, got {text!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("console_url takes no query, fragment or user: the console's own "
                         "address, e.g. https://relay-console.example.com")
    if any(ord(char) < 0x21 or ord(char) == 0x7F for char in text):
        raise ValueError("console_url holds a space or a control character")
    return text.rstrip("/")


class ConsoleSettings(Section):
    """The web console for support and compliance (off by default)."""

    TITLE: ClassVar[str] = "Console"
    LIVE: ClassVar[tuple[str, ...]] = ("console_auth_file", "console_tls_cert", "console_tls_key")
    FILES: ClassVar[tuple[str, ...]] = ("console_auth_file", "console_tls_cert",
                                        "console_tls_key")

    console_listen: str | None = Field(None, description=(
        "HOST:PORT of the web console (find a message by address, Message-ID, queue id or "
        "period, in-doubt review, stats, CSV export); unset or off: no console"))
    console_auth_file: Path | None = Field(None, description=(
        "user:hash:role lines (hash-password --role viewer, or --role operator) of who may "
        "sign in to the console; needed with console_listen"))
    console_tls_cert: Path | None = Field(None, description=(
        "PEM certificate chain of the console's HTTPS; unset: the listener's tls_cert when "
        "set, else plain HTTP (loopback only, unless console_plain_http)"))
    console_tls_key: Path | None = Field(None, description="PEM private key of console_tls_cert")
    console_plain_http: bool = Field(False, description=(
        "serve the console over plain HTTP on any address (behind a proxy that terminates "
        "TLS); passwords and session cookies then cross that hop in clear"))
    console_session_timeout: float = Field(default=1800.0, gt=0, le=43200, description=(
        "seconds a console session lasts without a request (at most 12 h); then sign in "
        "again"))
    console_url: str | None = Field(None, description=(
        "the console's external URL (https://relay-console.example.com, as people open it: "
        "behind a proxy, the proxy's); set, each message's decision log line carries its "
        "console page in the field console (URL/message/QUEUE_ID); unset: no link"))

    @field_validator("console_listen")
    @classmethod
    def _check_console_listen(cls, value: str | None) -> str | None:
        if value is None or value.lower() in ("", "off", "none"):
            return None
        split_host_port(value, what="console_listen")
        return value

    @field_validator("console_url")
    @classmethod
    def _check_console_url(cls, value: str | None) -> str | None:
        if value is None or value.strip() == "":
            return None
        return console_base_url(value)

    @model_validator(mode="after")
    def _check_console(self) -> ConsoleSettings:
        if (self.console_tls_cert is None) != (self.console_tls_key is None):
            raise SettingsRuleError("console_tls_cert and console_tls_key go together",
                                    "console_tls_cert", "console_tls_key")
        if self.console_plain_http and self.console_tls_cert is not None:
            raise SettingsRuleError(
                "console_plain_http and console_tls_cert contradict each other: the console "
                "serves either plain HTTP (behind a proxy that terminates TLS) or HTTPS",
                "console_plain_http", "console_tls_cert")
        if self.console_listen is None:
            return self
        if self.console_auth_file is None:
            raise SettingsRuleError(
                "console_listen needs console_auth_file (hash-password --role viewer or --role "
                "operator writes its lines): the console has no anonymous pages",
                "console_listen", "console_auth_file")
        return self

    @property
    def console_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of the console, None when there is none."""
        if self.console_listen is None:
            return None
        return split_host_port(self.console_listen, what="console_listen")

    @property
    def console_on_loopback(self) -> bool:
        """Whether the console listens on this host only (a loopback address)."""
        address = self.console_address
        return address is not None and is_loopback_host(address[0])

    @staticmethod
    def console_tls_context(pair: tuple[Path, Path] | None) -> ssl.SSLContext | None:
        """The console's HTTPS context for the (certificate, key) ``pair`` (TLS 1.2 at least,
        as the listener's), None for plain HTTP. Raises ConfigError when the pair does not
        load."""
        from relay.smtp.tls import server_context

        return None if pair is None else server_context(*pair, "TLSv1.2")

    def console_users(self) -> CredentialFile:
        """The console's users with their roles. Raises ConfigError (naming the line) as
        :meth:`relay.credentials.CredentialFile.load`. Blocking (~100 ms)."""
        from relay.credentials import CredentialFile

        assert self.console_auth_file is not None  # _check_console: needed with the listener
        return CredentialFile.load(self.console_auth_file, roles=CONSOLE_ROLES)

    def file_checks(self, *, live: bool) -> list[FileCheck]:
        """The console's users file (parsed, roles known) and its own certificate pair."""
        if self.console_listen is None:
            return []
        checks: list[FileCheck] = [(("console_auth_file",), self.console_users)]
        cert, key = self.console_tls_cert, self.console_tls_key
        if cert is not None and key is not None:
            checks.append((("console_tls_cert", "console_tls_key"),
                           lambda: self.console_tls_context((cert, key))))
        return checks

    def secret_files(self) -> list[SecretFile]:
        """The console's users file (password hashes) and its TLS private key."""
        if self.console_listen is None:
            return []
        return [(name, path) for name in ("console_auth_file", "console_tls_key")
                for path in [getattr(self, name)] if path is not None]

    def describe_console_check(self) -> str:
        """The console for check-config's line: ``, console HOST:PORT``, or nothing."""
        return "" if self.console_listen is None else f", console {self.console_listen}"

    def describe_console(self, port: int, *, tls: bool) -> str:
        """The console for the start-up line (``port``: the bound one, 0: off; ``tls``:
        served over HTTPS)."""
        address = self.console_address
        if address is None or not port:
            return "console off"
        return f"console {'https' if tls else 'http'}://{host_port(address[0], port)}/"
