"""The rate limiters of every store, on a real Redis, a real SQLite file and a real
PostgreSQL (a private schema): the
sliding window (a burst of ``limit``, then room again as the oldest units leave the window),
all or nothing across the limits of one call, a recipients limit's cost, keys and rows that
expire, and times taken from the store's clock only. On the cluster fixture: one message's
buckets in one slot (the ``{rl}`` hash tag)."""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import redis

from relay.core.interfaces import LimitCheck, LimitVerdict, RateLimiter
from relay.store.postgres import limits as postgres_limits
from relay.store.postgres.store import PostgresStore
from relay.store.redis.limits import limit_key
from relay.store.redis.store import RedisStore
from relay.store.sqlite.store import SqliteStore
from tests.support.postgres import private_schema
from tests.support.redis_servers import Cluster
from tests.support.relays import REDIS_URL, delete_prefix
from tests.support.waiting import until


def check(bucket: str, limit: int, per_s: float, cost: int = 1,
          kind: str = "messages") -> LimitCheck:
    return LimitCheck(label=bucket, kind=kind, bucket=f"{bucket}:m:upstream:x", limit=limit,
                      per_s=per_s, cost=cost)


@dataclass
class Limiter:
    """A limiter under test: ``kind`` (redis, sqlite, postgres), its key ``prefix``, the
    SQLite file, the PostgreSQL store."""

    kind: str
    limiter: RateLimiter
    prefix: str
    path: Path | None = None
    postgres: PostgresStore | None = None


@pytest.fixture(params=["redis", "sqlite", "postgres"])
async def limiter(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Limiter]:
    """A limiter on the shared Redis (a fresh prefix), on a fresh SQLite file or in a private
    PostgreSQL schema."""
    prefix = f"test:{uuid.uuid4().hex}:"
    if request.param == "redis":
        store = RedisStore.from_url(REDIS_URL)
        yield Limiter("redis", store.rate_limiter(prefix), prefix)
        await store.close()
        delete_prefix(REDIS_URL, prefix)
    elif request.param == "sqlite":
        path = tmp_path / "relay.db"
        sqlite = await SqliteStore.open(str(path))
        yield Limiter("sqlite", sqlite.rate_limiter(prefix), prefix, path)
        await sqlite.close()
    else:
        with private_schema() as url:
            postgres = await PostgresStore.open(url, cleanup_interval_s=None)
            yield Limiter("postgres", postgres.rate_limiter(prefix), prefix, postgres=postgres)
            await postgres.close()


def sqlite_buckets(path: Path) -> list[str]:
    """The ``bucket`` of every row of ``rate_events`` in the file ``path``."""
    conn = sqlite3.connect(path)
    try:
        return [row[0] for row in conn.execute("SELECT bucket FROM rate_events")]
    finally:
        conn.close()


async def take(limiter: RateLimiter, *checks: LimitCheck) -> LimitVerdict:
    return await limiter.acquire(checks)


async def test_a_burst_of_the_limit_then_a_refusal_naming_the_wait(
        limiter: Limiter) -> None:
    lim = limiter.limiter
    five = check("burst", 5, 10.0)
    for _ in range(5):
        assert (await take(lim, five)).allowed
    refused = await take(lim, five)
    assert not refused.allowed and refused.refused == five
    assert refused.retry_after_s is not None and 9.0 < refused.retry_after_s <= 10.0


async def test_room_again_once_the_oldest_unit_left_the_window(
        limiter: Limiter) -> None:
    lim = limiter.limiter
    two = check("refill", 2, 0.6)
    started = time.monotonic()
    assert (await take(lim, two)).allowed
    assert (await take(lim, two)).allowed
    assert not (await take(lim, two)).allowed  # a refusal takes nothing

    async def room() -> bool:
        return (await take(lim, two)).allowed

    await until(room, within_s=3.0, what="room in the window")
    assert time.monotonic() - started >= 0.5  # not before the window passed


async def test_all_or_nothing_across_the_limits_of_one_call(
        limiter: Limiter) -> None:
    lim = limiter.limiter
    wide, narrow = check("wide", 3, 10.0), check("narrow", 1, 10.0)
    assert (await take(lim, wide, narrow)).allowed
    refused = await take(lim, wide, narrow)
    assert refused.refused == narrow
    refused = await take(lim, narrow, wide)  # the order does not matter
    assert refused.refused == narrow
    # the two refusals took nothing from ``wide``: it still has 2 of 3
    assert (await take(lim, wide)).allowed
    assert (await take(lim, wide)).allowed
    assert (await take(lim, wide)).refused == wide


async def test_a_recipients_limit_costs_the_recipient_count(
        limiter: Limiter) -> None:
    lim = limiter.limiter

    def rcpts(cost: int) -> LimitCheck:
        return check("rcpts", 10, 10.0, cost=cost, kind="recipients")

    assert (await take(lim, rcpts(4))).allowed
    assert (await take(lim, rcpts(4))).allowed
    over = await take(lim, rcpts(4))  # 12 > 10
    assert not over.allowed and over.retry_after_s is not None
    assert (await take(lim, rcpts(2))).allowed  # exactly 10
    never = await take(lim, rcpts(11))  # more than the limit alone: no wait helps
    assert not never.allowed and never.retry_after_s is None


async def test_units_that_left_the_window_are_given_back_whole(limiter: Limiter) -> None:
    """A bucket's total loses exactly what leaves the window: after 6 + 3 of 10 left, a call
    of 10 fits, and one more unit does not."""
    lim = limiter.limiter

    def rcpts(cost: int) -> LimitCheck:
        return check("giveback", 10, 0.4, cost=cost, kind="recipients")

    assert (await take(lim, rcpts(6))).allowed
    assert (await take(lim, rcpts(3))).allowed

    async def all_room() -> bool:
        return (await take(lim, rcpts(10))).allowed

    await until(all_room, within_s=3.0, what="the whole window's room")
    assert not (await take(lim, rcpts(1))).allowed


async def test_every_key_and_row_expires_with_its_window(limiter: Limiter) -> None:
    lim, prefix = limiter.limiter, limiter.prefix
    short = check("short", 5, 0.3)
    assert (await take(lim, short)).allowed
    if limiter.postgres is not None:
        await _postgres_rows_expire(limiter.postgres, prefix, short)
        return
    if limiter.path is None:
        client = redis.Redis.from_url(REDIS_URL)
        key = limit_key(prefix, short)
        assert 0 < client.pttl(key) <= 300
        assert 0 < client.pttl(f"{key}:n") <= 300  # the bucket's total
        assert key.startswith(f"{prefix}rl:{{rl}}:short:")
        assert "upstream:x" not in key  # the bucket's value is hashed
        await until(lambda: not client.exists(key, f"{key}:n"), within_s=3.0,
                    what="the keys' expiry")
        client.close()
        return
    path = limiter.path
    assert sqlite_buckets(path) == [f"{prefix}rl:short:m:upstream:x"]
    other = check("other", 50, 10.0)

    async def purged() -> bool:  # any later call deletes the rows past their window
        assert (await take(lim, other)).allowed
        return all(":short:" not in bucket for bucket in sqlite_buckets(path))

    await until(purged, within_s=3.0, what="the expired row's purge")


async def _postgres_rows_expire(store: PostgresStore, prefix: str, short: LimitCheck) -> None:
    """The row of ``short`` (a 300 ms window) names its bucket hashed and expires one window
    after the database's time of the call; once past it, the cleanup deletes it."""
    pool = store._pool
    [row] = await pool.fetch(
        "SELECT bucket, extract(epoch FROM expires_at - at)::float8 AS life, "
        "extract(epoch FROM now() - at)::float8 AS age FROM dedup_relay_rate_events")
    assert row["bucket"] == postgres_limits.bucket_name(prefix, short)
    assert row["bucket"].startswith(f"{prefix}rl:short:")
    assert "upstream:x" not in row["bucket"]  # the bucket's value is hashed
    assert abs(row["life"] - 0.3) < 1e-6 and abs(row["age"]) < 5, dict(row)

    async def purged() -> bool:  # the store's cleanup deletes the rows past their window
        await store.delete_expired_limits()
        return not await pool.fetchval("SELECT count(*) FROM dedup_relay_rate_events")

    await until(purged, within_s=3.0, what="the expired row's cleanup")


async def test_two_stores_on_one_sqlite_file_share_the_limits(tmp_path: Path) -> None:
    """Workers (or relays) that open one SQLite file count in one window."""
    path = str(tmp_path / "shared.db")
    first, second = await SqliteStore.open(path), await SqliteStore.open(path)
    try:
        two = check("shared", 2, 10.0)
        assert (await first.rate_limiter("p:").acquire([two])).allowed
        assert (await second.rate_limiter("p:").acquire([two])).allowed
        assert (await first.rate_limiter("p:").acquire([two])).refused == two
        assert (await second.rate_limiter("p:").acquire([two])).refused == two
        # another prefix (another relay's keyspace) counts apart
        assert (await second.rate_limiter("q:").acquire([two])).allowed
    finally:
        await first.close()
        await second.close()


async def test_redis_uses_the_server_clock_not_the_relays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay whose clock is a day off counts in the same window as the others: the scores
    are the Redis server's TIME."""
    prefix = f"test:{uuid.uuid4().hex}:"
    store = RedisStore.from_url(REDIS_URL)
    try:
        lim = store.rate_limiter(prefix)
        one = check("clock", 1, 10.0)
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() - 86400)
        assert (await take(lim, one)).allowed
        monkeypatch.setattr(time, "time", lambda: real_time() + 86400)
        assert not (await take(lim, one)).allowed
        monkeypatch.undo()
        client = redis.Redis.from_url(REDIS_URL)
        entries = cast(list[tuple[bytes, float]],
                       client.zrange(limit_key(prefix, one), 0, -1, withscores=True))
        [(_, score)] = entries
        server_s, micros = client.time()
        assert abs(score / 1000 - (server_s + micros / 1e6)) < 5
        client.close()
    finally:
        await store.close()
        delete_prefix(REDIS_URL, prefix)


async def test_one_messages_buckets_share_a_slot_on_a_cluster(cluster: Cluster) -> None:
    """Two buckets whose names hash to different slots are taken in one script (no CROSSSLOT),
    all or nothing as on one server."""
    store = RedisStore.from_url(cluster.url)
    try:
        lim = store.rate_limiter("test:rl:")
        a, b = check("alpha", 2, 10.0), check("beta", 1, 10.0)
        assert (await take(lim, a, b)).allowed
        assert (await take(lim, a, b)).refused == b
        assert (await take(lim, a)).allowed
        assert (await take(lim, a)).refused == a
    finally:
        await store.close()
