"""A store's identity (FingerprintStore.identity): the same under every spelling of its URL,
another for other data; and the settle journal owed under it is paid by a relay that reaches
the store under another spelling (real Redis, SQLite file and PostgreSQL)."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import Settle, SettleOp, State
from relay.core.recipients import normalize_recipient
from relay.store.journal_file import add_to_journal
from relay.store.postgres.store import PostgresStore
from relay.store.redis.store import RedisStore
from relay.store.sqlite.store import SqliteStore
from tests.support.postgres import private_schema
from tests.support.relays import REDIS_URL, delete_prefix, start_serve
from tests.support.sink import Sink


async def _redis_identity(url: str) -> str:
    store = RedisStore.from_url(url, op_timeout_s=2.0)
    try:
        return await store.identity()
    finally:
        await store.close()


async def test_redis_spellings_of_one_database_share_an_identity() -> None:
    """127.0.0.1 and localhost, a path and a db= parameter: one identity; another database
    number: another."""
    one = await _redis_identity("redis://127.0.0.1:6379/0")
    assert one.startswith("redis:")
    assert await _redis_identity("redis://localhost:6379?db=0") == one
    assert await _redis_identity("redis://127.0.0.1:6379/0?socket_timeout=5") == one
    assert await _redis_identity("redis://127.0.0.1:6379/3") != one


async def test_a_sqlite_file_has_one_identity_under_any_path(tmp_path: Path) -> None:
    """The file reached through a symlink has the file's identity; another file another."""
    first = tmp_path / "a.db"
    stores = [await SqliteStore.open(str(first)),
              await SqliteStore.open(str(tmp_path / "b.db"))]
    try:
        os.symlink(first, tmp_path / "link.db")
        stores.append(await SqliteStore.open(str(tmp_path / "link.db")))
        ids = [await store.identity() for store in stores]
    finally:
        for store in stores:
            await store.close()
    assert ids[0].startswith("sqlite:")
    assert ids[2] == ids[0] != ids[1]


async def test_postgres_spellings_of_one_schema_share_an_identity() -> None:
    """127.0.0.1 and localhost reach one cluster, database and schema: one identity."""
    with private_schema() as url:
        parts = urlsplit(url)
        other = urlunsplit(parts._replace(netloc=parts.netloc.replace("127.0.0.1", "localhost")))
        assert other != url
        ids = []
        for spelling in (url, other):
            store = await PostgresStore.open(spelling, op_timeout_s=5.0, cleanup_interval_s=None)
            try:
                ids.append(await store.identity())
            finally:
                await store.close()
    assert ids[0].startswith("postgresql:")
    assert ids[0] == ids[1]


async def test_a_journal_owed_to_the_store_is_paid_under_another_spelling(
        tmp_path: Path, sink: Sink) -> None:
    """A SENT mark journaled under the store's identity (as a relay on
    redis://127.0.0.1:6379/0 writes it) is paid by a relay started on
    redis://localhost:6379?db=0: the record is SENT and the journal is gone."""
    assert REDIS_URL == "redis://127.0.0.1:6379/0"
    prefix = f"test:identity:{uuid.uuid4().hex}:"
    key = store_key(prefix, fingerprint(normalize_recipient("user@example.net"), "t", "K-1"))
    store = RedisStore.from_url(REDIS_URL, op_timeout_s=2.0)
    try:
        await store.reserve([key], token="t-1", lease_s=60.0)
        owner = f"{await store.identity()} prefix={prefix}"
    finally:
        await store.close()
    journal = tmp_path / "owed.jsonl"
    add_to_journal(journal, [("t-1", SettleOp(key=key, action=Settle.SENT, reply="250 ok"))],
                   owner)
    relay = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--store",
        "redis://localhost:6379?db=0", "--store-prefix", prefix, "--settle-journal",
        str(journal), "--metrics-listen", "off", workers=1)
    try:
        check = RedisStore.from_url(REDIS_URL, op_timeout_s=2.0)
        try:
            assert (await check.inspect(key)).state is State.SENT
        finally:
            await check.close()
        assert not journal.exists()
    finally:
        await asyncio.to_thread(relay.stop)
        delete_prefix(REDIS_URL, prefix)
