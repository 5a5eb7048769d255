"""Fixtures of the command-line tests: a `dedup-relay serve` process."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import start_relay, wait_for_port
from tests.support.net import free_port


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[int, int, subprocess.Popen[str]]]:
    """`dedup-relay serve` with the Maildir upstream and no --store (embedded SQLite)."""
    port, metrics_port = free_port(), free_port()
    proc = start_relay(tmp_path, port, f"maildir:{tmp_path / 'maildir'}",
                       f"127.0.0.1:{metrics_port}")
    try:
        wait_for_port(port, proc)
        yield port, metrics_port, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)  # waits, and closes the pipes (no ResourceWarning)
