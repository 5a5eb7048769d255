"""The PostgreSQL store's rate limiter (relay/store/postgres/limits.py) beyond the contract of
tests/store/test_rate_limits.py: calls of two relays (two pools) racing on one bucket admit
exactly the limit, calls naming the same buckets in opposite orders never deadlock, a call that
times out takes nothing whether its statement runs after the timeout or reaches the database
only after the give-back, the window is the database's clock (a process an hour ahead counts in
the same window), a session that is not READ COMMITTED is refused rather than over-admitting,
and the cleanup deletes expired rows in bounded batches.

Each test works in a private schema of the server at ``RELAY_TEST_POSTGRES_URL``
(tests/support/postgres.py); the late statement is made by a loopback TCP proxy in the test's
loop that holds one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from bench.faultbench.lib import _libfaketime
from relay.core.errors import StoreError
from relay.core.interfaces import LimitCheck
from relay.store.postgres.limits import bucket_name
from relay.store.postgres.migrations import RATE_LOCK_SPACE
from relay.store.postgres.store import PostgresStore
from tests.support.cli import REPO
from tests.support.postgres import private_schema
from tests.support.waiting import until

PREFIX = "t:"


def check(name: str, limit: int, per_s: float = 60.0, cost: int = 1) -> LimitCheck:
    return LimitCheck(label=name, kind="messages", bucket=f"{name}:m:upstream:x", limit=limit,
                      per_s=per_s, cost=cost)


@pytest.fixture
def url() -> Iterator[str]:
    with private_schema() as url:
        yield url


@pytest.fixture
async def store(url: str) -> AsyncIterator[PostgresStore]:
    s = await PostgresStore.open(url, cleanup_interval_s=None, pool_size=4)
    yield s
    await s.close()


async def _fetchval(url: str, query: str, *args: object) -> object:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()


async def test_two_pools_racing_on_one_bucket_admit_exactly_the_limit(url: str) -> None:
    """Two stores (two relays: two pools of 5 connections) fire 60 calls at once on one
    bucket of 7: exactly 7 are allowed, and the table holds 7 units."""
    first = await PostgresStore.open(url, cleanup_interval_s=None, pool_size=5, op_timeout_s=10)
    second = await PostgresStore.open(url, cleanup_interval_s=None, pool_size=5,
                                      op_timeout_s=10)
    try:
        seven = check("race", 7)
        limiters = (first.rate_limiter(PREFIX), second.rate_limiter(PREFIX))
        for limiter in limiters:  # every connection open, so the calls start together
            await asyncio.gather(*(limiter.acquire([check(f"warm{n}", 100)])
                                   for n in range(5)))
        verdicts = await asyncio.gather(*(limiters[n % 2].acquire([seven]) for n in range(60)))
    finally:
        await first.close()
        await second.close()
    assert sum(v.allowed for v in verdicts) == 7
    assert all(v.refused == seven for v in verdicts if not v.allowed)
    units = await _fetchval(url, "SELECT sum(cost) FROM dedup_relay_rate_events "
                                 "WHERE bucket = $1", bucket_name(PREFIX, seven))
    assert units == 7


async def test_calls_naming_buckets_in_opposite_orders_never_deadlock(url: str) -> None:
    """40 calls at once, half naming (a, b), half (b, a), both of 10: none fails (a deadlock
    would fail one), exactly 10 are allowed, all or nothing."""
    first = await PostgresStore.open(url, cleanup_interval_s=None, pool_size=5, op_timeout_s=10)
    second = await PostgresStore.open(url, cleanup_interval_s=None, pool_size=5,
                                      op_timeout_s=10)
    try:
        a, b = check("alpha", 10), check("beta", 10)
        calls = [(first if n % 2 else second).rate_limiter(PREFIX).acquire(
            [a, b] if n % 4 < 2 else [b, a]) for n in range(40)]
        verdicts = await asyncio.gather(*calls)
    finally:
        await first.close()
        await second.close()
    assert sum(v.allowed for v in verdicts) == 10
    for bucket in (a, b):
        assert await _fetchval(url, "SELECT sum(cost) FROM dedup_relay_rate_events "
                                    "WHERE bucket = $1", bucket_name(PREFIX, bucket)) == 10


async def _waiting(conn: asyncpg.Connection, bucket: str, count: int) -> bool:
    """Whether ``count`` sessions wait for the lock of ``bucket`` (asked on ``conn``; other
    tests' buckets, on the same server, have other locks)."""
    return bool(await conn.fetchval(
        "SELECT count(*) = $3 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND classid = $1::bigint::oid AND objid = (hashtext($2)::bigint & 4294967295)::oid",
        RATE_LOCK_SPACE, bucket, count))


async def test_a_call_stuck_on_the_bucket_lock_ends_in_the_server_and_takes_nothing(
        url: str) -> None:
    """The bucket's lock is held elsewhere past the call's timeout (0.5 s) and its give-back's:
    the call fails (StoreError) and the sessions' statement_timeout (a bit under the op
    timeout: relay/store/postgres/calls.py) ends both statements in the server while the lock
    is still held, so no statement of a failed call is left to take its unit later (before
    the statement timeout, each waited there until the lock was free). After the lock is
    released nothing was counted, and the next call (limit 1) is allowed."""
    one = check("stuck", 1)
    store = await PostgresStore.open(url, cleanup_interval_s=None, pool_size=2,
                                     op_timeout_s=0.5)
    holder, watcher = await asyncpg.connect(url), await asyncpg.connect(url)
    try:
        limiter = store.rate_limiter(PREFIX)  # two connections ready: the give-back's is open
        await asyncio.gather(limiter.acquire([check("w1", 9)]), limiter.acquire([check("w2", 9)]))
        tx = holder.transaction()
        await tx.start()
        bucket = bucket_name(PREFIX, one)
        await holder.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))",
                             RATE_LOCK_SPACE, bucket)
        with pytest.raises(StoreError, match="rate_limit"):
            await limiter.acquire([one])
        await until(lambda: _waiting(watcher, bucket, 0), within_s=15.0,
                    what="no statement of the failed call waiting for the bucket's lock")
        await tx.rollback()
        assert await watcher.fetchval("SELECT count(*) FROM dedup_relay_rate_events "
                                      "WHERE bucket = $1", bucket) == 0
        assert (await limiter.acquire([one])).allowed
    finally:
        await holder.close()
        await watcher.close()
        await store.close()


async def _given_back(conn: asyncpg.Connection) -> bool:
    return bool(await conn.fetchval("SELECT count(*) = 1 FROM dedup_relay_rate_given_back"))


@dataclass
class HoldingProxy:
    """A TCP proxy on 127.0.0.1:``port`` to the test PostgreSQL. Armed, it holds the next
    request a client sends for ``hold_s`` seconds before forwarding it (with whatever the
    client sends after it, in order), also when the client has gone meanwhile: then it keeps
    the server's side open until the server answered (``late_answered`` set). With ``hang``
    it drops whatever any client sends from then on, the connections left open."""

    target: tuple[str, int]
    port: int = 0
    hold_s: float = 1.0
    armed: bool = False
    hang: bool = False  # forward nothing more from any client: a server that stopped answering
    late_answered: asyncio.Event = field(default_factory=asyncio.Event)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        held = asyncio.Event()
        self._spawn(self._down(up_reader, writer, held))
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                if self.hang:
                    continue
                if self.armed:
                    self.armed = False
                    await asyncio.sleep(self.hold_s)
                    held.set()
                up_writer.write(data)
                await up_writer.drain()
        if held.is_set():  # the client left after a held request: wait for its answer
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.late_answered.wait(), timeout=5.0)
        up_writer.close()
        writer.close()

    async def _down(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    held: asyncio.Event) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await src.read(65536):
                if held.is_set() and not self.late_answered.is_set():
                    self.late_answered.set()
                if not dst.is_closing():
                    dst.write(data)
                    with contextlib.suppress(OSError, ConnectionError):
                        await dst.drain()


def _through(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = f"{parts.username}@127.0.0.1:{port}" if parts.username else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


async def test_a_call_that_reaches_the_database_after_its_give_back_takes_nothing(
        url: str) -> None:
    """The path to PostgreSQL holds the call's request 4 s; the call (limit 1, timeout 1 s)
    fails and is given back on another connection at once (well before the request is let
    through, even on a loaded runner), leaving its tombstone. Then the request reaches the
    database and runs: it must take nothing, so the next call (the client's retry) is
    allowed."""
    parts = urlsplit(url)
    proxy = HoldingProxy((parts.hostname or "127.0.0.1", parts.port or 5432), hold_s=4.0)
    await proxy.start()
    store = await PostgresStore.open(_through(url, proxy.port), cleanup_interval_s=None,
                                     pool_size=2, op_timeout_s=1.0)
    try:
        one = check("held", 1)
        limiter = store.rate_limiter(PREFIX)
        warm = check("warm", 100)
        assert (await limiter.acquire([warm])).allowed  # the statement is prepared
        proxy.armed = True
        started = time.monotonic()
        with pytest.raises(StoreError, match=r"did not answer within 1 s"):
            await limiter.acquire([one])
        assert time.monotonic() - started < 3.0  # the give-back did not wait for the request
        assert await _fetchval(url, "SELECT count(*) FROM dedup_relay_rate_given_back") == 1
        await asyncio.wait_for(proxy.late_answered.wait(), timeout=30.0)  # the late call ran
        assert await _fetchval(url, "SELECT count(*) FROM dedup_relay_rate_events "
                                    "WHERE bucket = $1", bucket_name(PREFIX, one)) == 0
        assert (await limiter.acquire([one])).allowed
    finally:
        await store.close()
        await proxy.close()


async def test_a_database_that_stops_answering_fails_the_call_within_its_bounds(
        url: str) -> None:
    """The database stops answering mid-call (the proxy forwards nothing more, connections
    open): the call fails within its timeout plus its give-back's (1 s each; 2 s more
    allowed for a loaded runner's lag), although the give-back hangs too on a pooled
    connection. Neither connection is waited for."""
    parts = urlsplit(url)
    proxy = HoldingProxy((parts.hostname or "127.0.0.1", parts.port or 5432))
    await proxy.start()
    store = await PostgresStore.open(_through(url, proxy.port), cleanup_interval_s=None,
                                     pool_size=2, op_timeout_s=1.0)
    try:
        limiter = store.rate_limiter(PREFIX)
        # two connections open and idle in the pool: the give-back takes the second one
        await asyncio.gather(limiter.acquire([check("w1", 9)]), limiter.acquire([check("w2", 9)]))
        proxy.hang = True
        started = time.monotonic()
        with pytest.raises(StoreError, match="rate_limit"):
            await asyncio.wait_for(limiter.acquire([check("hung", 1)]), timeout=30.0)
        assert time.monotonic() - started < 2 * 1.0 + 2.0
    finally:
        proxy.hang = False
        await store.close()
        await proxy.close()


_UNDER_FAKETIME = """
import asyncio, sys
from relay.core.interfaces import LimitCheck
from relay.store.postgres.store import PostgresStore

async def main(url):
    store = await PostgresStore.open(url, cleanup_interval_s=None)
    check = LimitCheck("clock", "messages", "clock:m:upstream:x", 1, 600.0)
    assert (await store.rate_limiter("t:").acquire([check])).allowed
    await store.close()

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="libfaketime")
async def test_a_process_an_hour_ahead_counts_in_the_same_window(
        url: str, store: PostgresStore) -> None:
    """A process whose wall clock is an hour ahead (libfaketime) takes the one unit of a
    10-minute window: this process is refused, with the wait the database's clock gives
    (about 600 s, not 600 s minus an hour), and the row's time is the database's."""
    env = {"LD_PRELOAD": _libfaketime(), "FAKETIME": "+1h", "PATH": "/usr/bin:/bin"}
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", _UNDER_FAKETIME, url], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    refused = await store.rate_limiter(PREFIX).acquire([check("clock", 1, 600.0)])
    assert not refused.allowed and refused.retry_after_s is not None
    assert 570 < refused.retry_after_s <= 600, refused
    age = await _fetchval(url, "SELECT extract(epoch FROM now() - at)::float8 "
                               "FROM dedup_relay_rate_events")
    assert isinstance(age, float) and abs(age) < 30, age


async def test_a_session_not_read_committed_is_refused_not_over_admitted(url: str) -> None:
    """A database (or role) whose default isolation is REPEATABLE READ would read the window
    from a snapshot taken before the bucket's lock: the call fails (StoreError naming READ
    COMMITTED) and takes nothing."""
    store = await PostgresStore.open(f"{url}&default_transaction_isolation=repeatable%20read",
                                     cleanup_interval_s=None, pool_size=2)
    try:
        with pytest.raises(StoreError, match="READ COMMITTED"):
            await store.rate_limiter(PREFIX).acquire([check("iso", 5)])
    finally:
        await store.close()
    assert await _fetchval(url, "SELECT count(*) FROM dedup_relay_rate_events") == 0


async def test_the_cleanup_deletes_expired_limit_rows_in_bounded_batches(url: str) -> None:
    """25 expired rows of a bucket no call touches, 5 live ones, 7 old tombstones:
    ``delete_expired_limits(batch=10, max_batches=2)`` deletes 10 + 7, then 10, and stops;
    the cleanup task of an open store deletes the rest, never a live row."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "INSERT INTO dedup_relay_rate_events (bucket, at, cost, expires_at, call_id) "
            "SELECT 'gone', now() - interval '2 s', 1, now() - interval '1 s', 'c' || i "
            "FROM generate_series(1, 25) AS i")
        await conn.execute(
            "INSERT INTO dedup_relay_rate_events (bucket, at, cost, expires_at, call_id) "
            "SELECT 'live', now(), 1, now() + interval '1 hour', 'l' || i "
            "FROM generate_series(1, 5) AS i")
        await conn.execute(
            "INSERT INTO dedup_relay_rate_given_back (call_id, expires_at) "
            "SELECT 'x' || i, now() - interval '1 s' FROM generate_series(1, 7) AS i")
    finally:
        await conn.close()
    store = await PostgresStore.open(url, cleanup_interval_s=None)
    try:
        assert await store.delete_expired_limits(batch=10, max_batches=2) == 27
    finally:
        await store.close()
    assert await _fetchval(url, "SELECT count(*) FROM dedup_relay_rate_events") == 10
    running = await PostgresStore.open(url, cleanup_interval_s=0.1)
    try:
        await until(lambda: _events_are(url, 5), within_s=5.0, what="the cleanup task")
    finally:
        await running.close()
    assert await _fetchval(url, "SELECT count(*) FROM dedup_relay_rate_events "
                                "WHERE bucket = 'live'") == 5


async def _events_are(url: str, count: int) -> bool:
    return await _fetchval(url, "SELECT count(*) FROM dedup_relay_rate_events") == count
