"""One contract for every FingerprintStore (DESIGN section 3), run against Redis and SQLite.

The Redis store talks to the real server at ``RELAY_TEST_REDIS_URL`` (default
``redis://127.0.0.1:6379/0``); every test works under its own random key prefix and deletes its
keys afterwards. Faults come from real fakes: a closed port, and a tiny RESP server on port 0
that answers (or not) as the test chooses. The SQLite store uses a file under ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from uuid import uuid4

import pytest
import redis.asyncio

from relay.errors import StoreError
from relay.interfaces import FingerprintStore, Record, Settle, SettleOp, State
from relay.store_redis import RedisStore, decode_value
from relay.store_sqlite import SqliteStore, sqlite_path_from_url

REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
LEASE_S = 60.0
WINDOW_S = 3600.0


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"test:{uuid4().hex}:"


@pytest.fixture
def db_path(tmp_path: Path) -> str:
    """The SQLite file of this test."""
    return str(tmp_path / "store.db")


@pytest.fixture(params=["redis", "sqlite"])
async def store(
    request: pytest.FixtureRequest, prefix: str, db_path: str
) -> AsyncIterator[FingerprintStore]:
    """Each store in turn; Redis keys under ``prefix`` are deleted afterwards."""
    if request.param == "sqlite":
        sqlite_store = await SqliteStore.open(db_path)
        yield sqlite_store
        await sqlite_store.close()
        return
    redis_store = RedisStore.from_url(REDIS_URL)
    yield redis_store
    await redis_store.close()
    client = redis.asyncio.from_url(REDIS_URL)
    async for key in client.scan_iter(match=f"{prefix}*"):
        await client.delete(key)
    await client.aclose()


async def write_foreign(store: FingerprintStore, key: str, db_path: str) -> None:
    """Write what another application would: ``1`` in Redis, a row of unknown state in SQLite."""
    if isinstance(store, RedisStore):
        client = redis.asyncio.from_url(REDIS_URL)
        await client.set(key, "1")
        await client.aclose()
        return
    with contextlib.closing(sqlite3.connect(db_path)) as conn, conn:
        conn.execute(
            "INSERT INTO fingerprints (key, state, token, at_ms, reply, expires_at_ms) "
            "VALUES (?, '1', NULL, NULL, NULL, NULL)",
            (key,),
        )


def new_token() -> str:
    """A fresh attempt token, as the core makes them (128 random bits, hex)."""
    return uuid4().hex


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
    """Settling SENT with the right token stores the time, the reply and a TTL of the window."""
    key, token, now = prefix + "a", new_token(), time.time()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    done = await store.settle(
        [SettleOp(key, Settle.SENT, "250 2.0.0 Ok: queued as 4F2A")],
        token=token,
        window_s=WINDOW_S,
        now=now,
    )
    assert done == [True]
    record = await store.inspect(key)
    assert record.state is State.SENT
    assert record.token is None
    assert record.at == pytest.approx(now, abs=0.002)
    assert record.reply == "250 2.0.0 Ok: queued as 4F2A"
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
        [SettleOp(key, action, "250 ok")], token=new_token(), window_s=WINDOW_S, now=time.time()
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
        [SettleOp(key, Settle.RELEASE)], token=token, window_s=WINDOW_S, now=time.time()
    )
    assert done == [True]
    assert (await store.inspect(key)).state is State.ABSENT
    [again] = await store.reserve([key], token=new_token(), lease_s=LEASE_S)
    assert again.reserved


async def test_mark_unknown_records_time_and_window(store: FingerprintStore, prefix: str) -> None:
    """Settling UNKNOWN stores the attempt's time with a TTL of the window, and blocks reserves."""
    key, token, now = prefix + "a", new_token(), time.time()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    done = await store.settle(
        [SettleOp(key, Settle.UNKNOWN)], token=token, window_s=WINDOW_S, now=now
    )
    assert done == [True]
    [reservation] = await store.reserve([key], token=new_token(), lease_s=LEASE_S)
    assert not reservation.reserved
    found = reservation.found
    assert found is not None
    assert found.state is State.UNKNOWN
    assert found.at == pytest.approx(now, abs=0.002)
    assert found.ttl_s is not None
    assert WINDOW_S - 10 < found.ttl_s <= WINDOW_S


async def test_reserve_after_sent_finds_sent_with_reply(
    store: FingerprintStore, prefix: str
) -> None:
    """A reserve of a SENT key is refused and reports the send's time and reply."""
    key, token, now = prefix + "a", new_token(), time.time()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    await store.settle([SettleOp(key, Settle.SENT, "250 ok")], token=token, window_s=60, now=now)
    [reservation] = await store.reserve([key], token=new_token(), lease_s=LEASE_S)
    assert not reservation.reserved
    assert reservation.found is not None
    assert reservation.found.state is State.SENT
    assert reservation.found.reply == "250 ok"
    assert reservation.found.at == pytest.approx(now, abs=0.002)


@pytest.mark.parametrize("reply", ["", "250 2.0.0 a|b|c", "250 accepté ✓", "250 bad \udcff"])
async def test_reply_text_round_trips(store: FingerprintStore, prefix: str, reply: str) -> None:
    """The reply kept with SENT comes back as given (unencodable characters as U+FFFD)."""
    key, token = prefix + "a", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    await store.settle(
        [SettleOp(key, Settle.SENT, reply)], token=token, window_s=WINDOW_S, now=time.time()
    )
    expected = reply.encode("utf-8", "replace").decode("utf-8")
    assert (await store.inspect(key)).reply == expected


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
        [SettleOp(key, Settle.RELEASE)], token=new_token(), window_s=WINDOW_S, now=time.time()
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
        [SettleOp(key, Settle.SENT, "250 ok")], token=old, window_s=WINDOW_S, now=time.time()
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
    done = await store.settle(ops, token=token, window_s=WINDOW_S, now=time.time())
    assert done == [False, True, False]
    assert (await store.inspect(held)).state is State.PENDING
    assert (await store.inspect(free)).state is State.SENT
    assert (await store.inspect(absent)).state is State.ABSENT


async def test_empty_calls_return_empty_lists(store: FingerprintStore) -> None:
    """Reserving no keys and settling no ops return empty lists."""
    assert await store.reserve([], token=new_token(), lease_s=LEASE_S) == []
    assert await store.settle([], token=new_token(), window_s=WINDOW_S, now=time.time()) == []


async def test_force_release_deletes_whatever_is_there(
    store: FingerprintStore, prefix: str
) -> None:
    """force_release deletes a SENT key and returns True; on an absent key it returns False."""
    key, token = prefix + "a", new_token()
    await store.reserve([key], token=token, lease_s=LEASE_S)
    await store.settle(
        [SettleOp(key, Settle.SENT, "250 ok")], token=token, window_s=WINDOW_S, now=time.time()
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
    "settle": lambda s: s.settle([SettleOp("k", Settle.RELEASE)], token="t", window_s=1, now=0),
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
        assert time.monotonic() - started < 1.0
        await store.close()


async def test_redis_reloads_script_after_noscript() -> None:
    """A script the server lost (NOSCRIPT) is loaded again and the call still succeeds."""
    seen: list[bytes] = []

    def answer(command: list[bytes]) -> Reply:
        seen.append(command[0].upper())
        if command[0].upper() == b"SCRIPT":
            return b"$40\r\n" + b"0" * 40 + b"\r\n"
        if seen.count(b"EVALSHA") == 1:
            return b"-NOSCRIPT No matching script. Please use EVAL.\r\n"
        return b":1\r\n"

    async with fake_redis(answer) as url:
        store = RedisStore.from_url(url, op_timeout_s=1)
        [reservation] = await store.reserve(["k"], token="t", lease_s=1)
        await store.close()
    assert reservation.reserved
    assert seen == [b"EVALSHA", b"SCRIPT", b"EVALSHA"]


@pytest.mark.parametrize(
    ("config_reply", "warning_part"),
    [
        (b"%1\r\n$16\r\nmaxmemory-policy\r\n$11\r\nallkeys-lru\r\n", "'allkeys-lru'"),
        (b"-ERR unknown command 'CONFIG'\r\n", "could not check"),
        (b"%0\r\n", "could not check"),
    ],
)
async def test_redis_check_server_warns(config_reply: bytes, warning_part: str) -> None:
    """check_server warns when maxmemory-policy evicts or cannot be read."""
    async with fake_redis(lambda command: config_reply) as url:
        store = RedisStore.from_url(url, op_timeout_s=1)
        warnings = await store.check_server()
        await store.close()
    assert len(warnings) == 1
    assert warning_part in warnings[0]


async def test_redis_check_server_quiet_on_noeviction() -> None:
    """check_server returns no warning when maxmemory-policy is noeviction."""
    reply = b"%1\r\n$16\r\nmaxmemory-policy\r\n$10\r\nnoeviction\r\n"
    async with fake_redis(lambda command: reply) as url:
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
    """RedisStore.from_url refuses a URL that is not redis://, rediss:// or unix://."""
    with pytest.raises(ValueError, match="scheme"):
        RedisStore.from_url("http://127.0.0.1:6379/0")


# ---------------------------------------------------------------------------------------------
# SQLite only
# ---------------------------------------------------------------------------------------------


async def test_sqlite_survives_reopen(db_path: str) -> None:
    """A SENT record written before the store closes is there after reopening the file."""
    store = await SqliteStore.open(db_path)
    token, now = new_token(), time.time()
    await store.reserve(["k"], token=token, lease_s=LEASE_S)
    await store.settle([SettleOp("k", Settle.SENT, "250 ok")], token=token, window_s=60, now=now)
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
    first, second = await SqliteStore.open(db_path), await SqliteStore.open(db_path)
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
        assert time.monotonic() - started < 1.0
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
