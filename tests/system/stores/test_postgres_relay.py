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
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from bench.faultbench.lib import _libfaketime
from relay.core.interfaces import State
from relay.store.postgres.store import PostgresStore
from tests.support.clients import message, send
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
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
        env={"PATH": "/usr/bin:/bin"})  # a supervisor and two workers start on a loaded runner
    assert done.returncode == 69, done.stderr
    assert "dedup-relay db upgrade" in done.stderr, done.stderr


def _on_database(url: str, database: str) -> str:
    """``url`` with its database path replaced by ``database`` (query parameters kept)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{database}"))


@pytest.mark.parametrize(("setting", "workers", "fault"), [
    ("--store", "1", "database"), ("--store", "2", "database"),
    ("--ledger", "1", "database"), ("--store", "1", "role")])
def test_serve_refuses_to_start_on_a_database_the_server_refuses(
        url: str, tmp_path: Path, setting: str, workers: str, fault: str) -> None:
    """A URL naming a database the server does not have (or a role it does not know): serve
    exits 69 with the server's words naming it, instead of answering every message 451."""
    missing = f"no_such_database_{uuid.uuid4().hex[:8]}"
    bad = (_on_database(url, missing) if fault == "database"
           else url.replace("postgres@", f"{missing}@", 1))
    store = ["--store", "sqlite:///dedup.db", "--ledger", bad] if setting == "--ledger" else [
        "--store", bad]
    done = subprocess.run(
        [sys.executable, "-m", "relay", "serve", "--listen", "127.0.0.1:0", *store,
         "--upstream", "maildir:mail", "--workers", workers, "--metrics-listen", "off"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
        env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 69, done.stderr
    word = "database" if fault == "database" else "role"
    assert f'{word} "{missing}" does not exist' in done.stderr, done.stderr
    assert ("the ledger's" if setting == "--ledger" else "the store's") in done.stderr


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
