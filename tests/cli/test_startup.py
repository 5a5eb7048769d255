"""What an operator sees when `dedup-relay serve` starts: one line naming every listener with
its TLS and AUTH, a WARNING when the smarthost's certificate is not verified, no aiosmtpd
warning per implicit-TLS session, and a port in use named by its setting (exit 69)."""

from __future__ import annotations

import os
import signal
import smtplib
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from relay.credentials import format_entry, hash_password
from tests.support.cli import run_cli, wait_for_port
from tests.support.net import free_port
from tests.support.pki import make_pki


def _serve(cwd: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    return subprocess.Popen([sys.executable, "-m", "relay", "serve", "--log-format", "text",
                             *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stopped(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, wait for exit 0, return the log."""
    proc.send_signal(signal.SIGTERM)
    _, log = proc.communicate(timeout=90)
    assert proc.returncode == 0, log
    return log


def test_the_start_up_line_names_every_listener_and_no_session_warns(tmp_path: Path) -> None:
    """STARTTLS port, implicit-TLS port (with their AUTH), upstream, store and metrics in one
    line; sessions on the implicit-TLS port with AUTH required log no aiosmtpd warning."""
    pki = make_pki(tmp_path)
    (tmp_path / "users").write_text(format_entry("app@example.com", hash_password("pw-1")) + "\n")
    (tmp_path / "users").chmod(0o600)  # a secret file as an operator keeps it
    port, tls_port, metrics_port = free_port(), free_port(), free_port()
    proc = _serve(tmp_path, "--upstream", "maildir:md", "--listen", f"127.0.0.1:{port}",
                  "--tls-listen", f"127.0.0.1:{tls_port}", "--metrics-listen",
                  f"127.0.0.1:{metrics_port}", "--tls-cert", str(pki.cert), "--tls-key",
                  str(pki.key), "--auth-file", "users", "--auth-required")
    try:
        wait_for_port(metrics_port, proc)  # bound last (a bare connect to the TLS port warns)
        for _ in range(3):
            with smtplib.SMTP_SSL("127.0.0.1", tls_port, context=pki.client_context,
                                  timeout=30) as client:
                client.login("app@example.com", "pw-1")
    finally:
        log = _stopped(proc)
    started = next(line for line in log.splitlines() if "listening on" in line)
    assert (f"listening on SMTP 127.0.0.1:{port} (STARTTLS offered, AUTH required after "
            f"STARTTLS), implicit TLS 127.0.0.1:{tls_port} (AUTH required); upstream "
            "maildir:md, store sqlite:///") in started
    assert f"(embedded sqlite), metrics 127.0.0.1:{metrics_port}, event loop uvloop" in started
    assert log.count("auth succeeded") == 3
    assert "auth_require_tls" not in log and "Requiring AUTH" not in log, log
    assert "WARNING" not in log, log


def test_a_plain_listener_and_an_unverified_smarthost_are_said(tmp_path: Path) -> None:
    """No TLS: the line says so; upstream_verify off with TLS to the smarthost: a WARNING."""
    port = free_port()
    proc = _serve(tmp_path, "--upstream", "127.0.0.1:1", "--upstream-tls", "starttls",
                  "--no-upstream-verify", "--listen", f"127.0.0.1:{port}", "--metrics-listen",
                  "off", "--event-loop", "asyncio")
    try:
        wait_for_port(port, proc)
    finally:
        log = _stopped(proc)
    assert (f"listening on SMTP 127.0.0.1:{port} (plain, no TLS); upstream 127.0.0.1:1 (tls "
            "starttls, unverified)") in log
    assert "metrics off, event loop asyncio" in log
    warning = next(line for line in log.splitlines() if "WARNING" in line)
    assert "upstream certificate verification is off" in warning


@pytest.mark.parametrize(("held", "flag"), [
    ("listen", "--listen, RELAY_LISTEN"),
    ("metrics_listen", "--metrics-listen, RELAY_METRICS_LISTEN"),
    ("tls_listen", "--tls-listen, RELAY_TLS_LISTEN"),
])
def test_a_port_in_use_names_its_setting_and_exits_69(
        tmp_path: Path, held: str, flag: str) -> None:
    """Another process holds one of the three ports: exit 69 (EX_UNAVAILABLE), one line
    naming the address and the setting, nothing left listening."""
    pki = make_pki(tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = f"127.0.0.1:{holder.getsockname()[1]}"
        ports = {name: busy if name == held else f"127.0.0.1:{free_port()}"
                 for name in ("listen", "metrics_listen", "tls_listen")}
        result = run_cli("serve", "--upstream", "maildir:md", "--listen", ports["listen"],
                         "--metrics-listen", ports["metrics_listen"], "--tls-listen",
                         ports["tls_listen"], "--tls-cert", str(pki.cert), "--tls-key",
                         str(pki.key), cwd=tmp_path)
    assert result.returncode == 69, result
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"dedup-relay: cannot start: cannot listen on {busy} for {held} "
                           f"({flag}"), line
    assert "already in use" in line and "Traceback" not in result.stderr


def test_a_listen_host_that_does_not_resolve_says_so_and_exits_69(tmp_path: Path) -> None:
    """A name the resolver does not know (``.invalid``, RFC 2606): exit 69 with a line that
    says the host did not resolve (it said "Unknown error -2")."""
    result = run_cli("serve", "--upstream", "maildir:md", "--metrics-listen", "off",
                     "--listen", "nosuchhost.invalid:2544", cwd=tmp_path)
    assert result.returncode == 69, result
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("dedup-relay: cannot start: cannot listen on nosuchhost.invalid:2544 "
                           "for listen (--listen, RELAY_LISTEN"), line
    assert "cannot resolve the host" in line and "Unknown error" not in line, line
