"""Which process the pid file may name: ``dedup-relay serve`` by its program and command, never
a process whose command line merely mentions the relay's name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relay.ops.pidfile import is_serving_relay, serving_relay_argv
from tests.support.cli import run_cli

PY = "/srv/venv/bin/python3"


@pytest.mark.parametrize(("argv", "relay"), [
    (["/srv/venv/bin/dedup-relay", "serve", "--config", "/etc/r.toml"], True),
    ([PY, "/srv/venv/bin/dedup-relay", "serve"], True),
    ([PY, "-m", "relay", "serve", "--listen", "127.0.0.1:2525"], True),
    ([PY, "-X", "dev", "-u", "-m", "relay", "serve"], True),
    ([PY, "-mrelay", "serve"], True),
    (["dedup-relay: supervisor"], True),  # the supervisor's title (setproctitle)
    # a relay of one worker whose flags held a secret: its words in one string (setproctitle)
    ([f"{PY} -m relay serve --upstream-password ***"], True),
    (["/srv/venv/bin/dedup-relay serve --fingerprint-secret=***"], True),
    (["less /srv/venv/bin/dedup-relay serve"], False),
    (["dedup-relay: worker 0"], False),  # a worker: not what the pid file names
    (["tail", "-f", "dedup-relay: supervisor"], False),
    (["dedup-relay: supervisor x"], False),
    (["dedup-relay", "--version"], False),
    (["dedup-relay", "reload", "--pid-file", "/run/dedup-relay.pid"], False),
    ([PY, "-m", "relay", "history", "--rcpt", "a@b"], False),
    (["tail", "-f", "/var/log/dedup-relay.log"], False),
    (["less", "dedup-relay", "serve"], False),
    (["/builds/dedup-relay/.venv/bin/python", "-m", "pytest", "tests/system"], False),
    ([PY, "-c", "import relay; serve", "dedup-relay", "serve"], False),
    ([PY, "/opt/dedup-relay/tools/faultbench.py", "serve"], False),
    ([PY, "-m", "relayd", "serve"], False),
    ([], False),
])
def test_a_command_line_is_the_relay_only_by_its_program_and_command(argv: list[str],
                                                                     relay: bool) -> None:
    """The console script or ``python -m relay`` running ``serve`` is the relay; the name in
    any other argument (a log file, a folder, a script's path) is not."""
    assert serving_relay_argv(argv) is relay


def test_a_tail_of_the_relay_s_log_is_not_signalled_by_reload(tmp_path: Path) -> None:
    """A stale pid file naming `tail -f .../dedup-relay.log` is refused with exit 1 and the
    tail goes on running (SIGHUP would have ended it)."""
    log = tmp_path / "dedup-relay.log"
    log.write_text("")
    tail = subprocess.Popen(["tail", "-f", str(log)], stdout=subprocess.DEVNULL)
    try:
        pid_file = tmp_path / "dedup-relay.pid"
        pid_file.write_text(f"{tail.pid}\n")
        result = run_cli("reload", "--pid-file", str(pid_file), cwd=tmp_path)
        assert result.returncode == 1, result.stdout
        assert "not a dedup-relay process" in result.stderr
        assert tail.poll() is None
        assert is_serving_relay(tail.pid) is False
    finally:
        tail.kill()
        tail.wait()


def test_an_interpreter_in_a_folder_named_dedup_relay_is_not_the_relay(tmp_path: Path) -> None:
    """A Python process started from a clone named ``dedup-relay`` (its interpreter's path says
    so) is no relay: reload refuses it and it keeps running."""
    clone = tmp_path / "dedup-relay" / "bin"
    clone.mkdir(parents=True)
    python = clone / "python3"
    os.symlink(sys.executable, python)
    other = subprocess.Popen([str(python), "-c", "import time; time.sleep(30)", "dedup-relay"])
    try:
        result = run_cli("reload", "--pid", str(other.pid), cwd=tmp_path)
        assert result.returncode == 1
        assert "not a dedup-relay process" in result.stderr
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
