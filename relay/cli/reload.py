"""``dedup-relay reload``: send SIGHUP to the running relay, which reloads its configuration.

The process is ``--pid``, else the one whose id the relay's ``pid_file`` holds (read from the
relay's settings: ``--pid-file``, ``RELAY_PID_FILE``, ``--config``). The command cannot tell
whether the relay applied the new configuration: the relay logs it (``configuration
reloaded: ...`` or ``configuration reload refused: ...``) and counts it in
``relay_config_reloads_total{result}``. Exit codes: 0 sent; 1 no such relay (pid file missing
or stale, the process is gone or is not ``dedup-relay serve``: its program must be the
``dedup-relay`` script or ``python -m relay`` with the command ``serve``, never merely a
command line that mentions the name); 2 neither ``--pid`` nor a pid file given;
78 invalid configuration.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import click

from relay.cli.exit_codes import ExitCode, epilog
from relay.cli.options import config_option, fail, load
from relay.ops.pidfile import is_serving_relay, read_pid_file
from relay.settings import AdminSettings


def _pid_from_file(path: Path) -> int:
    """The pid the relay's pid file holds; exits 1 with a message when there is none."""
    try:
        return read_pid_file(path)
    except FileNotFoundError:
        fail(ExitCode.NOT_FOUND, f"no pid file {path} (pid_file): is the relay running, and "
                                 "started with this pid_file?")
    except (OSError, ValueError) as exc:
        fail(ExitCode.NOT_FOUND, f"cannot read a process id from the pid file {path}: {exc}")


def register(main: click.Group) -> None:
    """Add ``reload`` to the ``dedup-relay`` group."""

    @main.command("reload", epilog=epilog())
    @click.option("--pid", type=int, default=None,
                  help="process id of `dedup-relay serve` (instead of the pid file)")
    @click.option("--pid-file", default=None,
                  help="the relay's pid file [default: the pid_file setting; env: "
                       "RELAY_PID_FILE]")
    @config_option
    def reload(pid: int | None, pid_file: str | None, config_file: Path | None) -> None:
        """Send SIGHUP to the running relay: it reads its configuration again, applies what
        can change live (dedup policy, allowed networks and senders, AUTH users, TLS
        certificate, log level) and logs whether it did. Exit 0 when the signal was sent."""
        source = f"process {pid} (--pid)"
        if pid is None:
            settings = load(config_file, {"pid_file": pid_file}, base=AdminSettings)
            if not settings.pid_file:
                fail(ExitCode.USAGE, "no relay to signal: give --pid PID, or the relay's "
                                     "pid_file (--pid-file, RELAY_PID_FILE or --config)")
            path = Path(settings.pid_file)
            pid = _pid_from_file(path)
            source = f"process {pid} (pid file {path})"
        if pid <= 0:
            fail(ExitCode.USAGE, f"--pid {pid}: not a process id")
        running = is_serving_relay(pid)
        if running is False:
            gone = not Path(f"/proc/{pid}").exists()
            fail(ExitCode.NOT_FOUND, f"{source}: " + (
                "no such process (a stale pid file?)" if gone else "not a dedup-relay process"))
        try:
            os.kill(pid, signal.SIGHUP)
        except ProcessLookupError:
            fail(ExitCode.NOT_FOUND, f"{source}: no such process (a stale pid file?)")
        except PermissionError:
            fail(ExitCode.NOT_FOUND, f"{source}: not allowed to signal it (run as the relay's "
                                     "user)")
        click.echo(f"sent SIGHUP to {pid}; the relay logs whether it applied the configuration")
