"""Fixtures shared by every test folder (the parts they use live in tests/support/): a real
aiosmtpd sink as the upstream, a relay served in the test's loop, a private redis-server for
tests that must stop Redis. The session fails at once when the shared test Redis does not answer.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from relay.app import Relay
from relay.config import Settings
from tests.support.net import free_port
from tests.support.relays import REDIS_URL, MakeRelay, PrivateRedis, delete_prefix
from tests.support.sink import Sink, start_sink


@pytest.fixture
async def sink() -> AsyncIterator[Sink]:
    """A fresh upstream sink for one test."""
    s = await start_sink()
    yield s
    s.server.close()


@pytest.fixture
async def make_relay() -> AsyncIterator[MakeRelay]:
    """Factory: ``await make_relay(upstream="127.0.0.1:PORT", **settings)`` -> started Relay.

    Defaults: Redis store at REDIS_URL with a random key prefix, metrics off, short
    timeouts. Every relay is stopped and its keys deleted at the end of the test.
    """
    started: list[Relay] = []

    async def make(**overrides: Any) -> Relay:
        values: dict[str, Any] = {
            "listen": "127.0.0.1:0", "hostname": "relay.test", "store": REDIS_URL,
            "store_prefix": f"test:{uuid.uuid4().hex}:", "metrics_listen": None,
            "upstream_timeout": 5.0, "upstream_command_timeout": 5.0,
            "upstream_connect_timeout": 2.0, "lease": 30.0, "dedup_window": 3600.0,
            "shutdown_grace": 5.0,
            "settle_journal": str(Path(tempfile.gettempdir())
                                  / f"dedup-relay-test-{uuid.uuid4().hex}.jsonl"),
        }
        values.update(overrides)
        relay = Relay(Settings(**values))
        await relay.start()
        started.append(relay)
        return relay

    yield make
    for relay in started:
        await relay.stop()
        if relay.settings.store.startswith(("redis://", "rediss://")):  # not +cluster/+sentinel
            delete_prefix(relay.settings.store, relay.settings.store_prefix)


@pytest.fixture
async def relay(make_relay: MakeRelay, sink: Sink) -> Relay:
    """A relay in front of ``sink`` with the default test settings."""
    return await make_relay(upstream=f"127.0.0.1:{sink.port}")


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A started private redis-server; stopped at the end of the test whatever happened."""
    server = PrivateRedis(port=free_port())
    server.start()
    yield server
    server.stop()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fail loudly, once, when the test Redis does not answer."""
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping()
    except redis.RedisError as exc:
        raise pytest.UsageError(
            f"Redis at {REDIS_URL} does not answer ({exc}); start one or set "
            "RELAY_TEST_REDIS_URL (.ci/run does this)") from exc
