"""The relay's command line as a process: run a command to completion, start `serve`, wait for
its port, send it a message with smtplib."""

from __future__ import annotations

import os
import smtplib
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIG = REPO / "config" / "dedup-relay.example.toml"


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None,
            input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m relay ARGS` to completion (check-config and friends), ``input_text`` on
    its standard input."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "relay", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=60, check=False,
                          input=input_text)


def start_relay(cwd: Path, port: int, upstream: str, metrics: str = "off"
                ) -> subprocess.Popen[str]:
    """Start `python -m relay serve` on 127.0.0.1:``port`` (no RELAY_* env vars inherited)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    return subprocess.Popen(
        [sys.executable, "-m", "relay", "serve", "--listen", f"127.0.0.1:{port}",
         "--upstream", upstream, "--metrics-listen", metrics],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_port(port: int, proc: subprocess.Popen[str], timeout_s: float = 60.0) -> None:
    """Wait until something accepts on 127.0.0.1:port, failing if ``proc`` died first or
    ``timeout_s`` passed (generous: a loaded runner takes seconds to import the relay)."""
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
