"""Fixtures of the operations tests: a `python -m relay serve` process with metrics on."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import start_relay, wait_for_port
from tests.support.metrics import ServedRelay
from tests.support.net import free_port


@pytest.fixture
def served_relay(tmp_path: Path) -> Iterator[ServedRelay]:
    """`python -m relay serve` with the Maildir upstream, the embedded SQLite store and
    metrics on a free loopback port; SIGTERM at the end."""
    port, metrics_port = free_port(), free_port()
    started_at = time.time()
    proc = start_relay(tmp_path, port, f"maildir:{tmp_path / 'maildir'}",
                       f"127.0.0.1:{metrics_port}")
    try:
        wait_for_port(port, proc)
        wait_for_port(metrics_port, proc)
        yield ServedRelay(port, metrics_port, proc, started_at)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)  # waits, and closes the stdout/stderr pipes
