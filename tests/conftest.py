"""Fixtures shared by every test folder (the parts they use live in tests/support/): a real
aiosmtpd sink as the upstream, a relay served in the test's loop, a private redis-server for
tests that must stop Redis. The session fails at once when the shared test Redis does not answer.

Event loop of the async tests: asyncio's, or uvloop's with ``RELAY_TEST_LOOP=uvloop``; a test
(class, module) marked ``both_loops`` runs once on each (ids ``asyncio`` and ``uvloop``).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import redis
import uvloop

from relay.app import Relay
from relay.settings import Settings
from tests.support.net import free_port
from tests.support.postgres import ledger_schema
from tests.support.relays import REDIS_URL, MakeRelay, PrivateRedis, delete_prefix
from tests.support.sink import Sink, start_sink

LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
TEST_LOOP = os.environ.get("RELAY_TEST_LOOP", "asyncio")


def pytest_configure(config: pytest.Config) -> None:
    """Register ``both_loops``; refuse an unknown ``RELAY_TEST_LOOP``; hand tests to the xdist
    workers one at a time (below); keep the bytecode of the processes the tests start."""
    config.addinivalue_line(
        "markers", "both_loops: the async test runs on asyncio's loop and on uvloop's")
    # pytest-xdist's load scheduling hands each worker a run of consecutive tests, up to an
    # eighth of those left: near the end one worker got most of tests/system/stores (fault
    # bench and nemesis runs, 10-70 s each) while the others ran out of work. One test at a
    # time (--maxschedchunk 1) keeps every worker busy to the end; a --maxschedchunk given
    # on the command line wins.
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1
    _bytecode_cache_for_subprocesses()


def _bytecode_cache_for_subprocesses() -> None:
    """With ``PYTHONDONTWRITEBYTECODE`` set, every relay process the tests start (hundreds:
    the CLI, `serve` and its workers, the bench's relays) compiled the relay's sources again:
    0.05-0.1 s of CPU each. The processes started from here (the xdist workers and theirs)
    keep their bytecode in a private cache instead (``PYTHONPYCACHEPREFIX``, under the temp
    directory), so the source tree still gets no ``__pycache__``. A prefix already chosen
    is kept."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and "PYTHONPYCACHEPREFIX" not in os.environ:
        cache = Path(tempfile.gettempdir()) / f"dedup-relay-tests-pycache-{os.getuid()}"
        os.environ["PYTHONPYCACHEPREFIX"] = str(cache)
        del os.environ["PYTHONDONTWRITEBYTECODE"]
    if TEST_LOOP not in LOOP_FACTORIES:
        raise pytest.UsageError(
            f"RELAY_TEST_LOOP={TEST_LOOP!r}: one of {', '.join(LOOP_FACTORIES)}")


def pytest_asyncio_loop_factories(
        config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """pytest-asyncio's hook: both loops for a ``both_loops`` test, else RELAY_TEST_LOOP's."""
    if item.get_closest_marker("both_loops") is not None:
        return LOOP_FACTORIES
    return {TEST_LOOP: LOOP_FACTORIES[TEST_LOOP]}


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
def ledger_url() -> Iterator[str]:
    """A private PostgreSQL schema holding the audit ledger's table (dropped afterwards)."""
    with ledger_schema() as url:
        yield url


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
