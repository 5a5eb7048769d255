"""A private PostgreSQL schema per test module, on the server the tests use.

``RELAY_TEST_POSTGRES_URL`` (default ``postgresql://postgres@127.0.0.1:5432/postgres``) names
the server; :func:`private_schema` creates a schema ``t_<random hex>``, yields the URL whose
``search_path`` is that schema (every table the store or a migration makes goes there, so tests
run with ``-n 4`` never collide) and drops it with everything in it. A server that does not
answer fails the test (CI starts one: ``.ci/run``); it is never skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any
from uuid import uuid4

import asyncpg

from relay.store.postgres import migrations

POSTGRES_URL = os.environ.get("RELAY_TEST_POSTGRES_URL",
                              "postgresql://postgres@127.0.0.1:5432/postgres")


def schema_url(schema: str, base: str = POSTGRES_URL) -> str:
    """``base`` with ``search_path=schema`` (asyncpg passes it on as a server setting)."""
    return f"{base}{'&' if '?' in base else '?'}search_path={schema}"


async def _run(sql: str, url: str = POSTGRES_URL) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def upgrade_store(url: str) -> None:
    """Create the store's tables at ``url`` (what ``dedup-relay db upgrade`` does)."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await migrations.upgrade(conn, "store")
    finally:
        await conn.close()


def run_apart(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` to its end on a loop of its own in another thread (a fixture may be set up
    while the test's loop runs); its exception is raised here."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


@contextlib.contextmanager
def private_schema(*, upgraded: bool = True) -> Iterator[str]:
    """Yield the URL of a new empty schema (with the store's tables when ``upgraded``); drop
    it afterwards."""
    schema = f"t_{uuid4().hex}"
    run_apart(_run(f"CREATE SCHEMA {schema}"))
    url = schema_url(schema)
    try:
        if upgraded:
            run_apart(upgrade_store(url))
        yield url
    finally:
        run_apart(drop_schema(schema))


async def drop_schema(schema: str) -> None:
    """Drop ``schema`` with everything in it. A session still holding a lock on one of its
    tables once the test is over (a relay process a loaded runner has not finished stopping)
    is named on stderr and terminated after 10 s, instead of hanging the teardown."""
    conn = await asyncpg.connect(POSTGRES_URL, timeout=10)
    try:
        await conn.execute("SET lock_timeout = '10s'")
        for _ in range(5):
            try:
                await conn.execute(f"DROP SCHEMA {schema} CASCADE")
                return
            except asyncpg.LockNotAvailableError:
                holders = await conn.fetch(
                    "SELECT DISTINCT a.pid, a.application_name, a.state, left(a.query, 200) AS q"
                    " FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace"
                    " JOIN pg_stat_activity a ON a.pid = l.pid"
                    " WHERE n.nspname = $1 AND l.pid <> pg_backend_pid()", schema)
                for row in holders:
                    print(f"dropping {schema}: terminating session {dict(row)}", file=sys.stderr)
                    await conn.execute("SELECT pg_terminate_backend($1)", row["pid"])
        await conn.execute(f"DROP SCHEMA {schema} CASCADE")
    finally:
        await conn.close()


async def upgrade_ledger(url: str) -> None:
    """Create the audit ledger's table at ``url`` (what ``dedup-relay db upgrade --ledger``
    does)."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await migrations.upgrade(conn, "ledger")
    finally:
        await conn.close()


@contextlib.contextmanager
def ledger_schema(*, store: bool = False) -> Iterator[str]:
    """Yield the URL of a new private schema holding the ledger's table (and the store's
    with ``store``); drop it afterwards."""
    with private_schema(upgraded=store) as url:
        run_apart(upgrade_ledger(url))
        yield url


async def ledger_rows(url: str) -> list[dict[str, Any]]:
    """Every ledger row at ``url``, oldest first (as ``history`` orders them)."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        got = await conn.fetch(
            "SELECT * FROM dedup_relay_ledger ORDER BY decided_at, recorded_at")
    finally:
        await conn.close()
    return [dict(row) for row in got]


async def wait_ledger_rows(url: str, count: int,
                           timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The ledger's rows at ``url`` (oldest first) once there are at least ``count`` (the
    writer is asynchronous), or what there is after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await ledger_rows(url)
        if len(got) >= count or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def row_locks(url: str, keys: Sequence[str]) -> AsyncIterator[list[Any]]:
    """One open transaction per key at ``url``, each holding ``FOR UPDATE`` on that
    fingerprint row, taken in the order of ``keys``; yields the transactions (roll one back
    to free its row). Every connection is closed at the end."""
    conns: list[asyncpg.Connection] = []
    blocks: list[Any] = []
    try:
        for key in keys:
            conn = await asyncpg.connect(url, timeout=10)
            conns.append(conn)
            tx = conn.transaction()
            await tx.start()
            await conn.execute(
                "SELECT 1 FROM dedup_relay_fingerprints WHERE key = $1 FOR UPDATE", key)
            blocks.append(tx)
        yield blocks
    finally:
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.close()
