"""The Redis the tests share, the type of the ``make_relay`` fixture, and `serve` as a process
(:func:`start_serve`, ``workers`` processes under a supervisor by default: 2).

The Redis used by most tests is ``RELAY_TEST_REDIS_URL`` (default redis://127.0.0.1:6379/0);
each relay gets its own random key prefix and its keys are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from relay.app import Relay

REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

MakeRelay = Callable[..., Awaitable[Relay]]


def delete_prefix(url: str, prefix: str) -> None:
    """Delete every Redis key under ``prefix`` (test clean-up)."""
    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=500))
        if keys:
            client.delete(*keys)
    except redis.ConnectionError:
        pass  # a private redis-server the test already stopped: nothing left to clean
    finally:
        client.close()


@dataclass
class PrivateRedis:
    """A redis-server process on a free loopback port, owned by one test."""

    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        pytest.fail(f"private redis-server on port {self.port} did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


_LISTENING = re.compile(r"SMTP \[?([0-9a-fA-F.:]+?)\]?:(\d+) ")
_SUPERVISOR_METRICS = re.compile(r"metrics \[?[0-9a-fA-F.:]+?\]?:(\d+)")


@dataclass
class ServeProcess:
    """A `python -m relay serve` process; its stderr (JSON lines) goes to ``log_path``."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    workers: int
    port: int = 0
    metrics_port: int | None = None
    prefix: str = ""  # the store key prefix, when the caller chose one

    def alive(self, pid: int) -> bool:
        """True while the process ``pid`` (a worker's) exists."""
        return Path(f"/proc/{pid}").exists()

    def children(self) -> list[int]:
        """The pids of this process's child processes (Linux ``/proc``)."""
        return [int(child) for task in Path(f"/proc/{self.proc.pid}/task").iterdir()
                for child in (task / "children").read_text().split()]

    def lines(self) -> list[dict[str, Any]]:
        """The JSON log lines written so far (other lines skipped)."""
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    found.append(entry)
        return found

    def listening(self) -> list[dict[str, Any]]:
        """The start-up lines ("listening on ..."), one per (re)started worker."""
        return [e for e in self.lines() if str(e.get("message", "")).startswith("listening on")]

    def worker_pids(self) -> dict[int, int]:
        """The pid of each worker index, the last started (workers > 1)."""
        return {int(e["worker"]): int(e["pid"]) for e in self.listening() if "worker" in e}

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send ``sig`` (unless it exited) and wait; SIGKILL past ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def _spawn_serve(cwd: Path, args: list[str], env: dict[str, str] | None, workers: int
                 ) -> ServeProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    if "--metrics-listen" not in args:
        # The default port (9725) is one per machine: tests run side by side take any free one.
        full_env["RELAY_METRICS_LISTEN"] = "127.0.0.1:0"
    full_env.update(env or {})
    log_path = cwd / f"serve-{uuid.uuid4().hex[:8]}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", *args], cwd=cwd, env=full_env,
            stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file)
    return ServeProcess(proc=proc, log_path=log_path, workers=workers)


async def start_serve(cwd: Path, *args: str, workers: int = 2,
                      env: dict[str, str] | None = None, within_s: float = 60.0
                      ) -> ServeProcess:
    """Start `python -m relay serve --workers N --listen 127.0.0.1:0 --log-format json ARGS`
    in ``cwd`` (no RELAY_* env vars inherited; ``env`` adds some; metrics on a free port
    unless ``--metrics-listen`` or ``env`` says otherwise) and wait until every worker
    logged its listening line; ``port`` is read from it, ``metrics_port`` from the
    supervisor's line (or the single process's) when metrics are on. Raises AssertionError
    when the process exits first or ``within_s`` passes."""
    served = _spawn_serve(cwd, [
        "--workers", str(workers), "--listen", "127.0.0.1:0", "--log-format", "json", *args],
        env, workers)
    proc = served.proc
    deadline = time.monotonic() + within_s
    def started() -> bool:
        supervisor = workers == 1 or any(
            str(e.get("message", "")).startswith("supervisor") for e in served.lines())
        return supervisor and len(served.listening()) >= workers

    while not started():
        if proc.poll() is not None or time.monotonic() > deadline:
            served.stop(signal.SIGKILL)
            raise AssertionError(f"serve did not start: {served.lines()}")
        await asyncio.sleep(0.05)
    first = served.listening()[0]
    match = _LISTENING.search(first["message"])
    assert match is not None, first
    served.port = int(match.group(2))
    for entry in served.lines():
        text = str(entry.get("message", ""))
        if text.startswith(("supervisor", "listening on")) and "worker" not in entry:
            found = _SUPERVISOR_METRICS.search(text)
            if found:
                served.metrics_port = int(found.group(1))
    return served
