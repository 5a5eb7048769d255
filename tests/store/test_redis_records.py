"""The Redis records of a SENT fingerprint (relay/store/redis/scripts.py): one byte (12 with the
content digest), dated by its expiry; the values of earlier versions still read as they did (a
rolling upgrade)."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from uuid import uuid4

import pytest
import redis.asyncio

from relay.core.interfaces import Settle, SettleOp, State
from relay.store.redis.store import RedisStore

REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
WINDOW_S = 3600.0
LEASE_S = 60.0


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"test:{uuid4().hex}:"


@pytest.fixture
async def raw() -> AsyncIterator[redis.asyncio.Redis]:
    """A plain client of the test Redis (values as stored)."""
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()


@pytest.fixture
async def store(prefix: str, raw: redis.asyncio.Redis) -> AsyncIterator[RedisStore]:
    """A store whose window is ``WINDOW_S``; keys under ``prefix`` deleted afterwards."""
    opened = RedisStore.from_url(REDIS_URL, window_s=WINDOW_S)
    yield opened
    await opened.close()
    async for key in raw.scan_iter(match=f"{prefix}*"):
        await raw.delete(key)


async def _sent(store: RedisStore, key: str, window_s: float = WINDOW_S) -> None:
    token = uuid4().hex
    assert (await store.reserve([key], token=token, lease_s=LEASE_S))[0].reserved
    reply = "250 2.0.0 Ok: queued as 4F2A91C0DE " + "x" * 200
    assert await store.settle([SettleOp(key, Settle.SENT, reply)], token=token,
                              window_s=window_s) == [True]


async def test_a_sent_record_is_one_byte_dated_by_its_expiry(
        store: RedisStore, raw: redis.asyncio.Redis, prefix: str) -> None:
    """Size rule: the SENT value is ``0`` (a Redis shared integer: no allocation of its own),
    whatever the upstream's reply; a retry still reads the send time (the expiry less the
    window, in the server's clock) for its "original sent" reply."""
    key, before = prefix + "a", time.time()
    await _sent(store, key)
    after = time.time()
    assert await raw.get(key) == b"0"
    assert await raw.object("encoding", key) == b"int"
    [found] = await store.reserve([key], token=uuid4().hex, lease_s=LEASE_S)
    assert not found.reserved and found.found is not None
    assert found.found.state is State.SENT and found.found.reply is None
    assert found.found.at is not None and within(found.found.at, before, after)
    record = await store.inspect(key)
    assert record.at is not None and within(record.at, before, after)
    assert record.age_s is not None and 0 <= record.age_s < time.time() - before + 1


def within(at: float, before: float, after: float) -> bool:
    """``at`` (unix seconds) lies between ``before`` and ``after``, give or take 1 s (a
    record's time is the server's, in whole seconds or milliseconds)."""
    return before - 1.0 <= at <= after + 1.0


async def test_a_settle_with_another_window_dates_its_record_itself(
        store: RedisStore, raw: redis.asyncio.Redis, prefix: str) -> None:
    """A SENT mark whose window is not the store's cannot be dated by its expiry: it keeps
    its time (``S|<ms>|``)."""
    key, before = prefix + "a", time.time()
    await _sent(store, key, window_s=60)
    after = time.time()
    value = await raw.get(key)
    assert isinstance(value, bytes) and value.startswith(b"S|") and value.endswith(b"|")
    record = await store.inspect(key)
    assert record.state is State.SENT and record.at is not None
    assert within(record.at, before, after)


@pytest.mark.parametrize(("value", "at", "reply"), [
    (b"S|1796000000123|250 2.0.0 Ok: queued as 4F2A", 1796000000.123,
     "250 2.0.0 Ok: queued as 4F2A"),
    (b"S|1796000000123|", 1796000000.123, None),
    (b"1", None, None),  # another application's
])
async def test_values_of_earlier_versions_still_read_as_sent(
        store: RedisStore, raw: redis.asyncio.Redis, prefix: str, value: bytes,
        at: float | None, reply: str | None) -> None:
    """A rolling upgrade: what the previous version wrote (``S|<ms>|<reply>``) is SENT at its
    own time with its reply, to a reserve and to inspect."""
    key = prefix + "old"
    await raw.set(key, value, px=int(WINDOW_S * 1000))
    [found] = await store.reserve([key], token=uuid4().hex, lease_s=LEASE_S)
    assert not found.reserved and found.found is not None
    assert (found.found.state, found.found.at, found.found.reply) == (State.SENT, at, reply)
    record = await store.inspect(key)
    assert (record.state, record.at, record.reply) == (State.SENT, at, reply)


DIGEST = "AbCdEf0123"  # a stored content digest: 10 characters (relay.core.key_rules)


async def test_a_sent_record_with_its_digest_is_twelve_bytes_in_one_small_allocation(
        store: RedisStore, raw: redis.asyncio.Redis, prefix: str) -> None:
    """``0#<digest>``: an embedded string of 12 bytes, the most that fits jemalloc's 32-byte
    class (robj 16 + sds header 3 + 12 + NUL 1); ``0`` is a shared integer (no allocation,
    though MEMORY USAGE counts its 16-byte object). Still dated by its expiry."""
    plain, digested, before = prefix + "plain-0", prefix + "digests", time.time()
    await _sent(store, plain)
    token = uuid4().hex
    await store.reserve([digested], token=token, lease_s=LEASE_S, content_digest=DIGEST)
    await store.settle([SettleOp(digested, Settle.SENT, "250 ok")], token=token,
                       window_s=WINDOW_S)
    value = await raw.get(digested)
    assert value == b"0#" + DIGEST.encode()
    # one allocation (embstr: the robj and its sds together) of at most 16 + 3 + 12 + 1 bytes;
    # MEMORY USAGE is not compared: it also counts the key name's and the entry's allocations,
    # which a shared server under load does not keep the same from one key to the next
    assert await raw.object("encoding", digested) == b"embstr"
    assert 16 + 3 + len(value) + 1 <= 32, value
    assert await raw.object("encoding", plain) == b"int"
    record = await store.inspect(digested)
    assert record.at is not None and within(record.at, before, time.time())
    assert record.content_digest == DIGEST
