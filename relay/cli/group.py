"""Command line: ``dedup-relay serve``, ``check-config``, ``hash-password`` and the admin
commands of :mod:`relay.cli.admin` (``fingerprint``, ``inspect``, ``release``).

The click commands only turn flags into settings and call :func:`relay.app.run`; every flag
is also settable as an env var ``RELAY_<NAME>`` and as a key in the ``--config`` TOML file.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any, cast

import click

from relay import __version__
from relay.cli.admin import register as register_admin_commands
from relay.config import (
    DEFAULT_STORE_URL,
    AdminSettings,
    Settings,
    load_settings,
    redact_url,
    unknown_env_vars,
)
from relay.core.errors import ConfigError, StartupError
from relay.ops.logs import setup_logging

_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--listen", {"help": "SMTP listener HOST:PORT [127.0.0.1:2525]"}),
    ("--upstream", {"help": "smarthost HOST:PORT, or maildir:PATH for a local Maildir"}),
    ("--upstream-tls", {"type": click.Choice(["none", "starttls", "tls"]),
                        "help": "TLS to the smarthost [none]"}),
    ("--upstream-user", {"help": "AUTH user at the smarthost"}),
    ("--upstream-password-file", {"type": click.Path(dir_okay=False, path_type=Path),
                                  "help": "file holding the smarthost AUTH password"}),
    ("--store", {"help": "redis://, rediss://, redis+cluster://H:P,..., "
                         "redis+sentinel://H:P,.../SERVICE or sqlite:///PATH "
                         f"[{DEFAULT_STORE_URL}]"}),
    ("--metrics-listen", {"help": "metrics HTTP HOST:PORT, or 'off' [127.0.0.1:9725]"}),
    ("--upstream-timeout", {"type": float,
                            "help": "seconds to wait for the reply to the final dot [600]"}),
    ("--data-deadline", {"type": float,
                         "help": "seconds a client has from DATA's 354 to the final dot [600]"}),
    ("--dedup-window", {"type": float, "help": "seconds a sent fingerprint is kept [86400]"}),
    ("--lease", {"type": float, "help": "seconds a reservation lives without renewal (a "
                 "working attempt renews it every third) [900]"}),
    ("--log-format", {"type": click.Choice(["json", "text"]), "help": "log lines [json]"}),
    ("--shutdown-grace", {"type": float,
                          "help": "seconds in-flight messages get to finish on SIGTERM [30]"}),
    ("--tls-cert", {"type": click.Path(dir_okay=False, path_type=Path),
                    "help": "PEM certificate chain: enables STARTTLS"}),
    ("--tls-key", {"type": click.Path(dir_okay=False, path_type=Path),
                   "help": "PEM private key of --tls-cert"}),
    ("--tls-listen", {"help": "HOST:PORT of an implicit-TLS listener (port 465 style)"}),
    ("--auth-file", {"type": click.Path(dir_okay=False, path_type=Path),
                     "help": "user:hash lines (see hash-password); AUTH over TLS only"}),
    ("--allowed-networks", {"help": "client CIDRs, comma-separated [127.0.0.0/8,::1/128]"}),
]


def _settings_options(func: Any) -> Any:
    for flag, kwargs in reversed(_FLAGS):
        func = click.option(flag, default=None, **kwargs)(func)
    return click.option(
        "--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
        envvar="RELAY_CONFIG", default=None, help="TOML settings file (env RELAY_CONFIG)",
    )(func)


def _load(config_file: Path | None, flags: dict[str, Any], *,
          base: type[Settings] = Settings) -> Settings:
    for name in unknown_env_vars(os.environ):
        click.echo(f"dedup-relay: warning: {name} is not a setting and is ignored", err=True)
    try:
        return load_settings(flags, config_file, base=base)
    except ConfigError as exc:
        click.echo(f"dedup-relay: invalid configuration:\n{exc}", err=True)
        sys.exit(2)


@click.group()
@click.version_option(version=__version__, prog_name="dedup-relay")
def main() -> None:
    """dedup-relay: an SMTP relay that stops duplicate outbound email."""


@main.command()
@_settings_options
def serve(config_file: Path | None, **flags: Any) -> None:
    """Run the relay until SIGTERM/SIGINT."""
    settings = _load(config_file, flags)
    try:
        settings.upstream_password_value()  # the file is read now, not at the first message
    except ConfigError as exc:
        click.echo(f"dedup-relay: invalid configuration:\n{exc}", err=True)
        sys.exit(2)
    setup_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(_serve(settings))
    except StartupError as exc:
        click.echo(f"dedup-relay: cannot start: {exc}", err=True)
        sys.exit(2)


async def _serve(settings: Settings) -> None:
    from relay.app import run  # imported here so check-config stays light

    await run(settings)


register_admin_commands(main)


@main.command("hash-password")
@click.option("--user", required=True, help="the AUTH user name (for example app@example.com)")
@click.option("--scheme", type=click.Choice(["argon2", "bcrypt"]), default="argon2",
              show_default=True)
@click.option("--password-stdin", is_flag=True,
              help="read the password from standard input instead of prompting")
def hash_password_command(user: str, scheme: str, password_stdin: bool) -> None:
    """Print a `user:hash` line for --auth-file (the password never appears in argv)."""
    from relay.smtp.auth import Scheme, format_entry, hash_password

    if password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    if not password:
        click.echo("dedup-relay: an empty password is not allowed", err=True)
        sys.exit(2)
    try:
        click.echo(format_entry(user, hash_password(password, scheme=cast(Scheme, scheme))))
    except ValueError as exc:
        click.echo(f"dedup-relay: {exc}", err=True)
        sys.exit(2)


@main.command("healthcheck")
@click.option("--timeout", type=float, default=3.0, show_default=True, help="seconds")
@_settings_options
def healthcheck(config_file: Path | None, timeout: float, **flags: Any) -> None:
    """Exit 0 when the relay on this host serves (container HEALTHCHECK), else 1.

    Asks ``/healthz`` on the metrics port; with metrics off, waits for the SMTP greeting.
    """
    import socket
    import urllib.request

    settings = _load(config_file, flags, base=AdminSettings)
    metrics = settings.metrics_address
    try:
        if metrics is not None:
            url = f"http://{_local(metrics[0])}:{metrics[1]}/healthz"
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                ok = reply.status == 200
        else:
            host, port = settings.listen_address
            with socket.create_connection((_local(host), port), timeout=timeout) as conn:
                # any greeting proves the process serves: a 421 is the allowed_networks
                # refusal when loopback is not among them, or a connection limit
                ok = conn.recv(4)[:3] in (b"220", b"421")
    except OSError as exc:
        click.echo(f"dedup-relay: not healthy: {exc}", err=True)
        sys.exit(1)
    sys.exit(0 if ok else 1)


def _local(host: str) -> str:
    """Where to reach a listener bound to ``host`` from this host (a wildcard: loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)  # noqa: S104


@main.command("check-config")
@_settings_options
def check_config(config_file: Path | None, **flags: Any) -> None:
    """Validate the settings; exit 0 when valid, 2 with a readable message when not."""
    settings = _load(config_file, flags)
    try:
        settings.upstream_password_value()
    except ConfigError as exc:
        click.echo(f"dedup-relay: invalid configuration:\n{exc}", err=True)
        sys.exit(2)
    click.echo(f"configuration ok: listen {settings.listen}, upstream {settings.upstream}, "
               f"store {redact_url(settings.store)}")
