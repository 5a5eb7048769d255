"""The Redis the tests share, and the type of the ``make_relay`` fixture.

The Redis used by most tests is ``RELAY_TEST_REDIS_URL`` (default redis://127.0.0.1:6379/0);
each relay gets its own random key prefix and its keys are deleted afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

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
        deadline = time.monotonic() + 10
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
