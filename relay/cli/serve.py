"""``dedup-relay serve``, ``check-config`` and ``healthcheck``.

``serve`` and ``check-config`` take the same flags and run the same checks
(:func:`relay.settings.check_settings`: the settings, and every file they name) before ``serve``
opens the store and binds its listeners, so a configuration ``check-config`` approves does not
fail at start for a reason it could have seen.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from relay.cli.exit_codes import ExitCode, epilog
from relay.cli.options import SettingsCommand, fail, load, scrubbed_argv, settings_options
from relay.core.errors import ConfigError, StartupError
from relay.ops.logs import setup_logging
from relay.ops.tracing import check_tracing
from relay.settings import AdminSettings, Settings, check_settings, file_warnings, redact_url

if TYPE_CHECKING:
    from relay.reload import SettingsSource


def _checked(config_file: Path | None, flags: dict[str, Any]) -> Settings:
    """The settings, validated with every file they name, and the tracing the environment
    configures; exits 78 (EX_CONFIG) when not."""
    settings = load(config_file, flags)
    try:
        check_settings(settings)
        check_tracing(os.environ)  # the OTEL_* environment: its exporter importable
    except ConfigError as exc:
        fail(ExitCode.CONFIG, f"invalid configuration:\n{exc}")
    return settings


def register(main: click.Group) -> None:
    """Add ``serve``, ``check-config`` and ``healthcheck`` to the ``dedup-relay`` group."""

    @main.command(cls=SettingsCommand, epilog=epilog())
    @settings_options
    def serve(config_file: Path | None, **flags: Any) -> None:
        """Run the relay until SIGTERM/SIGINT (with --workers N > 1: N worker processes
        under a supervisor that forwards SIGTERM and SIGINT). SIGHUP reloads the
        configuration (see `dedup-relay reload`).

        Every setting is a flag, an env var RELAY_<NAME> and a key of the --config file;
        flags beat env vars, env vars beat the file. The tables [[template_policy]] and
        [[rate_limit]] have no flag: the config file (or their env var as a JSON array).
        """
        early: list[int] = []  # a SIGHUP before the event loop's handler: reloaded once served
        signal.signal(signal.SIGHUP, lambda sig, _: early.append(sig))
        _hide_secrets_from_ps()
        from relay.reload import SettingsSource
        from relay.supervision.loop import run_loop_for  # the loop settings.event_loop names

        settings = _checked(config_file, flags)
        setup_logging(settings.log_level, settings.log_format,
                      mask_addresses=not settings.log_recipients)
        source = SettingsSource(config_file, dict(flags))
        try:
            if settings.effective_workers == 1:  # one process, no supervisor
                run_loop_for(settings, _serve(settings, source, early))
            else:
                sys.exit(run_loop_for(settings, _supervise(settings, source, early)))
        except ConfigError as exc:  # found only when the store answered (a Redis db number)
            fail(ExitCode.CONFIG, f"invalid configuration:\n{exc}")
        except StartupError as exc:
            fail(ExitCode.UNAVAILABLE, f"cannot start: {exc}")

    @main.command("check-config", cls=SettingsCommand, epilog=epilog())
    @settings_options
    def check_config(config_file: Path | None, **flags: Any) -> None:
        """Check the settings as serve does before it starts: every value, and every file they
        name (TLS certificate and key, credentials, password file, CA files of the store URL,
        the settle journal's directory, the workers' refresh-token lock). Exit 0 when serve
        would start, 78 with one line per problem when not. Opens no store and binds no port.
        What serve would warn about at start (a secret file open to its group or others)
        is a `warning:` line on stderr."""
        from relay.supervision.loop import loop_factory

        settings = _checked(config_file, flags)
        for warning in file_warnings(settings):
            click.echo(f"dedup-relay: warning: {warning}", err=True)
        try:  # serve refuses to start (69) without the loop it must run on
            loop_factory(uvloop_wanted=settings.event_loop == "uvloop", required=True)
        except StartupError as exc:
            fail(ExitCode.CONFIG, f"invalid configuration:\nevent_loop: {exc}")
        click.echo(f"configuration ok: listen {settings.listen}, upstream "
                   f"{settings.upstream_summary}, store {redact_url(settings.store)}"
                   f"{settings.describe_ledger()}{settings.describe_reconcile()}"
                   f"{settings.describe_console_check()}")

    @main.command("healthcheck", cls=SettingsCommand, epilog=epilog())
    @click.option("--timeout", type=float, default=3.0, show_default=True, help="seconds")
    @settings_options
    def healthcheck(config_file: Path | None, timeout: float, **flags: Any) -> None:
        """Exit 0 when the relay on this host serves (container HEALTHCHECK), else 1.

        Asks /healthz on the metrics port; with metrics off, waits for the SMTP greeting.
        """
        settings = load(config_file, flags, base=AdminSettings)
        ok = _serving(settings, timeout)
        sys.exit(int(ExitCode.OK if ok else ExitCode.NOT_FOUND))


def _hide_secrets_from_ps() -> None:
    """Rewrite this process's command line (``/proc/PID/cmdline``, what ``ps`` shows every
    user of the host) without the secrets its flags carry (:func:`scrubbed_argv`): the
    words stay, the values are ``***``. A supervisor renames itself later; a relay of one
    worker keeps this line."""
    scrubbed = scrubbed_argv(sys.orig_argv)
    if scrubbed is not None:
        from setproctitle import setproctitle

        setproctitle(" ".join(scrubbed))


async def _serve(settings: Settings, source: SettingsSource, early: list[int]) -> None:
    """Serve in this process; SIGHUP reloads the configuration from ``source``; the pid file
    holds this process's id while it serves. ``early``: SIGHUPs that came before the event
    loop's handler (sent again once it is installed)."""
    from relay.app import Relay  # imported here: the admin commands need none of it
    from relay.ops.pidfile import remove_pid_file, write_pid_file
    from relay.reload import Reloader, relay_hangup
    from relay.serving import run

    pid_file = Path(settings.pid_file) if settings.pid_file else None

    def started(relay: Relay) -> None:
        if pid_file is None:
            return
        try:
            write_pid_file(pid_file)
        except OSError as exc:
            logging.getLogger("relay.cli").error(
                "cannot write the pid file %s: %s (`dedup-relay reload` needs --pid)",
                pid_file, exc)

    hangup = relay_hangup(Reloader(source, settings))  # the files as they are at start

    serving = asyncio.create_task(run(settings, started=started, hangup=hangup))
    await asyncio.sleep(0)  # run() installed its signal handlers: what came early, again
    for sig in early:
        os.kill(os.getpid(), sig)
    try:
        await serving
    finally:
        if pid_file is not None:
            remove_pid_file(pid_file)


async def _supervise(settings: Settings, source: SettingsSource, early: list[int]) -> int:
    from relay.supervision.supervisor import supervise

    supervising = asyncio.create_task(supervise(settings, source))
    await asyncio.sleep(0)  # its signal handlers are installed: what came early, again
    for sig in early:
        os.kill(os.getpid(), sig)
    return await supervising


def _serving(settings: Settings, timeout: float) -> bool:
    """True when the relay answers: ``/healthz`` 200, or an SMTP greeting with metrics off."""
    metrics = settings.metrics_address
    try:
        if metrics is not None:
            url = f"http://{_local(metrics[0])}:{metrics[1]}/healthz"
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                return bool(reply.status == 200)
        host, port = settings.listen_address
        with socket.create_connection((_local(host), port), timeout=timeout) as conn:
            # any greeting proves the process serves: a 421 is the allowed_networks
            # refusal when loopback is not among them, or a connection limit
            return conn.recv(4)[:3] in (b"220", b"421")
    except OSError as exc:
        fail(ExitCode.NOT_FOUND, f"not healthy: {exc}")


def _local(host: str) -> str:
    """Where to reach a listener bound to ``host`` from this host (a wildcard: loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)  # noqa: S104
