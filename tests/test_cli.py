"""The command line as an operator runs it: a real `dedup-relay` process, real sockets."""

from __future__ import annotations

import os
import signal
import smtplib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_port, maildir_files, message

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_CONFIG = REPO / "config" / "dedup-relay.example.toml"


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """Run `python -m relay ARGS` to completion (check-config and friends)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "relay", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=60, check=False)


def start_relay(cwd: Path, port: int, upstream: str, metrics: str = "off"
                ) -> subprocess.Popen[str]:
    """Start `python -m relay serve` on 127.0.0.1:``port`` (no RELAY_* env vars inherited)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    return subprocess.Popen(
        [sys.executable, "-m", "relay", "serve", "--listen", f"127.0.0.1:{port}",
         "--upstream", upstream, "--metrics-listen", metrics],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_port(port: int, proc: subprocess.Popen[str], timeout_s: float = 15.0) -> None:
    """Wait until something accepts on 127.0.0.1:port, failing if ``proc`` died first."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"relay exited early: {proc.stderr.read() if proc.stderr else ''}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


def smtp_send(port: int, data: bytes, rcpt: str = "user@example.net") -> tuple[int, bytes]:
    """Send one message with smtplib and return the reply to the final dot."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        client.ehlo("client.test")
        client.mail("app@example.com")
        client.rcpt(rcpt)
        return client.data(data)


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
            proc.wait(timeout=30)


def test_serve_with_defaults_delivers_once(serve: tuple[int, int, subprocess.Popen[str]],
                                           tmp_path: Path) -> None:
    """`dedup-relay serve` with no --store uses the embedded SQLite file and dedups sends."""
    port, metrics_port, proc = serve
    first = smtp_send(port, message(key="CLI-1"))
    second = smtp_send(port, message(key="CLI-1"))
    assert first[0] == 250
    assert second[0] == 250 and b"suppressed" in second[1]
    files = maildir_files(tmp_path / "maildir")
    assert len(files) == 1
    assert b"Delivered-To: user@example.net\r\n" in files[0]
    assert b"X-Dedupe-Key: CLI-1" in files[0]
    assert (tmp_path / "data" / "dedup-relay.db").is_file()
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
    body = scrape.read().decode()
    assert 'relay_messages_total{result="relayed"} 1.0' in body
    assert 'relay_messages_total{result="suppressed"} 1.0' in body
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    log = proc.stderr.read() if proc.stderr else ""
    assert "embedded sqlite" in log
    assert "user@example.net" not in log  # recipients are masked in logs by default


def test_fingerprints_survive_a_restart(tmp_path: Path) -> None:
    """The embedded store is a file: after a restart the same message is still suppressed."""
    for expected_files in (1, 1):
        port = free_port()
        proc = start_relay(tmp_path, port, "maildir:md")
        try:
            wait_for_port(port, proc)
            assert smtp_send(port, message(key="RESTART-1"))[0] == 250
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        assert len(maildir_files(tmp_path / "md")) == expected_files


def test_check_config_accepts_the_example_file(tmp_path: Path) -> None:
    """The shipped example config is valid."""
    result = run_cli("check-config", "--config", str(EXAMPLE_CONFIG), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "configuration ok" in result.stdout


def test_check_config_rejects_a_lease_shorter_than_the_upstream_timeout(tmp_path: Path) -> None:
    """check-config exits 2 and names the setting when the lease cannot outlive a send."""
    result = run_cli("check-config", "--upstream", "127.0.0.1:25", "--lease", "60",
                     "--upstream-timeout", "600", cwd=tmp_path)
    assert result.returncode == 2
    assert "lease (60 s) must be longer than upstream-timeout (600 s)" in result.stderr


def test_check_config_requires_an_upstream(tmp_path: Path) -> None:
    """Without --upstream (or RELAY_UPSTREAM) check-config exits 2 saying upstream is missing."""
    result = run_cli("check-config", cwd=tmp_path)
    assert result.returncode == 2
    assert "upstream: Field required" in result.stderr


def test_env_vars_and_flags_priority(tmp_path: Path) -> None:
    """RELAY_ env vars are read, and a flag beats the env var."""
    env = {"RELAY_UPSTREAM": "maildir:from-env", "RELAY_STORE": "redis://127.0.0.1:6379/0"}
    by_env = run_cli("check-config", cwd=tmp_path, env=env)
    assert by_env.returncode == 0, by_env.stderr
    assert "upstream maildir:from-env" in by_env.stdout
    by_flag = run_cli("check-config", "--upstream", "maildir:from-flag", cwd=tmp_path, env=env)
    assert "upstream maildir:from-flag" in by_flag.stdout


def test_check_config_rejects_a_bad_store_url(tmp_path: Path) -> None:
    """A store URL of another scheme is refused with a readable message."""
    result = run_cli("check-config", "--upstream", "maildir:x", "--store", "mysql://h/db",
                     cwd=tmp_path)
    assert result.returncode == 2
    assert "store must be a redis://, rediss:// or sqlite:///path URL" in result.stderr
