"""A relay on the PostgreSQL store, as real `serve` processes: it refuses to start on a missing
schema (naming `dedup-relay db upgrade`), and once the schema is there it relays a message and
suppresses its duplicate, with a wall clock an hour ahead (libfaketime) changing nothing.

The server is ``RELAY_TEST_POSTGRES_URL``'s, each test in a private schema
(tests/support/postgres.py); a server that does not answer fails the test.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.core.interfaces import State
from relay.store.postgres.store import PostgresStore
from tests.support.clients import message, send
from tests.support.faultbench_lib import _libfaketime
from tests.support.postgres import private_schema
from tests.support.relays import start_serve
from tests.support.sink import start_sink

RCPT = "user@example.net"


@pytest.fixture
def empty_url() -> Iterator[str]:
    """A private schema with no table in it."""
    with private_schema(upgraded=False) as url:
        yield url


@pytest.fixture
def url() -> Iterator[str]:
    """A private schema holding the store's current tables."""
    with private_schema() as url:
        yield url


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_refuses_to_start_on_a_missing_schema(
        empty_url: str, tmp_path: Path, workers: str) -> None:
    """No schema: serve (one process, or a supervisor and its workers) exits 69
    (EX_UNAVAILABLE: the database is not ready) with a message naming `db upgrade`."""
    done = subprocess.run(
        [sys.executable, "-m", "relay", "serve", "--listen", "127.0.0.1:0", "--store",
         empty_url, "--upstream", "maildir:mail", "--workers", workers,
         "--metrics-listen", "off"],
        cwd=tmp_path, capture_output=True, text=True, timeout=30, check=False,
        env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 69, done.stderr
    assert "dedup-relay db upgrade" in done.stderr, done.stderr


async def test_a_relay_on_postgres_relays_once_and_suppresses_the_duplicate(
        url: str, tmp_path: Path) -> None:
    """Send, then the same message again: one copy upstream, both answered 250; the SENT
    record is dated by the database although the relay's clock is an hour ahead."""
    sink = await start_sink()
    env = {"LD_PRELOAD": _libfaketime(), "FAKETIME": "+1h"}
    relay = await start_serve(tmp_path, "--store", url, "--store-prefix", "t:",
                              "--upstream", f"127.0.0.1:{sink.port}", "--upstream-tls", "none",
                              workers=1, env=env)
    try:
        data = message(key="pg-1")
        first = await send(relay.port, [RCPT], data)
        second = await send(relay.port, [RCPT], data)
    finally:
        relay.stop()
        sink.server.close()
    assert (first.code, second.code) == (250, 250), (first, second)
    assert sink.handler.copies_to(RCPT) == 1
    store = await PostgresStore.open(url, cleanup_interval_s=None)
    try:
        conn_keys = await store._pool.fetch("SELECT key FROM dedup_relay_fingerprints")
        [key] = [row["key"] for row in conn_keys]
        record = await store.inspect(key)
    finally:
        await store.close()
    assert record.state is State.SENT and record.at is not None
    assert abs(record.at - time.time()) < 30, record
