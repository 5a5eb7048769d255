"""A relay started with a secret on its command line (``--upstream-password``,
``--fingerprint-secret``, a password in a URL) rewrites its command line: ``ps`` (every user's
``/proc/PID/cmdline``) shows the flags with ``***`` for their values, and ``reload`` still knows
the process for the relay."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relay.cli.options import scrubbed_argv
from relay.ops.pidfile import is_serving_relay
from tests.support.net import free_port
from tests.support.relays import start_serve

PY = "/srv/venv/bin/python3"


@pytest.mark.parametrize(("argv", "shown"), [
    ([PY, "-m", "relay", "serve", "--upstream-password", "hunter2", "--workers", "1"],
     [PY, "-m", "relay", "serve", "--upstream-password", "***", "--workers", "1"]),
    (["dedup-relay", "serve", "--fingerprint-secret=k3y", "--upstream", "a:25"],
     ["dedup-relay", "serve", "--fingerprint-secret=***", "--upstream", "a:25"]),
    (["dedup-relay", "serve", "--store", "redis://:pw@h:6379/0"],
     ["dedup-relay", "serve", "--store", "redis://:***@h:6379/0"]),
    (["dedup-relay", "serve", "--ledger=postgresql://u:pw@h/db"],
     ["dedup-relay", "serve", "--ledger=postgresql://u:***@h/db"]),
    (["dedup-relay", "serve", "--upstream", "a:25", "--store", "redis://h:6379/0"], None),
])
def test_the_command_line_shown_hides_each_secret(argv: list[str],
                                                   shown: list[str] | None) -> None:
    """Secret flags' values (either form) and URL passwords become ``***``; a command line
    without any is left as it is (None)."""
    assert scrubbed_argv(argv) == shown


async def test_a_relay_of_one_worker_keeps_its_password_out_of_ps(tmp_path: Path) -> None:
    """``serve --upstream-password ...``: the process's ``/proc/PID/cmdline`` holds the flag
    and ``***``, not the password; the pid file's check still takes it for the relay."""
    relay = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{free_port()}", "--metrics-listen", "off",
        "--store", f"sqlite:///{tmp_path}/store.db", "--upstream-user", "app",
        "--upstream-password", "hunter2-on-the-command-line", workers=1)
    try:
        shown = await asyncio.to_thread(Path(f"/proc/{relay.proc.pid}/cmdline").read_bytes)
        assert b"hunter2-on-the-command-line" not in shown
        assert b"--upstream-password ***" in shown
        assert is_serving_relay(relay.proc.pid) is True
    finally:
        relay.stop()
