"""Records and ledger rows written before the content digest (design.md §2.2, §4.9): a SQLite
file of the earlier schema, a PostgreSQL store and ledger at their earlier schema versions
(upgraded by ``dedup-relay db upgrade``'s migrations and by the SQL script a DBA applies) and
Redis values of the earlier formats keep every record, read with no digest, and never count as
a key reused: a reserve of the same key for any content under ``key_reuse = relay`` finds them
as duplicates (or in doubt), never takes them over, and the core's rule says not reused."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import uuid4

import asyncpg
import pytest
import redis.asyncio

from relay.core.interfaces import FingerprintStore, Reservation, State
from relay.core.rules import Action, classify
from relay.store.postgres import migrations
from relay.store.postgres.store import PostgresStore
from relay.store.redis.store import RedisStore
from relay.store.sqlite.store import SqliteStore
from tests.support.postgres import private_schema

REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
LEASE_S = 60.0
DIGEST = "AbCdEf0123"

# the SQLite table as the relay before the content digest made it
_EARLIER_SQLITE = """
CREATE TABLE fingerprints (
    key TEXT PRIMARY KEY, state TEXT NOT NULL, token TEXT, at_ms INTEGER, reply TEXT,
    expires_at_ms INTEGER, lease_ms INTEGER, boot_id TEXT, beat_ms INTEGER
)
"""


async def _never_reused(store: FingerprintStore, keys: dict[str, State]) -> None:
    """Each of ``keys`` (key -> the state it was written in) is read with that state and no
    digest, and a reserve that would replace a record of other content leaves it alone."""
    for key, state in keys.items():
        record = await store.inspect(key)
        assert (record.state, record.content_digest) == (state, None), key
    found = await store.reserve(list(keys), token=uuid4().hex, lease_s=LEASE_S,
                                content_digest=DIGEST, replace_other_content=True)
    assert [r.reserved for r in found] == [False] * len(keys)
    for reservation in found:
        assert _not_reused(reservation), reservation
    for key, state in keys.items():
        assert (await store.inspect(key)).state is state


def _not_reused(reservation: Reservation) -> bool:
    """What the core makes of ``reservation`` under key_reuse = reject: never the 550 of a
    key reused."""
    decided = classify(reservation, unknown_policy="suppress", lease_s=LEASE_S,
                       content_digest=DIGEST, key_reuse="reject")
    return decided.action is Action.ANSWER and decided.verdict is not None \
        and not decided.verdict.reused


async def test_a_sqlite_file_of_the_earlier_schema_keeps_its_rows(tmp_path: Path) -> None:
    path = str(tmp_path / "earlier.db")
    now_ms = int(time.time() * 1000)
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(_EARLIER_SQLITE)
        conn.executemany("INSERT INTO fingerprints (key, state, at_ms, reply, expires_at_ms) "
                         "VALUES (?, ?, ?, ?, ?)",
                         [("k:sent", "sent", now_ms, "250 ok", now_ms + 3_600_000),
                          ("k:unknown", "unknown", now_ms, None, now_ms + 3_600_000)])
    store = await SqliteStore.open(path)
    try:
        await _never_reused(store, {"k:sent": State.SENT, "k:unknown": State.UNKNOWN})
    finally:
        await store.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM fingerprints").fetchone()[0] == 2
        columns = {row[1] for row in conn.execute("PRAGMA table_info(fingerprints)")}
    assert "content_digest" in columns


async def _at_version_2(url: str) -> None:
    """The store's steps 1 and 2 (a relay before the content digest) and two records."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(migrations._SCHEMA_TABLE_SQL)
        for step in migrations.STEPS["store"][:2]:
            await conn.execute(step)
        await conn.execute("INSERT INTO dedup_relay_schema VALUES ('store', 2)")
        await conn.execute(
            "INSERT INTO dedup_relay_fingerprints (key, state, at, reply, expires_at) VALUES "
            "('k:sent', 'sent', now(), '250 ok', now() + interval '1 hour'), "
            "('k:unknown', 'unknown', now(), NULL, now() + interval '1 hour')")
    finally:
        await conn.close()


@pytest.mark.parametrize("how", ["db-upgrade", "sql-script"])
async def test_a_postgres_store_at_version_2_keeps_its_rows_through_the_upgrade(
        how: str) -> None:
    with private_schema(upgraded=False) as url:
        await _at_version_2(url)
        conn = await asyncpg.connect(url)
        try:
            if how == "db-upgrade":
                assert await migrations.upgrade(conn, "store") == (2, migrations.latest("store"))
            else:
                await conn.execute(migrations.script("store"))
            assert await conn.fetchval("SELECT count(*) FROM dedup_relay_fingerprints") == 2
        finally:
            await conn.close()
        store = await PostgresStore.open(url, cleanup_interval_s=None)
        try:
            await _never_reused(store, {"k:sent": State.SENT, "k:unknown": State.UNKNOWN})
        finally:
            await store.close()


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    prefix = f"test:{uuid4().hex}:"
    yield prefix
    client = redis.asyncio.from_url(REDIS_URL)
    async for key in client.scan_iter(match=f"{prefix}*"):
        await client.delete(key)
    await client.aclose()


async def test_redis_values_of_the_earlier_formats_are_never_a_key_reused(
        redis_prefix: str) -> None:
    """``0``, ``S|<ms>|<reply>``, ``U|<ms>`` and a SENDING value past its lease, as earlier
    versions wrote them."""
    now_ms = int(time.time() * 1000)
    values = {"sent": ("0", State.SENT), "sent-dated": (f"S|{now_ms}|250 ok", State.SENT),
              "unknown": (f"U|{now_ms}", State.UNKNOWN),
              "sending": (f"D|{uuid4().hex}|{now_ms - 120_000}|60000", State.SENDING)}
    client = redis.asyncio.from_url(REDIS_URL)
    try:
        for name, (value, _) in values.items():
            await client.set(redis_prefix + name, value, px=3_600_000)
    finally:
        await client.aclose()
    store = RedisStore.from_url(REDIS_URL, window_s=3600.0)
    try:
        await _never_reused(store, {redis_prefix + name: state
                                    for name, (_, state) in values.items()})
    finally:
        await store.close()


@pytest.mark.parametrize("version", [1, 2, 3, 4])
async def test_a_ledger_at_an_older_version_keeps_its_rows(version: int) -> None:
    """The ledger's first ``version`` steps and a row; the upgrade (and the SQL script after
    it, which changes nothing) keeps the row, its key source empty, ``key_reused`` false and
    no recipient digest (the address is not in it to digest)."""
    with private_schema(upgraded=False) as url:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(migrations._SCHEMA_TABLE_SQL)
            for step in migrations.STEPS["ledger"][:version]:
                await conn.execute(step)
            await conn.execute("INSERT INTO dedup_relay_schema VALUES ('ledger', $1)", version)
            await conn.execute(
                "INSERT INTO dedup_relay_ledger (row_id, decided_at, action, outcome, "
                "store_key, recipient) VALUES (gen_random_uuid(), now(), 'relay', "
                "'suppressed', 'k:sent', 'j***@example.net')")
            assert await migrations.upgrade(conn, "ledger") == (
                version, migrations.latest("ledger"))
            await conn.execute(migrations.script("ledger"))
            rows = await conn.fetch(
                "SELECT outcome, recipient, key_source, key_reused, recipient_digest "
                "FROM dedup_relay_ledger")
        finally:
            await conn.close()
    assert [tuple(r) for r in rows] == [("suppressed", "j***@example.net", "", False, None)]


async def test_a_ledger_at_version_4_gets_the_reconcilers_looks() -> None:
    """A ledger at version 4 with an in-doubt row: the upgrade adds the reconciler's looks
    table; the row is listed in doubt with no look yet, and a look counted afterwards is
    read back with it."""
    from relay.store.postgres.ledger_read import LedgerReader

    with private_schema(upgraded=False) as url:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(migrations._SCHEMA_TABLE_SQL)
            for step in migrations.STEPS["ledger"][:4]:
                await conn.execute(step)
            await conn.execute("INSERT INTO dedup_relay_schema VALUES ('ledger', 4)")
            await conn.execute(
                "INSERT INTO dedup_relay_ledger (row_id, decided_at, action, outcome, "
                "store_key, recipient, message_id) VALUES (gen_random_uuid(), now(), "
                "'relay', 'unknown', 'k:doubt', 'j***@example.net', '<m@app.test>')")
            assert await migrations.upgrade(conn, "ledger") == (4, migrations.latest("ledger"))
        finally:
            await conn.close()
        async with await LedgerReader.open(url) as reader:
            [row] = await reader.to_reconcile(limit=10)
            assert (row.store_key, row.message_id, row.reconcile_looks) == (
                "k:doubt", "<m@app.test>", None)
            await reader.note_looks([(row, "wait: mx1 unknown")])
            await reader.note_looks([(row, "wait: mx1 unknown")])
            [looked] = await reader.in_doubt(older_than_s=0, limit=10)
            assert (looked.reconcile_looks, looked.reconcile_answer) == (2, "wait: mx1 unknown")
            assert await reader.last_look() is not None
