"""One contract for every FingerprintStore (design.md §3), run against Redis, SQLite and
PostgreSQL.

The Redis store talks to the real server at ``RELAY_TEST_REDIS_URL`` (default
``redis://127.0.0.1:6379/0``); every test works under its own random key prefix and deletes its
keys afterwards. The contract also runs against a real Redis Cluster (three masters, three
replicas) and a Sentinel-managed master with a replica, private servers this module starts on
free loopback ports and stops at its end (``redis_servers.py``). Faults come from real fakes: a
closed port, and a tiny RESP server on port 0 that answers (or not) as the test chooses. The
SQLite store uses a file under ``tmp_path``. The PostgreSQL store uses the server at
``RELAY_TEST_POSTGRES_URL`` (tests/support/postgres.py), in a schema of this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import cast
from uuid import uuid4

import pytest
import redis.asyncio
from redis._parsers import _AsyncRESP3Parser

from relay.admin import mark_sent
from relay.core import rotation
from relay.core.errors import StoreError
from relay.core.interfaces import (
    FingerprintStore,
    Record,
    Reservation,
    Settle,
    SettleOp,
    State,
)
from relay.core.rotation import Claim
from relay.core.rules import reads_as, takes_over
from relay.store.postgres.store import PostgresStore
from relay.store.redis.scripts import decode_value
from relay.store.redis.store import RedisStore
from relay.store.sqlite.kind import sqlite_path_from_url
from relay.store.sqlite.store import SqliteStore
from tests.support.postgres import private_schema
from tests.support.redis_servers import Cluster, SentinelSet
from tests.support.sqlite_procs import hammering

REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
LEASE_S = 60.0
WINDOW_S = 3600.0
# redis-py's own RESP parser instead of hiredis for the single server (the hiredis package
# missing or broken on a host); tests/store/test_store_parsers.py sets it
PURE_PYTHON_PARSER = os.environ.get("RELAY_TEST_REDIS_PARSER") == "python"


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"test:{uuid4().hex}:"


@pytest.fixture
def db_path(tmp_path: Path) -> str:
    """The SQLite file of this test."""
    return str(tmp_path / "store.db")


@pytest.fixture(scope="module")
def hammered_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SQLite file that a second process writes (reserve, SENDING, SENT, release of its own
    keys) for as long as this module's tests use it; it must never see a StoreError."""
    path = str(tmp_path_factory.mktemp("hammered") / "store.db")
    with hammering(path):
        yield path


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A private, upgraded PostgreSQL schema for this module (``tests/support/postgres.py``);
    every test's keys are under its own prefix in it."""
    with private_schema() as url:
        yield url


OP_TIMEOUT_S = 10.0
"""The stores' op timeout in the contract tests: what they prove is no timing, and a loaded
runner (or the process hammering ``sqlite-2proc``'s file) makes a call take seconds."""


@pytest.fixture(params=["redis", "sqlite", "sqlite-2proc", "cluster", "sentinel", "postgres"])
async def store(
    request: pytest.FixtureRequest, prefix: str, db_path: str
) -> AsyncIterator[FingerprintStore]:
    """Each store in turn; Redis keys under ``prefix`` are deleted afterwards.

    The cluster and sentinel servers are private to this module: their keys go with them.
    ``sqlite-2proc`` is SQLite on a file another process writes at the same time.
    ``postgres`` is the PostgreSQL server of ``RELAY_TEST_POSTGRES_URL``, in a schema of this
    module's (dropped at its end).
    """
    if request.param == "postgres":
        pg_store = await PostgresStore.open(request.getfixturevalue("postgres_url"),
                                            op_timeout_s=OP_TIMEOUT_S, cleanup_interval_s=None)
        yield pg_store
        await pg_store.close()
        return
    if request.param.startswith("sqlite"):
        path = request.getfixturevalue("hammered_db") if request.param == "sqlite-2proc" \
            else db_path
        sqlite_store = await SqliteStore.open(path, op_timeout_s=OP_TIMEOUT_S)
        yield sqlite_store
        await sqlite_store.close()
        return
    if request.param in ("cluster", "sentinel"):
        servers: Cluster | SentinelSet = request.getfixturevalue(request.param)
        private_store = RedisStore.from_url(servers.url, op_timeout_s=OP_TIMEOUT_S,
                                            window_s=WINDOW_S)
        yield private_store
        await private_store.close()
        return
    redis_store = RedisStore.from_url(REDIS_URL, op_timeout_s=OP_TIMEOUT_S, window_s=WINDOW_S)
    if PURE_PYTHON_PARSER:  # tests/store/test_store_parsers.py runs the suite so
        await redis_store.close()
        redis_store = RedisStore(
            client=redis.asyncio.from_url(REDIS_URL, parser_class=_AsyncRESP3Parser),
            op_timeout_s=OP_TIMEOUT_S, window_s=WINDOW_S)
    yield redis_store
    await redis_store.close()
    client = redis.asyncio.from_url(REDIS_URL)
    async for key in client.scan_iter(match=f"{prefix}*"):
        await client.delete(key)
    await client.aclose()


def kept_reply(store: FingerprintStore, reply: str) -> str | None:
    """The reply text a SENT record gives back: none on Redis (the record is ``0`` or
    ``S|<ms>|``; the upstream's reply is in the relay's log line), the text on SQLite."""
    return None if isinstance(store, RedisStore) else reply


async def write_foreign(store: FingerprintStore, key: str, db_path: str) -> None:
    """Write what another application would: ``1`` in Redis, a row of unknown state in SQLite
    and PostgreSQL."""
    if isinstance(store, PostgresStore):
        await store._pool.execute(
            "INSERT INTO dedup_relay_fingerprints (key, state, expires_at) "
            "VALUES ($1, '1', 'infinity')", key)
        return
    if isinstance(store, RedisStore):
        # the store's own client reaches the right server whether single, cluster or sentinel
        await store._client.set(key, "1")
        return
    path = store._path if isinstance(store, SqliteStore) else db_path
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(
            "INSERT INTO fingerprints (key, state, token, at_ms, reply, expires_at_ms) "
            "VALUES (?, '1', NULL, NULL, NULL, NULL)",
            (key,),
        )


def new_token() -> str:
    """A fresh attempt token, as the core makes them (128 random bits, hex)."""
    return uuid4().hex


def dated_between(at: float | None, before: float, after: float) -> bool:
    """Whether a record's time ``at`` (unix seconds) lies between ``before`` and ``after``,
    this host's clock read around the call that wrote it, give or take 10 ms (a store keeps
    whole milliseconds). However long a loaded runner takes over the call, its time lies
    there."""
    return at is not None and before - 0.01 <= at <= after + 0.01


# ---------------------------------------------------------------------------------------------
# The contract: every store
# ---------------------------------------------------------------------------------------------


async def test_reserve_absent_key_creates_pending(store: FingerprintStore, prefix: str) -> None:
    """Reserving an absent key creates PENDING(token) with a TTL no longer than the lease."""
    key, token = prefix + "a", new_token()
    [reservation] = await store.reserve([key], token=token, lease_s=LEASE_S)
    assert reservation.key == key
    assert reservation.reserved
    assert reservation.found is None
    record = await store.inspect(key)
    assert record.state is State.PENDING
    assert record.token == token
    assert record.ttl_s is not None
    assert LEASE_S - 5 < record.ttl_s <= LEASE_S


async def test_second_reserve_finds_first_pending(store: FingerprintStore, prefix: str) -> None:
    """A reserve with another token is refused and reports the PENDING of the first token."""
    key, first, second = prefix + "a", new_token(), new_token()
    await store.reserve([key], token=first, lease_s=LEASE_S)
    [reservation] = await store.reserve([key], token=second, lease_s=LEASE_S)
    assert not reservation.reserved
    assert reservation.found is not None
    assert reservation.found.state is State.PENDING
    assert reservation.found.token == first
    assert reservation.found.ttl_s is not None
    assert reservation.found.ttl_s <= LEASE_S


async def test_reserve_again_with_same_token_is_idempotent(
    store: FingerprintStore, prefix: str
) -> None:
    """A retried reserve with the same token reports the key reserved again."""
    key, token = prefix + "a", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    [reservation] = await store.reserve([key], token=token, lease_s=LEASE_S)
    assert reservation.reserved
    assert (await store.inspect(key)).token == token


async def test_mark_sent_records_time_reply_and_window(
    store: FingerprintStore, prefix: str
) -> None:
    """Settling SENT with the right token stores the time of the mark, the reply and a TTL of
    the window."""
    key, token = prefix + "a", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    before = time.time()
    done = await store.settle(
        [SettleOp(key, Settle.SENT, "250 2.0.0 Ok: queued as 4F2A")],
        token=token,
        window_s=WINDOW_S,
    )
    after = time.time()
    assert done == [True]
    record = await store.inspect(key)
    assert record.state is State.SENT
    assert record.token is None
    assert dated_between(record.at, before, after), (record.at, before, after)
    assert record.reply == kept_reply(store, "250 2.0.0 Ok: queued as 4F2A")
    assert record.ttl_s is not None
    assert WINDOW_S - 10 < record.ttl_s <= WINDOW_S


@pytest.mark.parametrize("action", list(Settle))
async def test_settle_with_wrong_token_changes_nothing(
    store: FingerprintStore, prefix: str, action: Settle
) -> None:
    """Any settlement with a token that does not hold the key returns False and changes nothing."""
    key, token = prefix + "a", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    done = await store.settle(
        [SettleOp(key, action, "250 ok")], token=new_token(), window_s=WINDOW_S
    )
    assert done == [False]
    record = await store.inspect(key)
    assert record.state is State.PENDING
    assert record.token == token


async def test_release_with_right_token_deletes(store: FingerprintStore, prefix: str) -> None:
    """Releasing with the right token makes the key absent, so it can be reserved again."""
    key, token = prefix + "a", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    done = await store.settle(
        [SettleOp(key, Settle.RELEASE)], token=token, window_s=WINDOW_S
    )
    assert done == [True]
    assert (await store.inspect(key)).state is State.ABSENT
    [again] = await store.reserve([key], token=new_token(), lease_s=LEASE_S)
    assert again.reserved


async def test_mark_unknown_records_time_and_window(store: FingerprintStore, prefix: str) -> None:
    """Settling UNKNOWN stores the time of the mark (between the call's start and its answer,
    give or take the store's whole milliseconds) with a TTL of the window, and blocks
    reserves."""
    key, token = prefix + "a", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    before = time.time()
    done = await store.settle(
        [SettleOp(key, Settle.UNKNOWN)], token=token, window_s=WINDOW_S
    )
    after = time.time()
    assert done == [True]
    [reservation] = await store.reserve([key], token=new_token(), lease_s=LEASE_S)
    assert not reservation.reserved
    found = reservation.found
    assert found is not None
    assert found.state is State.UNKNOWN
    assert dated_between(found.at, before, after), (found.at, before, after)
    assert found.ttl_s is not None
    assert WINDOW_S - 10 < found.ttl_s <= WINDOW_S


async def test_reserve_after_sent_finds_sent_with_reply(
    store: FingerprintStore, prefix: str
) -> None:
    """A reserve of a SENT key is refused and reports the send's time and reply."""
    key, token = prefix + "a", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    before = time.time()
    await store.settle([SettleOp(key, Settle.SENT, "250 ok")], token=token, window_s=60)
    after = time.time()
    [reservation] = await store.reserve([key], token=new_token(), lease_s=LEASE_S)
    assert not reservation.reserved
    assert reservation.found is not None
    assert reservation.found.state is State.SENT
    assert reservation.found.reply == kept_reply(store, "250 ok")
    assert dated_between(reservation.found.at, before, after), (reservation.found.at, before,
                                                                after)


@pytest.mark.parametrize("reply", ["", "250 2.0.0 a|b|c", "250 accepté ✓", "250 bad \udcff"])
async def test_reply_text_round_trips(store: FingerprintStore, prefix: str, reply: str) -> None:
    """The reply kept with SENT comes back as given (unencodable characters as U+FFFD)."""
    key, token = prefix + "a", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    await store.settle(
        [SettleOp(key, Settle.SENT, reply)], token=token, window_s=WINDOW_S
    )
    expected = reply.encode("utf-8", "replace").decode("utf-8")
    assert (await store.inspect(key)).reply == kept_reply(store, expected)


async def test_foreign_value_counts_as_sent(
    store: FingerprintStore, prefix: str, db_path: str
) -> None:
    """A value written by another application counts as SENT, with no time or reply."""
    key = prefix + "a"
    await write_foreign(store, key, db_path)
    assert await store.inspect(key) == Record(State.SENT)
    [reservation] = await store.reserve([key], token=new_token(), lease_s=LEASE_S)
    assert not reservation.reserved
    assert reservation.found == Record(State.SENT)
    done = await store.settle(
        [SettleOp(key, Settle.RELEASE)], token=new_token(), window_s=WINDOW_S
    )
    assert done == [False]


async def test_expired_lease_is_free_and_old_token_is_void(
    store: FingerprintStore, prefix: str
) -> None:
    """After the lease runs out the key is reserved anew and the old token settles nothing."""
    key, old, new = prefix + "a", new_token(), new_token()
    await store.reserve([key], token=old, lease_s=0.2)
    await asyncio.sleep(0.4)
    assert (await store.inspect(key)).state is State.ABSENT
    [reservation] = await store.reserve([key], token=new, lease_s=LEASE_S)
    assert reservation.reserved
    done = await store.settle(
        [SettleOp(key, Settle.SENT, "250 ok")], token=old, window_s=WINDOW_S
    )
    assert done == [False]
    record = await store.inspect(key)
    assert record.state is State.PENDING
    assert record.token == new


async def test_many_keys_report_individually(store: FingerprintStore, prefix: str) -> None:
    """Fifty keys reserved in one call each report their own outcome, in order."""
    keys = [f"{prefix}{i:02d}" for i in range(50)]
    other, mine = new_token(), new_token()
    await store.reserve(keys[::2], token=other, lease_s=LEASE_S)
    reservations = await store.reserve(keys, token=mine, lease_s=LEASE_S)
    assert [r.key for r in reservations] == keys
    for i, reservation in enumerate(reservations):
        if i % 2:
            assert reservation.reserved
        else:
            assert not reservation.reserved
            assert reservation.found is not None
            assert reservation.found.token == other


async def test_settle_reports_each_op(store: FingerprintStore, prefix: str) -> None:
    """One settle call applies each op on its own and reports each result, in order."""
    token = new_token()
    held, free, absent = prefix + "held", prefix + "free", prefix + "absent"
    await store.reserve([held], token=new_token(), lease_s=LEASE_S)
    await store.reserve([free], token=token, lease_s=LEASE_S)
    ops = [
        SettleOp(held, Settle.SENT, "250 ok"),
        SettleOp(free, Settle.SENT, "250 ok"),
        SettleOp(absent, Settle.UNKNOWN),
    ]
    done = await store.settle(ops, token=token, window_s=WINDOW_S)
    assert done == [False, True, False]
    assert (await store.inspect(held)).state is State.PENDING
    assert (await store.inspect(free)).state is State.SENT
    assert (await store.inspect(absent)).state is State.ABSENT


async def test_empty_calls_return_empty_lists(store: FingerprintStore) -> None:
    """Reserving no keys and settling no ops return empty lists."""
    assert await store.reserve([], token=new_token(), lease_s=LEASE_S) == []
    assert await store.settle([], token=new_token(), window_s=WINDOW_S) == []


async def test_force_release_deletes_whatever_is_there(
    store: FingerprintStore, prefix: str
) -> None:
    """force_release deletes a SENT key and returns True; on an absent key it returns False."""
    key, token = prefix + "a", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    await store.settle(
        [SettleOp(key, Settle.SENT, "250 ok")], token=token, window_s=WINDOW_S
    )
    assert await store.force_release(key)
    assert (await store.inspect(key)).state is State.ABSENT
    assert not await store.force_release(key)


async def test_ping_answers(store: FingerprintStore) -> None:
    """ping returns when the store is reachable."""
    await store.ping()


# ---------------------------------------------------------------------------------------------
# Redis only
# ---------------------------------------------------------------------------------------------

Reply = bytes | None  # None: the fake server never answers


@contextlib.asynccontextmanager
async def fake_redis(answer: Callable[[list[bytes]], Reply]) -> AsyncIterator[str]:
    """Serve RESP on a free port, answering each command with ``answer(command)``; yield a URL.

    The connection handshake (HELLO, CLIENT SETINFO) is answered here, so ``answer`` sees only
    the commands of the test.
    """

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                count = int((await reader.readuntil(b"\r\n"))[1:-2])
                command = []
                for _ in range(count):
                    size = int((await reader.readuntil(b"\r\n"))[1:-2])
                    command.append((await reader.readexactly(size + 2))[:-2])
                name = command[0].upper()
                if name == b"HELLO":
                    reply: Reply = b"%1\r\n$5\r\nproto\r\n:3\r\n"
                elif name == b"CLIENT":
                    reply = b"+OK\r\n"
                else:
                    reply = answer(command)
                if reply is not None:
                    writer.write(reply)
                    await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"redis://127.0.0.1:{port}"


def closed_port() -> int:
    """A local TCP port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


StoreCall = Callable[[RedisStore], Awaitable[object]]
STORE_CALLS: dict[str, StoreCall] = {
    "reserve": lambda s: s.reserve(["k"], token="t", lease_s=1),
    "settle": lambda s: s.settle([SettleOp("k", Settle.RELEASE)], token="t", window_s=1),
    "inspect": lambda s: s.inspect("k"),
    "force_release": lambda s: s.force_release("k"),
    "ping": lambda s: s.ping(),
    "check_server": lambda s: s.check_server(),
}


@pytest.mark.parametrize("op", list(STORE_CALLS))
async def test_redis_closed_port_raises_store_error(op: str) -> None:
    """Every operation on a Redis that refuses connections raises StoreError naming the op."""
    store = RedisStore.from_url(f"redis://127.0.0.1:{closed_port()}/0", op_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(StoreError) as caught:
        await STORE_CALLS[op](store)
    assert caught.value.op == op
    assert time.monotonic() - started < 1.5
    await store.close()


async def test_redis_silent_server_times_out() -> None:
    """A server that accepts but never answers makes reserve raise StoreError within the timeout."""
    async with fake_redis(lambda command: None) as url:
        store = RedisStore.from_url(url, op_timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(StoreError) as caught:
            await store.reserve(["k"], token="t", lease_s=1)
        assert caught.value.op == "reserve"
        assert time.monotonic() - started < 0.3 + 2.0  # the timeout, and a loaded loop's lag
        await store.close()


async def test_redis_reloads_script_after_noscript() -> None:
    """A script the server lost (NOSCRIPT) is run again by EVAL, which caches it, and succeeds."""
    seen: list[bytes] = []

    def answer(command: list[bytes]) -> Reply:
        seen.append(command[0].upper())
        if seen == [b"EVALSHA"]:
            return b"-NOSCRIPT No matching script. Please use EVAL.\r\n"
        return b":1\r\n"

    async with fake_redis(answer) as url:
        store = RedisStore.from_url(url, op_timeout_s=1)
        [reservation] = await store.reserve(["k"], token="t", lease_s=1)
        await store.close()
    assert reservation.reserved
    assert seen == [b"EVALSHA", b"EVAL"]


SAFE_CONFIG = {"maxmemory-policy": "noeviction", "appendonly": "yes", "save": "3600 1"}


def config_server(settings: dict[str, str | None]) -> Callable[[list[bytes]], Reply]:
    """Answer ``CONFIG GET <name>`` from ``settings`` (None: not reported) like Redis 7."""

    def answer(command: list[bytes]) -> Reply:
        value = settings.get(command[2].decode())
        if value is None:
            return b"%0\r\n"
        name, raw = command[2], value.encode()
        return b"%%1\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(name), name, len(raw), raw)

    return answer


@pytest.mark.parametrize(
    ("changes", "warning_part"),
    [
        ({"maxmemory-policy": "allkeys-lru"}, "'allkeys-lru'"),
        ({"maxmemory-policy": None}, "could not check Redis maxmemory-policy"),
        ({"appendonly": "no", "save": ""}, "persistence is off"),
        ({"save": None}, "could not check Redis persistence"),
    ],
)
async def test_redis_check_server_warns(
    changes: dict[str, str | None], warning_part: str
) -> None:
    """check_server warns when maxmemory-policy evicts, persistence is off, or either is unread."""
    async with fake_redis(config_server({**SAFE_CONFIG, **changes})) as url:
        store = RedisStore.from_url(url, op_timeout_s=1)
        warnings = await store.check_server()
        await store.close()
    assert len(warnings) == 1
    assert warning_part in warnings[0]


async def test_redis_check_server_warns_once_when_config_refused() -> None:
    """A server that refuses CONFIG gets one warning that it could not be checked."""
    async with fake_redis(lambda command: b"-ERR unknown command 'CONFIG'\r\n") as url:
        store = RedisStore.from_url(url, op_timeout_s=1)
        warnings = await store.check_server()
        await store.close()
    assert len(warnings) == 1
    assert "could not check" in warnings[0]


@pytest.mark.parametrize("changes", [{}, {"appendonly": "no"}, {"save": ""}])
async def test_redis_check_server_quiet_when_safe(changes: dict[str, str | None]) -> None:
    """check_server is quiet with noeviction and either AOF or RDB snapshots on."""
    async with fake_redis(config_server({**SAFE_CONFIG, **changes})) as url:
        store = RedisStore.from_url(url, op_timeout_s=1)
        assert await store.check_server() == []
        await store.close()


async def test_redis_race_has_one_winner(prefix: str) -> None:
    """Twenty concurrent reserves of one key with distinct tokens reserve it exactly once."""
    store = RedisStore.from_url(REDIS_URL)
    key = prefix + "race"
    try:
        results = await asyncio.gather(
            *(store.reserve([key], token=new_token(), lease_s=LEASE_S) for _ in range(20))
        )
        winners = [r for [r] in results if r.reserved]
        assert len(winners) == 1
        holder = (await store.inspect(key)).token
        assert all(r.found is not None and r.found.token == holder for [r] in results if r.found)
    finally:
        await store.force_release(key)
        await store.close()


async def test_redis_non_string_key_counts_as_sent(prefix: str) -> None:
    """A key of another type (a hash) written by someone else counts as SENT."""
    store = RedisStore.from_url(REDIS_URL)
    key = prefix + "hash"
    client = redis.asyncio.from_url(REDIS_URL)
    try:
        await client.hset(key, "field", "value")
        [reservation] = await store.reserve([key], token=new_token(), lease_s=LEASE_S)
        assert reservation.found == Record(State.SENT)
        assert await store.inspect(key) == Record(State.SENT)
    finally:
        await client.delete(key)
        await client.aclose()
        await store.close()


@pytest.mark.parametrize("raw", [b"1", b"", b"P|", b"S|12x|ok", b"S|12", b"U|", b"U|x", b"\xff"])
def test_decode_value_reads_malformed_values_as_sent(raw: bytes) -> None:
    """A value that is not one of the relay's encodings decodes to SENT without time or reply."""
    assert decode_value(raw) == Record(State.SENT)


def test_from_url_refuses_other_schemes() -> None:
    """RedisStore.from_url refuses a URL that is not one of the Redis store schemes."""
    with pytest.raises(ValueError, match="scheme"):
        RedisStore.from_url("http://127.0.0.1:6379/0")


# ---------------------------------------------------------------------------------------------
# SQLite only
# ---------------------------------------------------------------------------------------------


async def test_sqlite_survives_reopen(db_path: str) -> None:
    """A SENT record written before the store closes is there after reopening the file."""
    store = await SqliteStore.open(db_path)
    token = new_token()
    await store.reserve(["k"], token=token, lease_s=LEASE_S)
    await store.settle([SettleOp("k", Settle.SENT, "250 ok")], token=token, window_s=60)
    await store.close()
    reopened = await SqliteStore.open(db_path)
    record = await reopened.inspect("k")
    await reopened.close()
    assert record.state is State.SENT
    assert record.reply == "250 ok"


async def test_sqlite_open_creates_parent_directory(tmp_path: Path) -> None:
    """Opening a store in a directory that does not exist creates the directory and file."""
    path = tmp_path / "a" / "b" / "store.db"
    store = await SqliteStore.open(str(path))
    await store.ping()
    await store.close()
    assert path.exists()


async def test_sqlite_open_failure_raises_store_error(tmp_path: Path) -> None:
    """Opening a path that is a directory raises StoreError for op open."""
    with pytest.raises(StoreError) as caught:
        await SqliteStore.open(str(tmp_path))
    assert caught.value.op == "open"


async def test_sqlite_two_instances_race_has_one_winner(db_path: str) -> None:
    """Twenty reserves of one key through two stores on one file reserve it exactly once."""
    first = await SqliteStore.open(db_path, op_timeout_s=OP_TIMEOUT_S)
    second = await SqliteStore.open(db_path, op_timeout_s=OP_TIMEOUT_S)
    try:
        results = await asyncio.gather(
            *(
                (first if i % 2 else second).reserve(["k"], token=new_token(), lease_s=LEASE_S)
                for i in range(20)
            )
        )
    finally:
        await first.close()
        await second.close()
    assert sum(r.reserved for [r] in results) == 1


async def test_sqlite_locked_file_raises_store_error(db_path: str) -> None:
    """A reserve that cannot get the write lock within the timeout raises StoreError."""
    store = await SqliteStore.open(db_path, op_timeout_s=0.3)
    blocker = sqlite3.connect(db_path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        with pytest.raises(StoreError) as caught:
            await store.reserve(["k"], token=new_token(), lease_s=LEASE_S)
        assert caught.value.op == "reserve"
        assert time.monotonic() - started < 0.3 + 2.0  # the timeout, and a loaded loop's lag
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        await store.close()


async def test_sqlite_closed_store_raises_store_error(db_path: str) -> None:
    """Calling a closed store raises StoreError."""
    store = await SqliteStore.open(db_path)
    await store.close()
    with pytest.raises(StoreError):
        await store.ping()


async def test_sqlite_purge_expired_deletes_only_expired(db_path: str) -> None:
    """purge_expired deletes rows whose TTL ran out and keeps live ones."""
    store = await SqliteStore.open(db_path)
    await store.reserve(["short"], token=new_token(), lease_s=0.1)
    await store.reserve(["long"], token=new_token(), lease_s=LEASE_S)
    await asyncio.sleep(0.2)
    assert await store.purge_expired() == 1
    assert (await store.inspect("long")).state is State.PENDING
    await store.close()


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:///relative/path.db", "relative/path.db"),
        ("sqlite:////abs/path.db", "/abs/path.db"),
        ("sqlite:///store.db", "store.db"),
    ],
)
def test_sqlite_path_from_url(url: str, path: str) -> None:
    """sqlite_path_from_url follows the SQLAlchemy convention for relative and absolute paths."""
    assert sqlite_path_from_url(url) == path


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1/0", "sqlite://relative.db", "sqlite:///", "sqlite:///dir/", ""]
)
def test_sqlite_path_from_url_refuses_bad_urls(url: str) -> None:
    """sqlite_path_from_url raises ValueError for anything but a sqlite:/// file URL."""
    with pytest.raises(ValueError, match="store URL"):
        sqlite_path_from_url(url)


# ---------------------------------------------------------------------------------------------
# SENDING: a reservation whose final dot is going out. A relay killed after the upstream took a
# message, before it marked it sent, used to leave a PENDING key that lapsed with the lease, so
# the retry was relayed again (the fault bench's "SIGKILL just after the upstream took a
# message"). Marking the keys SENDING (TTL: the dedup window) before the dot makes it UNKNOWN.
# ---------------------------------------------------------------------------------------------


async def test_sending_reads_as_pending_within_the_lease(store: FingerprintStore,
                                                         prefix: str) -> None:
    """Another attempt finds a SENDING key PENDING (450 inflight) while its lease runs."""
    key, token = prefix + "k", new_token()
    await store.reserve([key], token=token, lease_s=30)
    assert await store.settle([SettleOp(key, Settle.SENDING)], token=token, window_s=3600) == [True]
    found = (await store.reserve([key], token=new_token(), lease_s=30))[0]
    assert not found.reserved and found.found is not None
    assert found.found.state is State.PENDING
    record = await store.inspect(key)
    assert record.state is State.SENDING and record.token == token
    assert record.ttl_s is not None and record.ttl_s > 3000  # the window, not the lease


async def test_sending_older_than_the_lease_reads_as_unknown(store: FingerprintStore,
                                                             prefix: str) -> None:
    """A SENDING key whose attempt died outlives the lease and is then found UNKNOWN."""
    key, token = prefix + "k", new_token()
    await store.reserve([key], token=token, lease_s=0.3)
    await store.settle([SettleOp(key, Settle.SENDING)], token=token, window_s=3600)
    await asyncio.sleep(0.5)
    found = (await store.reserve([key], token=new_token(), lease_s=0.3))[0]
    assert not found.reserved and found.found is not None
    assert found.found.state is State.UNKNOWN


async def test_sending_settles_with_its_token_only(store: FingerprintStore,
                                                   prefix: str) -> None:
    """SENDING(token) goes to SENT, UNKNOWN or absent with its token, never with another."""
    keys = [prefix + n for n in "abc"]
    token = new_token()
    await store.reserve(keys, token=token, lease_s=30)
    await store.settle([SettleOp(k, Settle.SENDING) for k in keys], token=token,
                       window_s=3600)
    wrong = await store.settle([SettleOp(keys[0], Settle.SENT, "250 ok")], token=new_token(),
                               window_s=3600)
    assert wrong == [False]
    done = await store.settle(
        [SettleOp(keys[0], Settle.SENT, "250 ok"), SettleOp(keys[1], Settle.UNKNOWN),
         SettleOp(keys[2], Settle.RELEASE)], token=token, window_s=3600)
    assert done == [True, True, True]
    states = [(await store.inspect(k)).state for k in keys]
    assert states == [State.SENT, State.UNKNOWN, State.ABSENT]


async def test_sending_needs_a_pending_reservation(store: FingerprintStore,
                                                   prefix: str) -> None:
    """SENDING is refused for an absent key and for another attempt's reservation."""
    key, token = prefix + "k", new_token()
    absent = await store.settle([SettleOp(key, Settle.SENDING)], token=token, window_s=3600)
    assert absent == [False]
    await store.reserve([key], token=token, lease_s=30)
    other = await store.settle([SettleOp(key, Settle.SENDING)], token=new_token(),
                               window_s=3600)
    assert other == [False]
    assert (await store.inspect(key)).state is State.PENDING


# ---------------------------------------------------------------------------------------------
# resend_unknown (unknown_policy = send, at least once: design.md §4.4): a reserve takes
# over a record in doubt atomically, and nothing else.
# ---------------------------------------------------------------------------------------------


async def test_resend_unknown_takes_over_an_unknown_record(store: FingerprintStore,
                                                           prefix: str) -> None:
    """An UNKNOWN key is reserved again (found: the UNKNOWN record); only one attempt wins."""
    key, token = prefix + "u", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    before = time.time()
    await store.settle([SettleOp(key, Settle.UNKNOWN)], token=token, window_s=WINDOW_S)
    after = time.time()
    retry = new_token()
    [took] = await store.reserve([key], token=retry, lease_s=LEASE_S, resend_unknown=True)
    assert took.reserved and took.found is not None and took.found.state is State.UNKNOWN
    assert dated_between(took.found.at, before, after), (took.found.at, before, after)
    record = await store.inspect(key)
    assert record.state is State.PENDING and record.token == retry
    assert record.ttl_s is not None and record.ttl_s <= LEASE_S  # the lease, not the window
    [second] = await store.reserve([key], token=new_token(), lease_s=LEASE_S,
                                   resend_unknown=True)
    assert not second.reserved and second.found is not None
    assert second.found.state is State.PENDING
    assert await store.settle([SettleOp(key, Settle.SENT, "250 ok")], token=retry,
                              window_s=WINDOW_S) == [True]


async def test_resend_unknown_takes_over_sending_only_past_the_lease(
        store: FingerprintStore, prefix: str) -> None:
    """A SENDING key is in flight within the lease (kept: the reserve right after the mark,
    with 2 s to land) and in doubt after it (taken: once the lease is surely over, 2.1 s
    after the mark answered by the monotonic clock)."""
    key, token = prefix + "d", new_token()
    await store.reserve([key], token=token, lease_s=2.0)
    await store.settle([SettleOp(key, Settle.SENDING)], token=token, window_s=3600)
    lease_over = time.monotonic() + 2.1
    [early] = await store.reserve([key], token=new_token(), lease_s=2.0, resend_unknown=True)
    assert not early.reserved and early.found is not None
    assert early.found.state is State.PENDING
    await asyncio.sleep(max(0.0, lease_over - time.monotonic()))
    retry = new_token()
    [late] = await store.reserve([key], token=retry, lease_s=2.0, resend_unknown=True)
    assert late.reserved and late.found is not None and late.found.state is State.UNKNOWN
    assert (await store.inspect(key)).token == retry
    # the dead attempt's token no longer settles anything
    assert await store.settle([SettleOp(key, Settle.RELEASE)], token=token,
                              window_s=3600) == [False]


async def test_resend_unknown_leaves_sent_and_foreign_records(
        store: FingerprintStore, prefix: str, db_path: str) -> None:
    """SENT and values of other applications stay duplicates under resend_unknown."""
    sent, foreign, token = prefix + "s", prefix + "f", new_token()
    await store.reserve([sent], token=token, lease_s=LEASE_S)
    await store.settle([SettleOp(sent, Settle.SENT, "250 ok")], token=token, window_s=WINDOW_S)
    await write_foreign(store, foreign, db_path)
    found = await store.reserve([sent, foreign], token=new_token(), lease_s=LEASE_S,
                                resend_unknown=True)
    assert [r.reserved for r in found] == [False, False]
    assert [r.found.state for r in found if r.found is not None] == [State.SENT, State.SENT]


async def test_without_resend_unknown_an_unknown_record_stays(store: FingerprintStore,
                                                              prefix: str) -> None:
    """The default reserve never replaces UNKNOWN (unknown_policy = suppress or hold)."""
    key, token = prefix + "u", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    await store.settle([SettleOp(key, Settle.UNKNOWN)], token=token, window_s=WINDOW_S)
    [again] = await store.reserve([key], token=new_token(), lease_s=LEASE_S,
                                  resend_unknown=False)
    assert not again.reserved
    assert (await store.inspect(key)).state is State.UNKNOWN


async def test_force_mark_sent_overrides_any_state(store: FingerprintStore, prefix: str) -> None:
    """An operator's mark-sent turns an UNKNOWN (or any) record into SENT for the window."""
    key, token = prefix + "m", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    await store.settle([SettleOp(key, Settle.UNKNOWN)], token=token, window_s=WINDOW_S)
    before = time.time()
    await store.force_mark_sent(key, reply="marked sent by ops", window_s=WINDOW_S)
    after = time.time()
    record = await store.inspect(key)
    assert record.state is State.SENT and record.reply == "marked sent by ops"
    assert dated_between(record.at, before, after), (record.at, before, after)
    assert record.ttl_s is not None and WINDOW_S - 10 < record.ttl_s <= WINDOW_S
    [again] = await store.reserve([key], token=new_token(), lease_s=LEASE_S, resend_unknown=True)
    assert not again.reserved and again.found is not None and again.found.state is State.SENT
    absent = prefix + "never"
    await store.force_mark_sent(absent, reply="x", window_s=WINDOW_S)
    assert (await store.inspect(absent)).state is State.SENT


async def test_a_sending_record_is_judged_by_its_writers_lease(store: FingerprintStore,
                                                              prefix: str) -> None:
    """A SENDING record written with a 30 s lease is still in flight for a reader configured
    with 0.3 s (relays with different leases on one store): PENDING, never taken over."""
    key, token = prefix + "k", new_token()
    await store.reserve([key], token=token, lease_s=30)
    assert await store.settle([SettleOp(key, Settle.SENDING, lease_s=30)], token=token,
                              window_s=3600) == [True]
    await asyncio.sleep(0.5)
    found = (await store.reserve([key], token=new_token(), lease_s=0.3,
                                 resend_unknown=True))[0]
    assert not found.reserved and found.found is not None
    assert found.found.state is State.PENDING
    assert (await store.inspect(key)).lease_s == 30


async def test_a_renewed_sending_record_keeps_its_writers_lease(store: FingerprintStore,
                                                               prefix: str) -> None:
    """A renewal of a SENDING record keeps it in flight for the renewing attempt's lease."""
    key, token = prefix + "k", new_token()
    await store.reserve([key], token=token, lease_s=30)
    await store.settle([SettleOp(key, Settle.SENDING, lease_s=30)], token=token, window_s=3600)
    assert await store.renew([key], token=token, lease_s=30) == [True]
    await asyncio.sleep(0.5)
    found = (await store.reserve([key], token=new_token(), lease_s=0.3))[0]
    assert found.found is not None and found.found.state is State.PENDING


async def test_a_renewed_sending_record_stays_sending_and_settles_with_its_token(
        store: FingerprintStore, prefix: str) -> None:
    """A renewed SENDING record still inspects as SENDING of its token, and its attempt's SENT
    mark then lands."""
    key, token = prefix + "k", new_token()
    await store.reserve([key], token=token, lease_s=30)
    await store.settle([SettleOp(key, Settle.SENDING, lease_s=30)], token=token, window_s=3600)
    assert await store.renew([key], token=token, lease_s=30) == [True]
    record = await store.inspect(key)
    assert record.state is State.SENDING and record.token == token
    assert await store.settle([SettleOp(key, Settle.SENT, "250 ok")], token=token,
                              window_s=3600) == [True]


async def test_a_renewed_sending_record_counts_its_lease_from_the_renewal(
        store: FingerprintStore, prefix: str) -> None:
    """SENDING with a 3 s lease, renewed 1.5 s after the mark, is still in flight once the
    mark's own heartbeat is surely past the lease (3.1 s after the mark answered, by the
    monotonic clock): no takeover (the renewal is its heartbeat). The renewal and the last
    reserve each have about 1.4 s to spare for a loaded runner."""
    key, token = prefix + "k", new_token()
    await store.reserve([key], token=token, lease_s=3.0)
    await store.settle([SettleOp(key, Settle.SENDING, lease_s=3.0)], token=token, window_s=3600)
    marked = time.monotonic()
    await asyncio.sleep(1.5)
    assert await store.renew([key], token=token, lease_s=3.0) == [True]
    await asyncio.sleep(max(0.0, marked + 3.1 - time.monotonic()))
    found = (await store.reserve([key], token=new_token(), lease_s=3.0,
                                 resend_unknown=True))[0]
    assert not found.reserved and found.found is not None
    assert found.found.state is State.PENDING


async def test_marking_sending_again_with_the_same_token_is_idempotent(
        store: FingerprintStore, prefix: str) -> None:
    """A retried SENDING mark (same token) answers True again and leaves the record SENDING."""
    key, token = prefix + "k", new_token()
    await store.reserve([key], token=token, lease_s=30)
    for _ in range(2):
        assert await store.settle([SettleOp(key, Settle.SENDING, lease_s=30)], token=token,
                                  window_s=3600) == [True]
    record = await store.inspect(key)
    assert record.state is State.SENDING and record.token == token


async def test_renew_keeps_a_pending_reservation_past_its_first_lease(
        store: FingerprintStore, prefix: str) -> None:
    """PENDING reserved for 2 s and renewed at once for 60 s is still this attempt's once the
    first lease has surely run out (2.1 s after the reserve answered, by the monotonic
    clock). The renewal's lease is long enough for any wait of a loaded runner before the
    second reserve; the first one gives the renewal 2 s to land."""
    key, token = prefix + "k", new_token()
    await store.reserve([key], token=token, lease_s=2.0)
    first_lease_over = time.monotonic() + 2.1
    assert await store.renew([key], token=token, lease_s=60) == [True]
    await asyncio.sleep(max(0.0, first_lease_over - time.monotonic()))
    found = (await store.reserve([key], token=new_token(), lease_s=60))[0]
    assert not found.reserved and found.found is not None
    assert found.found.state is State.PENDING and found.found.token == token


async def test_renew_changes_nothing_that_is_not_the_attempts(store: FingerprintStore,
                                                              prefix: str) -> None:
    """Renewing with another token, a SENT record or an absent key answers False and changes
    nothing."""
    key, sent, absent, token = prefix + "k", prefix + "s", prefix + "a", new_token()
    await store.reserve([key, sent], token=token, lease_s=30)
    await store.settle([SettleOp(sent, Settle.SENT, "250 ok")], token=token, window_s=60)
    assert await store.renew([key, sent, absent], token=new_token(), lease_s=30) == [
        False, False, False]
    assert await store.renew([sent, absent], token=token, lease_s=30) == [False, False]
    assert (await store.inspect(sent)).state is State.SENT
    assert (await store.inspect(absent)).state is State.ABSENT


async def test_force_release_with_expected_spares_a_record_replaced_since(
        store: FingerprintStore, prefix: str) -> None:
    """An operator's release of the record they inspected does nothing once another attempt
    took the key over (compare-and-delete), and deletes it while it is unchanged."""
    key, first, second = prefix + "k", new_token(), new_token()
    await store.reserve([key], token=first, lease_s=30)
    await store.settle([SettleOp(key, Settle.UNKNOWN)], token=first, window_s=3600)
    seen = await store.inspect(key)
    assert seen.state is State.UNKNOWN
    taken = (await store.reserve([key], token=second, lease_s=30, resend_unknown=True))[0]
    assert taken.reserved
    assert not await store.force_release(key, expected=seen)
    assert (await store.inspect(key)).token == second
    now = await store.inspect(key)
    assert await store.force_release(key, expected=now)
    assert (await store.inspect(key)).state is State.ABSENT


async def test_mark_sent_with_expected_spares_a_retry_that_took_the_key_since(
        store: FingerprintStore, prefix: str) -> None:
    """An operator's mark-sent of the in-doubt record they inspected writes nothing once a
    retry took the key over and is sending (compare-and-set): the retry's SENDING record
    stays, and its own SENT then lands; on the record as it is now, the mark is written."""
    key, first, retry = prefix + "k", new_token(), new_token()
    await store.reserve([key], token=first, lease_s=30)
    await store.settle([SettleOp(key, Settle.UNKNOWN)], token=first, window_s=3600)
    seen = await store.inspect(key)
    assert seen.state is State.UNKNOWN
    [taken] = await store.reserve([key], token=retry, lease_s=30, resend_unknown=True)
    assert taken.reserved
    assert await store.settle([SettleOp(key, Settle.SENDING, lease_s=30)], token=retry,
                              window_s=3600) == [True]
    assert not await store.force_mark_sent(key, reply="operator", window_s=3600,
                                           expected=seen)
    now = await store.inspect(key)
    assert now.state is State.SENDING and now.token == retry
    assert await store.force_mark_sent(key, reply="operator", window_s=3600, expected=now)
    marked = await store.inspect(key)
    assert marked.state is State.SENT and marked.reply == "operator"


async def test_mark_sent_of_a_key_seen_absent_spares_a_reserve_made_since(
        store: FingerprintStore, prefix: str) -> None:
    """A mark-sent of a key the operator found absent writes nothing once an attempt reserved
    it, and writes SENT while it is still absent."""
    key, other = prefix + "k", prefix + "other"
    seen = await store.inspect(key)
    assert seen.state is State.ABSENT
    token = new_token()
    await store.reserve([key], token=token, lease_s=30)
    assert not await store.force_mark_sent(key, reply="operator", window_s=3600,
                                           expected=seen)
    assert (await store.inspect(key)).token == token
    assert await store.force_mark_sent(other, reply="operator", window_s=3600,
                                       expected=await store.inspect(other))
    assert (await store.inspect(other)).state is State.SENT


class BothLooked:
    """A store whose ``inspect`` answers only once ``parties`` callers have each read: two
    operators who looked at the same record before either acted."""

    def __init__(self, store: FingerprintStore, parties: int) -> None:
        self._store = store
        self._looked = asyncio.Barrier(parties)

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def inspect(self, key: str) -> Record:
        record = await self._store.inspect(key)
        await self._looked.wait()
        return record


async def test_two_operators_marking_one_record_at_once_mark_it_once(
        store: FingerprintStore, prefix: str) -> None:
    """Two operators who both read an in-doubt record and then mark it sent at once: one
    marks it, the other is told it changed (nothing done), and the record holds the first's
    reason."""
    key, token = prefix + "k", new_token()
    await store.reserve([key], token=token, lease_s=30)
    await store.settle([SettleOp(key, Settle.UNKNOWN)], token=token, window_s=3600)
    both = cast(FingerprintStore, BothLooked(store, 2))
    results = await asyncio.gather(*(
        mark_sent(both, key, reason=who, lease_s=LEASE_S, window_s=WINDOW_S, operator=who)
        for who in ("alice", "bob")))
    marked = [who for who, (_, done) in zip(("alice", "bob"), results, strict=True) if done]
    assert len(marked) == 1, results
    assert all(before.state is State.UNKNOWN for before, _ in results)
    assert (await store.inspect(key)).reply == f"marked sent by an operator: {marked[0]}"


@pytest.mark.parametrize("action", [Settle.SENT, Settle.UNKNOWN, Settle.RELEASE])
async def test_a_watch_hears_the_settle_that_ends_an_attempts_hold_and_not_its_sending_mark(
        store: FingerprintStore, prefix: str, action: Settle) -> None:
    """Entered before the settle, a watch of a key returns once SENT, UNKNOWN or a release
    lands (design.md §4.8), not on the SENDING mark before the final dot."""
    key = f"{prefix}watched"
    await store.reserve([key], token="t1", lease_s=60.0)
    async with store.watch_settles([key, f"{prefix}other"]) as watch:
        heard = asyncio.ensure_future(watch.settled(key))
        await store.settle([SettleOp(key, Settle.SENDING, lease_s=60.0)], token="t1",
                           window_s=WINDOW_S)
        await asyncio.sleep(0.5)
        assert not heard.done()
        await store.settle([SettleOp(key, action, reply="250 ok")], token="t1",
                           window_s=WINDOW_S)
        await asyncio.wait_for(heard, 10.0)


async def test_watches_of_one_key_share_it_and_each_hears_the_settle(
        store: FingerprintStore, prefix: str) -> None:
    """Ten watches of one key, entered together: one settle wakes every one; a watch entered
    after the others left watches anew."""
    key = f"{prefix}shared"
    await store.reserve([key], token="t1", lease_s=60.0)
    async with contextlib.AsyncExitStack() as stack:
        watches = [await stack.enter_async_context(store.watch_settles([key]))
                   for _ in range(10)]
        heard = [asyncio.ensure_future(w.settled(key)) for w in watches]
        await store.settle([SettleOp(key, Settle.RELEASE)], token="t1", window_s=WINDOW_S)
        await asyncio.wait_for(asyncio.gather(*heard), 10.0)
    await store.reserve([key], token="t2", lease_s=60.0)
    async with store.watch_settles([key]) as watch:
        again = asyncio.ensure_future(watch.settled(key))
        await store.settle([SettleOp(key, Settle.SENT, reply="250 ok")], token="t2",
                           window_s=WINDOW_S)
        await asyncio.wait_for(again, 10.0)


# ---------------------------------------------------------------------------------------------
# The content digest (design.md §2.2, §4.9): kept from the reserve through every state; a record
# of other content replaced only under replace_other_content (key_reuse = relay), by the rule of
# relay.core.rules.takes_over, which every store follows.
# ---------------------------------------------------------------------------------------------

MINE, THEIRS = "AbC-_09xyz", "zyx90_-CbA"


@pytest.mark.parametrize("end", [Settle.SENT, Settle.UNKNOWN])
async def test_a_records_content_digest_is_kept_through_every_state(
        store: FingerprintStore, prefix: str, end: Settle) -> None:
    """PENDING, SENDING (and its renewal), then SENT in the store's own window and in another
    (Redis writes those two SENT values differently), or UNKNOWN: each carries the digest
    its reserve was given, and a later reserve finds it."""
    keys = [prefix + "own-window", prefix + "other-window"]
    token = new_token()
    await store.reserve(keys, token=token, lease_s=LEASE_S, content_digest=MINE)
    assert [(await store.inspect(k)).content_digest for k in keys] == [MINE, MINE]
    await store.settle([SettleOp(k, Settle.SENDING, lease_s=LEASE_S) for k in keys],
                       token=token, window_s=WINDOW_S)
    assert await store.renew(keys, token=token, lease_s=LEASE_S, window_s=WINDOW_S) == [
        True, True]
    sending = [await store.inspect(k) for k in keys]
    assert [(r.state, r.content_digest) for r in sending] == [(State.SENDING, MINE)] * 2
    await store.settle([SettleOp(keys[0], end, "250 ok"),
                        SettleOp(keys[1], end, "250 ok", window_s=WINDOW_S / 2)],
                       token=token, window_s=WINDOW_S)
    ended = [await store.inspect(k) for k in keys]
    assert [(r.state.value, r.content_digest) for r in ended] == [(end.value, MINE)] * 2
    found = await store.reserve(keys, token=new_token(), lease_s=LEASE_S, content_digest=THEIRS)
    assert [r.found.content_digest for r in found if r.found is not None] == [MINE, MINE]
    assert not any(r.reserved for r in found)


async def test_a_record_written_without_a_digest_and_an_operators_mark_have_none(
        store: FingerprintStore, prefix: str, db_path: str) -> None:
    """A reserve without a digest (a message without content, an earlier version) writes
    none; an operator's mark-sent and another application's value carry none either."""
    plain, marked, foreign, token = prefix + "p", prefix + "m", prefix + "f", new_token()
    await store.reserve([plain, marked], token=token, lease_s=LEASE_S)
    await store.settle([SettleOp(plain, Settle.SENT, "250 ok"),
                        SettleOp(marked, Settle.UNKNOWN)], token=token, window_s=WINDOW_S)
    await store.force_mark_sent(marked, reply="marked", window_s=WINDOW_S)
    await write_foreign(store, foreign, db_path)
    records = [await store.inspect(k) for k in (plain, marked, foreign)]
    assert [r.content_digest for r in records] == [None, None, None]


# (what the key holds, resend_unknown, replace_other_content, the reserve's digest, taken over)
TAKE_OVER_ROWS = [
    pytest.param("sent:theirs", False, True, MINE, True, id="sent-other-content-replaced"),
    pytest.param("sent:mine", False, True, MINE, False, id="sent-same-content-stays"),
    pytest.param("sent:theirs", False, False, MINE, False, id="other-content-no-replace"),
    pytest.param("sent:theirs", True, False, MINE, False, id="resend-unknown-leaves-sent"),
    pytest.param("sent:", False, True, MINE, False, id="sent-without-a-digest-stays"),
    pytest.param("sent:theirs", False, True, "", False, id="no-digest-replaces-none"),
    pytest.param("unknown:theirs", False, True, MINE, True, id="in-doubt-other-replaced"),
    pytest.param("unknown:mine", False, True, MINE, False, id="in-doubt-same-stays"),
    pytest.param("unknown:mine", True, False, MINE, True, id="in-doubt-resent"),
    pytest.param("unknown:", False, True, MINE, False, id="in-doubt-no-digest-stays"),
    pytest.param("pending:theirs", True, True, MINE, False, id="pending-stays"),
    pytest.param("sending:theirs", True, True, MINE, False, id="sending-in-flight-stays"),
    pytest.param("marked:", False, True, MINE, False, id="an-operators-mark-stays"),
    pytest.param("foreign:", True, True, MINE, False, id="a-foreign-value-stays"),
]


async def _write(store: FingerprintStore, key: str, held: str, db_path: str) -> None:
    """Make ``key`` hold ``held`` (``state:digest``, see TAKE_OVER_ROWS)."""
    state, _, digest = held.partition(":")
    content = {"theirs": THEIRS, "mine": MINE}.get(digest, "")
    if state == "foreign":
        await write_foreign(store, key, db_path)
        return
    token = new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S, content_digest=content)
    action = {"sent": Settle.SENT, "unknown": Settle.UNKNOWN, "sending": Settle.SENDING,
              "marked": Settle.UNKNOWN}.get(state)
    if action is not None:
        await store.settle([SettleOp(key, action, "250 ok", lease_s=LEASE_S)], token=token,
                           window_s=WINDOW_S)
    if state == "marked":
        await store.force_mark_sent(key, reply="marked", window_s=WINDOW_S)


@pytest.mark.parametrize(("held", "resend_unknown", "replace", "digest", "taken"),
                         TAKE_OVER_ROWS)
async def test_a_reserve_takes_over_what_the_rule_says(
        store: FingerprintStore, prefix: str, db_path: str, held: str, resend_unknown: bool,
        replace: bool, digest: str, taken: bool) -> None:
    """Each row: what the store does is what relay.core.rules.takes_over says of the record it
    found; a record taken over is this attempt's PENDING with the reserve's digest, and the
    reservation names what it replaced (its state and digest)."""
    key, token = prefix + "t", new_token()
    await _write(store, key, held, db_path)
    before = await store.inspect(key)
    [reservation] = await store.reserve([key], token=token, lease_s=LEASE_S,
                                        resend_unknown=resend_unknown, content_digest=digest,
                                        replace_other_content=replace)
    expected = takes_over(before, lease_s=LEASE_S, content_digest=digest,
                          resend_unknown=resend_unknown, replace_other_content=replace)
    assert expected is taken
    assert reservation.reserved is expected
    assert reservation.found is not None
    after = await store.inspect(key)
    if expected:
        assert (after.state, after.token, after.content_digest) == (
            State.PENDING, token, digest or None)
        assert reads_as(reservation.found, LEASE_S) is reads_as(before, LEASE_S)
        assert reservation.found.content_digest == before.content_digest
        assert reservation.found.at == pytest.approx(before.at, abs=0.01)
    else:
        assert (after.state, after.token, after.content_digest) == (
            before.state, before.token, before.content_digest)
        assert reservation.found.content_digest == before.content_digest


# ---------------------------------------------------------------------------------------------
# A rotated fingerprint secret (design.md §2.3): inspect_many reads the previous secret's keys
# in one round trip, and a reserve lets their records count (relay.core.rotation).
# ---------------------------------------------------------------------------------------------


async def test_inspect_many_reads_each_key_as_inspect_does(
        store: FingerprintStore, prefix: str, db_path: str) -> None:
    keys = {name: f"{prefix}{name}" for name in
            ("absent", "pending", "sending", "sent", "unknown", "foreign")}
    token = new_token()
    await store.reserve([keys[n] for n in ("pending", "sending", "sent", "unknown")],
                        token=token, lease_s=LEASE_S, content_digest=MINE)
    await store.settle([SettleOp(keys["sending"], Settle.SENDING, lease_s=LEASE_S),
                        SettleOp(keys["sent"], Settle.SENT, "250 ok"),
                        SettleOp(keys["unknown"], Settle.UNKNOWN)], token=token,
                       window_s=WINDOW_S)
    await write_foreign(store, keys["foreign"], db_path)
    asked = [*keys.values(), keys["sent"]]  # a key asked twice is read twice
    many = await store.inspect_many(asked)
    one = [await store.inspect(key) for key in asked]
    assert [(r.state, r.token, r.at, r.reply, r.content_digest) for r in many] == [
        (r.state, r.token, r.at, r.reply, r.content_digest) for r in one]
    assert [r.state for r in many] == [State.ABSENT, State.PENDING, State.SENDING, State.SENT,
                                       State.UNKNOWN, State.SENT, State.SENT]
    assert await store.inspect_many([]) == []


@pytest.mark.parametrize(("held", "resend_unknown", "counted", "released"), [
    pytest.param("sent:mine", False, State.SENT, True, id="sent-is-a-duplicate"),
    pytest.param("pending:mine", False, State.PENDING, True, id="pending-is-in-flight"),
    pytest.param("unknown:mine", False, State.UNKNOWN, True, id="in-doubt-answers"),
    pytest.param("unknown:mine", True, State.UNKNOWN, False, id="in-doubt-resent"),
    pytest.param("absent:", False, None, False, id="nothing-under-either-key"),
])
async def test_a_reserve_counts_the_record_under_the_previous_key(
        store: FingerprintStore, prefix: str, db_path: str, held: str,
        resend_unknown: bool, counted: State | None, released: bool) -> None:
    """The previous key holds ``held``; the current key nothing: the reservation is that
    record's (under the previous key), and this attempt's PENDING under the current key is
    to be released unless the reserve takes the previous record over."""
    key, previous, token = prefix + "current", prefix + "previous", new_token()
    if not held.startswith("absent"):
        await _write(store, previous, held, db_path)
    claim = Claim(token=token, lease_s=LEASE_S, content_digest=MINE,
                  resend_unknown=resend_unknown)
    [reservation], release = await rotation.reserve(store, [key], claim, {key: previous})
    assert release == ([key] if released else [])
    assert (await store.inspect(key)).token == token  # the core releases it
    if counted is None:
        assert reservation == Reservation(key, True)
        return
    assert reservation.under == previous and reservation.found is not None
    assert reads_as(reservation.found, LEASE_S) is counted
    assert reservation.reserved is not released


async def test_a_record_under_the_current_key_wins_over_the_previous_one(
        store: FingerprintStore, prefix: str, db_path: str) -> None:
    key, previous = prefix + "current", prefix + "previous"
    await _write(store, key, "sent:mine", db_path)
    await _write(store, previous, "unknown:mine", db_path)
    claim = Claim(token=new_token(), lease_s=LEASE_S, resend_unknown=True)
    [reservation], release = await rotation.reserve(store, [key], claim, {key: previous})
    assert release == [] and reservation.under is None and not reservation.reserved
    assert reservation.found is not None and reservation.found.state is State.SENT
