"""The reserve script's judgement of a SENDING record (relay/store/redis/scripts.py,
``SENDING_IN_DOUBT_LUA``) against its reference, :func:`relay.core.rules.heartbeat_state`:
every row of the rule's table (tests/support/heartbeat_rows.py) through the Lua function on a real
Redis at a fixed server time, and a fresh and a stale record through the reserve script itself
(keys under a prefix no other test uses)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from uuid import uuid4

import pytest
import redis.asyncio

from relay.core.interfaces import State
from relay.core.rules import heartbeat_state
from relay.store.redis.scripts import RESERVE_LUA, SENDING_IN_DOUBT_LUA
from tests.support.heartbeat_rows import HEARTBEAT

REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
NOW_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z, the server time the function is given
JUDGE_LUA = SENDING_IN_DOUBT_LUA + """
if sending_in_doubt(ARGV[1], tonumber(ARGV[2]), ARGV[3]) then
    return 1
end
return 0
"""


@pytest.fixture
async def raw() -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    yield client
    await client.aclose()


def sending_value(age_ms: int, own_lease_ms: int | None) -> str:
    """The SENDING value whose last heartbeat is ``age_ms`` before ``NOW_MS``."""
    value = f"D|token|{NOW_MS - age_ms}"
    return value if own_lease_ms is None else f"{value}|{own_lease_ms}"


@pytest.mark.parametrize(("age_s", "own_lease_s", "lease_s", "expected"), HEARTBEAT)
async def test_the_lua_twin_judges_as_the_rule(
        raw: redis.asyncio.Redis, age_s: float, own_lease_s: float | None, lease_s: float,
        expected: State) -> None:
    """The rule's rows in the script's unit (ms, whole)."""
    age_ms, lease_ms = round(age_s * 1000), round(lease_s * 1000)
    own_lease_ms = None if own_lease_s is None else round(own_lease_s * 1000)
    assert heartbeat_state(age_ms, own_lease_ms, lease_ms) is expected
    in_doubt = await raw.eval(JUDGE_LUA, 0, sending_value(age_ms, own_lease_ms),
                              NOW_MS, lease_ms)
    assert bool(in_doubt) is (expected is State.UNKNOWN)


@pytest.mark.parametrize("value", ["P|token", "U|1", "0", "S|1|250 ok", "D||1|1", "D|t|x"])
async def test_the_lua_twin_finds_no_doubt_in_another_value(
        raw: redis.asyncio.Redis, value: str) -> None:
    assert await raw.eval(JUDGE_LUA, 0, value, NOW_MS, 1) == 0


@pytest.mark.parametrize(("own_lease_ms", "age_ms", "taken_over"), [
    pytest.param(60_000, 1_000, False, id="fresh-stays"),
    pytest.param(60_000, 3_600_000, True, id="stale-is-taken-over"),
    pytest.param(None, 1_000, False, id="fresh-without-a-lease-of-its-own-stays"),
    pytest.param(None, 3_600_000, True, id="stale-without-a-lease-of-its-own-is-taken-over"),
])
async def test_the_reserve_script_takes_over_what_the_rule_reads_as_in_doubt(
        raw: redis.asyncio.Redis, own_lease_ms: int | None, age_ms: int,
        taken_over: bool) -> None:
    """The server's clock: the heartbeat is dated ``age_ms`` before the server's TIME (the
    margins dwarf the round trips between)."""
    key = f"test:{uuid4().hex}:sending"
    seconds, micros = await raw.time()
    beat_ms = seconds * 1000 + micros // 1000 - age_ms
    value = f"D|other|{beat_ms}" + ("" if own_lease_ms is None else f"|{own_lease_ms}")
    lease_ms = 60_000
    try:
        await raw.set(key, value, px=3_600_000)
        result = await raw.eval(RESERVE_LUA, 1, key, "mine", lease_ms, "1")
        _value, _pttl, took_over, server_ms = result
        expected = heartbeat_state(int(server_ms) - beat_ms, own_lease_ms, lease_ms)
        assert (expected is State.UNKNOWN) is taken_over
        assert bool(took_over) is taken_over
        assert await raw.get(key) == (b"P|mine" if taken_over else value.encode())
    finally:
        await raw.delete(key)
