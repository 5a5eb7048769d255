"""The start-up warning for smarthost credentials that would go over the network in clear:
AUTH configured, `upstream_tls = none`, a host that is not this machine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from relay.settings import is_loopback_host, load_settings


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("LOCALHOST.", True), ("mail.localhost", True),
    ("smtp.example.com", False), ("192.0.2.10", False), ("2001:db8::1", False),
    ("localhost.example.com", False), ("127.0.0.1.example.com", False)])
def test_a_host_is_this_machine_only_when_loopback(host: str, loopback: bool) -> None:
    """Loopback addresses and localhost names are this machine; any other name or address
    is not (RFC 6761 section 6.3)."""
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize(("overrides", "flagged"), [
    ({"upstream": "smtp.example.com:25", "upstream_user": "app"}, ["smtp.example.com:25"]),
    ({"upstream": "smtp.example.com:587", "upstream_auth": "xoauth2", "upstream_user": "m@x",
      "oauth_token_url": "https://login.example.com/token", "oauth_client_id": "id",
      "oauth_client_secret_file": "/run/secrets/oauth"},
     ["smtp.example.com:587"]),
    ({"upstream": "smtp.example.com:25"}, []),
    ({"upstream": "127.0.0.1:25", "upstream_user": "app"}, []),
    ({"upstream": "smtp.example.com:25", "upstream_user": "app", "upstream_tls": "starttls"}, []),
    ({"upstream": "smtp.example.com:465", "upstream_user": "app", "upstream_tls": "tls"}, []),
    ({"upstream": "localhost:25,relay.example.net:25", "upstream_user": "app"},
     ["relay.example.net:25"]),
])
def test_credentials_in_clear_are_found_per_upstream(overrides: dict[str, Any],
                                                     flagged: list[str]) -> None:
    """Each upstream that would get a password or a token without TLS, on a host that is not
    this machine, is named; one without AUTH, with TLS or on loopback is not."""
    settings = load_settings({"upstream_tls": "none", **overrides})
    assert settings.upstreams_with_clear_credentials == flagged


def _start_lines(tmp_path: Path, *flags: str) -> list[dict[str, Any]]:
    """The JSON log lines of a `serve` process up to and just after its listening line."""
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "--workers", "1", "--listen",
             "127.0.0.1:0", "--store", "sqlite:///dedup.db", "--metrics-listen", "off",
             "--log-format", "json", *flags], cwd=tmp_path, stdout=out, stderr=out,
            env={"PATH": "/usr/bin:/bin"})
    try:
        deadline = time.monotonic() + 30
        while "listening on" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def test_serve_warns_at_start_up_about_a_password_in_clear(tmp_path: Path) -> None:
    """serve with a password and upstream_tls = none to a name that is not this machine logs
    one WARNING naming that upstream (nothing is sent to it: .invalid never resolves)."""
    (tmp_path / "pw").write_text("secret\n")
    lines = _start_lines(tmp_path, "--upstream", "smtp.invalid:25", "--upstream-tls", "none",
                         "--upstream-user", "app", "--upstream-password-file",
                         str(tmp_path / "pw"))
    warned = [e for e in lines if "in clear" in str(e.get("message"))]
    assert len(warned) == 1, lines
    assert warned[0]["level"] == "WARNING"
    assert "smtp.invalid:25" in warned[0]["message"]
