"""``count_states`` of each store (``dedup-relay stats``): records written through the store API
(and values the relay never writes, put there by hand) counted by state, what is in doubt and
since when; Redis by a bounded SCAN (its cap, its progress, every cluster primary), SQLite by
one query."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import uuid4

import pytest
import redis

from relay.core.errors import StoreError
from relay.core.interfaces import Settle, SettleOp, StateCounter, StateCounts
from relay.store.redis.counting import match_pattern
from relay.store.redis.store import RedisStore
from relay.store.sqlite.store import SqliteStore
from tests.support.redis_servers import Cluster, SentinelSet
from tests.support.relays import REDIS_URL

pytestmark = pytest.mark.timeout(60)

WINDOW_S = 3600.0
LEASE_S = 60.0
HOUR_MS = 3_600_000

Store = RedisStore | SqliteStore


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses, with glob characters (SCAN's MATCH must escape them)."""
    return f"test:stats:[{uuid4().hex}]*?:"


def _delete(prefix: str) -> None:
    """Delete the keys under ``prefix`` (its glob characters escaped, unlike delete_prefix)."""
    with redis.Redis.from_url(REDIS_URL) as client:
        keys = list(client.scan_iter(match=match_pattern(prefix), count=1000))
        if keys:
            client.delete(*keys)


def _other(prefix: str) -> str:
    """Another prefix, which starts like ``prefix`` but is not under it."""
    return prefix.rstrip(":") + "-other:"


def _url(request: pytest.FixtureRequest, kind: str) -> str:
    if kind in ("cluster", "sentinel"):
        servers: Cluster | SentinelSet = request.getfixturevalue(kind)
        return servers.url
    return REDIS_URL


@pytest.fixture(params=["redis", "sqlite"])
async def store(request: pytest.FixtureRequest, prefix: str, tmp_path: Path
                ) -> AsyncIterator[Store]:
    """Redis (keys under ``prefix`` deleted afterwards) and SQLite in turn."""
    if request.param == "sqlite":
        sqlite_store = await SqliteStore.open(str(tmp_path / "store.db"))
        yield sqlite_store
        await sqlite_store.close()
        return
    redis_store = RedisStore.from_url(REDIS_URL, window_s=WINDOW_S)
    yield redis_store
    await redis_store.close()
    _delete(prefix)
    _delete(_other(prefix))


async def _write(store: Store, key: str, action: Settle | None, *,
                 lease_s: float = LEASE_S) -> None:
    """Leave ``key`` PENDING (``action`` None) or settled by ``action``, via the store API."""
    token = uuid4().hex
    assert (await store.reserve([key], token=token, lease_s=LEASE_S))[0].reserved
    if action is not None:
        op = SettleOp(key, action, "250 ok", lease_s=lease_s if action is Settle.SENDING else 0)
        assert await store.settle([op], token=token, window_s=WINDOW_S) == [True]


def _put_raw(store: Store, key: str, redis_value: bytes, sqlite_row: tuple[object, ...],
             path: str = "", expires_in_ms: int = HOUR_MS) -> None:
    """Write a value by hand: ``redis_value`` on Redis, else the (state, token, at_ms,
    lease_ms) row, expiring ``expires_in_ms`` from now (SQLite: negative, already expired)."""
    if isinstance(store, RedisStore):
        with redis.Redis.from_url(REDIS_URL) as client:
            client.set(key, redis_value, px=expires_in_ms)
        return
    with sqlite3.connect(path) as conn:
        state, token, at_ms, lease_ms = sqlite_row
        conn.execute("INSERT INTO fingerprints (key, state, token, at_ms, expires_at_ms, "
                     "lease_ms) VALUES (?, ?, ?, ?, ?, ?)",
                     (key, state, token, at_ms, int(time.time() * 1000) + expires_in_ms,
                      lease_ms))


def _db(store: Store, tmp_path: Path) -> str:
    return str(tmp_path / "store.db") if isinstance(store, SqliteStore) else ""


async def test_every_state_is_counted_as_stored(store: Store, prefix: str) -> None:
    """One record of each state under the prefix and one under another prefix: the four states
    counted once each, nothing in doubt but the UNKNOWN one (the SENDING one is within its
    lease), which is also the oldest in doubt, by the store's clock."""
    assert isinstance(store, StateCounter)
    await _write(store, prefix + "p", None)
    await _write(store, prefix + "d", Settle.SENDING)
    await _write(store, prefix + "s", Settle.SENT)
    before = time.time()
    await _write(store, prefix + "u", Settle.UNKNOWN)
    await _write(store, _other(prefix) + "x", Settle.SENT)
    counts = await store.count_states(prefix, lease_s=LEASE_S, older_than_s=3600)
    assert (counts.pending, counts.sending, counts.sent, counts.unknown) == (1, 1, 1, 1)
    assert (counts.scanned, counts.complete, counts.foreign) == (4, True, 0)
    assert (counts.sending_past_lease, counts.in_doubt, counts.in_doubt_older) == (0, 1, 0)
    assert counts.oldest_in_doubt_at is not None and counts.oldest_in_doubt_age_s is not None
    assert before - 1 <= counts.oldest_in_doubt_at <= time.time() + 1
    assert 0 <= counts.oldest_in_doubt_age_s < 5


async def test_sending_past_its_lease_is_in_doubt(store: Store, prefix: str,
                                                  tmp_path: Path) -> None:
    """A SENDING record whose last heartbeat is older than its attempt's own lease (10 s, the
    heartbeat a minute old) stays ``sending`` in its count and is in doubt too; one within
    its lease is not; the reader's lease (an hour) judges neither. One of an earlier version,
    without a lease of its own, is judged by the reader's."""
    beat_ms = int(time.time() * 1000) - 60_000
    _put_raw(store, prefix + "stale", f"D|tok1|{beat_ms}|10000".encode(),
             ("sending", "tok1", beat_ms, 10_000), _db(store, tmp_path))
    _put_raw(store, prefix + "no-lease", f"D|tok2|{beat_ms}".encode(),
             ("sending", "tok2", beat_ms, None), _db(store, tmp_path))
    await _write(store, prefix + "live", Settle.SENDING, lease_s=LEASE_S)
    counts = await store.count_states(prefix, lease_s=3600, older_than_s=0)
    assert (counts.sending, counts.sending_past_lease, counts.in_doubt) == (3, 1, 1)
    assert counts.in_doubt_older == 1  # older_than 0: every record in doubt
    assert counts.oldest_in_doubt_at == pytest.approx(beat_ms / 1000, abs=0.002)
    by_short_lease = await store.count_states(prefix, lease_s=30, older_than_s=0)
    assert by_short_lease.sending_past_lease == 2


async def test_in_doubt_older_than_and_the_oldest(store: Store, prefix: str,
                                                  tmp_path: Path) -> None:
    """An UNKNOWN record two hours old (written by hand in the store's own format) and a fresh
    one: ``older_than`` one hour counts the old one only, and it is the oldest in doubt, two
    hours old."""
    now_ms = int(time.time() * 1000)
    old_ms = now_ms - 2 * HOUR_MS
    _put_raw(store, prefix + "old", f"U|{old_ms}".encode(), ("unknown", None, old_ms, None),
             _db(store, tmp_path))
    await _write(store, prefix + "new", Settle.UNKNOWN)
    counts = await store.count_states(prefix, lease_s=LEASE_S, older_than_s=3600)
    assert (counts.unknown, counts.in_doubt, counts.in_doubt_older) == (2, 2, 1)
    assert counts.oldest_in_doubt_at == pytest.approx(old_ms / 1000, abs=0.002)
    assert counts.oldest_in_doubt_age_s == pytest.approx(7200, abs=5)


async def test_values_the_relay_did_not_write_count_as_sent(store: Store, prefix: str,
                                                            tmp_path: Path) -> None:
    """Another application's value (Redis: ``1``, and a list; SQLite: a state of its own)
    counts as SENT, as a reserve reads it, and as foreign; the relay's own SENT does not."""
    _put_raw(store, prefix + "app", b"1", ("archived", None, None, None),
             _db(store, tmp_path))
    if isinstance(store, RedisStore):
        with redis.Redis.from_url(REDIS_URL) as client:
            client.rpush(prefix + "list", b"x")
    await _write(store, prefix + "own", Settle.SENT)
    counts = await store.count_states(prefix, lease_s=LEASE_S, older_than_s=3600)
    foreign = 2 if isinstance(store, RedisStore) else 1
    assert (counts.sent, counts.foreign) == (foreign + 1, foreign)
    assert (counts.pending, counts.sending, counts.unknown, counts.in_doubt) == (0, 0, 0, 0)


async def test_an_expired_sqlite_row_is_not_counted(tmp_path: Path) -> None:
    """SQLite keeps an expired row until it is purged: it is absent for the relay, so for the
    count too."""
    store = await SqliteStore.open(str(tmp_path / "store.db"))
    try:
        _put_raw(store, "p:gone", b"", ("pending", "t", None, None), _db(store, tmp_path),
                 expires_in_ms=-1000)
        await _write(store, "p:kept", None)
        counts = await store.count_states("p:", lease_s=LEASE_S, older_than_s=0)
        assert (counts.pending, counts.scanned) == (1, 1)
    finally:
        await store.close()


async def test_the_redis_scan_stops_at_max_keys(prefix: str) -> None:
    """2500 keys: a cap of 1200 looks at exactly 1200 and says the count is not complete; the
    progress callback saw every batch (one pipeline each); no cap counts all 2500."""
    with redis.Redis.from_url(REDIS_URL) as client, client.pipeline(transaction=False) as pipe:
        for n in range(2500):
            pipe.set(f"{prefix}{n}", b"0", px=int(WINDOW_S * 1000))
        pipe.execute()
    store = RedisStore.from_url(REDIS_URL, window_s=WINDOW_S)
    try:
        seen: list[int] = []
        capped = await store.count_states(prefix, lease_s=LEASE_S, older_than_s=0,
                                          max_keys=1200, progress=seen.append)
        assert (capped.scanned, capped.sent, capped.complete) == (1200, 1200, False)
        assert seen == sorted(seen) and seen[-1] == 1200 and len(seen) >= 2
        full = await store.count_states(prefix, lease_s=LEASE_S, older_than_s=0,
                                        max_keys=2500)
        assert (full.scanned, full.sent, full.complete) == (2500, 2500, True)
    finally:
        await store.close()
        _delete(prefix)


async def test_a_redis_that_does_not_answer_raises_store_error() -> None:
    """Nothing listens: StoreError naming the operation, within the op timeout."""
    store = RedisStore.from_url("redis://127.0.0.1:1/0", op_timeout_s=0.5)
    try:
        with pytest.raises(StoreError) as caught:
            await store.count_states("p:", lease_s=LEASE_S, older_than_s=0)
        assert caught.value.op == "count_states"
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["cluster", "sentinel"])
async def test_a_cluster_is_counted_on_every_primary_and_sentinel_on_its_master(
        request: pytest.FixtureRequest, kind: str, prefix: str) -> None:
    """60 records in every state over a cluster's three primaries (keys spread by slot), or
    on a Sentinel-managed master, and a list (another type, read as SENT): all counted."""
    store = RedisStore.from_url(_url(request, kind), window_s=WINDOW_S)
    try:
        actions = [None, Settle.SENDING, Settle.SENT, Settle.UNKNOWN]
        for n in range(60):
            await _write(store, f"{prefix}{n}", actions[n % 4])
        if kind == "cluster":
            port = request.getfixturevalue("cluster").nodes[0].port
            with redis.RedisCluster(host="127.0.0.1", port=port) as client:
                client.rpush(prefix + "list", b"x")
        else:
            port = request.getfixturevalue("sentinel").master_port()
            with redis.Redis(port=port) as plain:
                plain.rpush(prefix + "list", b"x")
        counts = await store.count_states(prefix, lease_s=LEASE_S, older_than_s=3600)
        assert (counts.pending, counts.sending, counts.sent, counts.unknown) == (15, 15, 16, 15)
        assert (counts.scanned, counts.complete, counts.in_doubt, counts.foreign) == (
            61, True, 15, 1)
        if kind == "cluster":  # the keys did spread over the three primaries
            cluster: Cluster = request.getfixturevalue("cluster")
            masters = cluster.masters()
            assert len({cluster.master_of(f"{prefix}{n}", masters) for n in range(60)}) == 3
    finally:
        await store.close()


def test_state_counts_in_doubt_is_unknown_plus_sending_past_its_lease() -> None:
    """The figure the JSON's ``in_doubt`` reports."""
    assert StateCounts(unknown=2, sending=5, sending_past_lease=3).in_doubt == 5



async def test_a_large_sqlite_count_is_not_cut_by_the_store_timeout(tmp_path: Path) -> None:
    """200000 rows, counted by a store whose op timeout (0.05 s) is far shorter than a read of
    every row: the count is bounded apart (an admin command's query, not a relay's call)."""
    path = str(tmp_path / "store.db")
    await (await SqliteStore.open(path)).close()
    expires = int(time.time() * 1000) + HOUR_MS
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO fingerprints (key, state, at_ms, expires_at_ms) VALUES (?, ?, ?, ?)",
            ((f"p:{n:064x}", "sent", expires - HOUR_MS, expires) for n in range(200_000)))
    store = await SqliteStore.open(path, op_timeout_s=0.05)
    try:
        counts = await store.count_states("p:", lease_s=LEASE_S, older_than_s=0)
        assert (counts.sent, counts.scanned) == (200_000, 200_000)
    finally:
        await store.close()
