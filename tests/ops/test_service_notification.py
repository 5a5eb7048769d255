"""The relay speaks systemd's notification protocol (sd_notify(3)) and names its processes:
``READY=1`` once every worker serves (from the supervisor; with one process, from it),
``WATCHDOG=1`` every half of ``WATCHDOG_USEC``, ``STOPPING=1`` at the signal; the workers show
as ``dedup-relay: worker N`` and the supervisor as ``dedup-relay: supervisor`` in ps, and
``dedup-relay reload`` still knows the supervisor by its pid file. Real ``serve`` processes;
the notification socket is a datagram socket bound by the test."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.ops import notify
from tests.support.relays import REDIS_URL, start_serve
from tests.support.sink import Sink


def datagrams(sock: socket.socket, until: str, within_s: float = 20.0) -> list[str]:
    """Every notification received until one holding ``until`` (failing after ``within_s``)."""
    got: list[str] = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if until in got[-1]:
            return got
    raise AssertionError(f"no {until!r} in {got}")


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "notify.sock"))
        yield sock


def worker_titles(pid: int) -> list[str]:
    """The command lines of ``pid``'s children, sorted."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return sorted(cmdline(int(child)) for child in children)


def cmdline(pid: int) -> str:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return " ".join(a.decode() for a in raw.split(b"\0") if a)


async def test_ready_once_every_worker_serves_then_watchdog_then_stopping(
        tmp_path: Path, sink: Sink, notify_socket: socket.socket) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000"}
    relay = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--store", REDIS_URL,
        "--store-prefix", f"test:notify:{tmp_path.name}:", "--metrics-listen", "off",
        "--pid-file", str(tmp_path / "relay.pid"), workers=2, env=env)
    try:
        got = datagrams(notify_socket, "READY=1")
        assert len(relay.listening()) == 2  # both workers had logged their listening line
        assert "STATUS=serving with 2 workers" in got[-1]
        assert "WATCHDOG=1" in datagrams(notify_socket, "WATCHDOG=1", within_s=5.0)[-1]
        assert worker_titles(relay.proc.pid) == [
            "dedup-relay: worker 0", "dedup-relay: worker 1"]
        assert cmdline(relay.proc.pid) == "dedup-relay: supervisor"
        reload = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "relay", "reload", "--pid-file", str(tmp_path / "relay.pid")],
            capture_output=True, text=True, timeout=60, check=False)
        assert reload.returncode == 0, reload.stderr  # the renamed supervisor is the relay
        relay.proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in datagrams(notify_socket, "STOPPING=1")[-1]
    finally:
        relay.stop()


async def test_one_process_notifies_ready_and_stopping(
        tmp_path: Path, sink: Sink, notify_socket: socket.socket) -> None:
    relay = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--metrics-listen", "off",
        workers=1, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    try:
        assert "READY=1" in datagrams(notify_socket, "READY=1")[-1]
        relay.proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in datagrams(notify_socket, "STOPPING=1")[-1]
    finally:
        relay.stop()


def test_without_notify_socket_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify.notify("READY=1") is False


def test_the_watchdog_interval_is_half_of_watchdog_usec(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert notify.watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # another process's watchdog
    assert notify.watchdog_interval_s() is None
