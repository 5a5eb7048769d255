"""Rate limits on Redis (design.md §4.7): :class:`RedisRateLimiter` implements
:class:`relay.core.interfaces.RateLimiter` with one Lua script per message.

Each bucket is a sliding-window log: a sorted set under
``<prefix>rl:{rl}:<label>:<sha256 of the bucket, 32 hex>`` whose members are the calls that
took units (``<cost>|<call token>|<n>``, scored by the Redis server's time in ms), and the
units they hold in all under the same key plus ``:n``. A call trims what left the window
(subtracting it from the total), compares the total plus its cost with the limit and, only when
every bucket has room, adds its member to all of them; both keys expire one window after
their last write, so nothing outlives its window. A call costs O(log n) plus the members that
left the window since the last call, never a scan of the window. At most ``limit`` units are
taken in any ``per`` seconds, whatever the relays' clocks say (the script reads TIME; Redis
>= 5 replicates scripts by their effects).

Redis Cluster: one message's buckets must be in one slot for one atomic script, so every
limit key carries the hash tag ``{rl}``: all the relay's limit keys live on one node (a few
small sorted sets; the cost is that this node takes every message's limit call). The writes
are not waited on by replicas (no WAIT): a failover may forget the units of the last moments
and let up to one window's worth through again, never refuse more.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from relay.core.cancellation import run_to_end
from relay.core.errors import StoreError
from relay.core.interfaces import LimitCheck, LimitVerdict
from relay.store.redis.clients import Client

_ERROR_TEXT_MAX = 300

log = logging.getLogger("relay.store.redis.limits")

# KEYS[2i-1] - the sorted set of the i-th check's bucket: one member per call that took units
#              (``<cost>|<call token>|<i>``), scored by the server's time in ms
# KEYS[2i]    - the units its members hold in all (a string), so a call never sums the set
# KEYS[#KEYS] - the call's tombstone (:func:`tombstone_key`): set by GIVE_BACK_LUA
# ARGV[1] - a token unique to the call (members of one call differ from every other's)
# ARGV[3i-1], ARGV[3i], ARGV[3i+1] - the i-th check's window (ms), limit and cost
# return {0, 0} when every check had room and took its cost; otherwise {i, ms}: the i-th
# check refused (nothing was taken from any bucket) and has room again in ms milliseconds
# (-1: its cost alone is over its limit). Cost: the members that left the window since the
# last call, plus, for a refusal, the few oldest members that must leave for it to fit.
# Idempotent for its token: a call that took its units already (the client sent it again after
# a lost reply) or that was given back (its caller timed out first) takes nothing, {0, 0}.
ACQUIRE_LUA = """
if redis.call('EXISTS', KEYS[#KEYS]) == 1
        or redis.call('ZSCORE', KEYS[1], ARGV[4] .. '|' .. ARGV[1] .. '|1') then
    return {0, 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function cost_of(member)
    return tonumber(string.match(member, '^(%d+)|')) or 1
end
local function used_in(set, total, window)
    local used = tonumber(redis.call('GET', total) or '0') or 0
    local gone = redis.call('ZRANGEBYSCORE', set, '-inf', now - window)
    if #gone > 0 then
        for j = 1, #gone do
            used = used - cost_of(gone[j])
        end
        redis.call('ZREMRANGEBYSCORE', set, '-inf', now - window)
    end
    if used <= 0 or redis.call('EXISTS', set) == 0 then
        used = 0  -- the set is empty (or gone without its total): start over
        redis.call('DEL', set, total)
    elseif #gone > 0 then
        redis.call('SET', total, used, 'KEEPTTL')
    end
    return used
end
for i = 1, (#KEYS - 1) / 2 do
    local set, total = KEYS[2 * i - 1], KEYS[2 * i]
    local window = tonumber(ARGV[3 * i - 1])
    local limit = tonumber(ARGV[3 * i])
    local cost = tonumber(ARGV[3 * i + 1])
    local used = used_in(set, total, window)
    if cost > limit then
        return {i, -1}
    end
    if used + cost > limit then
        -- room once the oldest members holding ``need`` units left (each holds at least 1)
        local need = used + cost - limit
        local oldest = redis.call('ZRANGE', set, 0, need - 1, 'WITHSCORES')
        local freed = 0
        for j = 1, #oldest, 2 do
            freed = freed + cost_of(oldest[j])
            if freed >= need then
                return {i, math.max(1, tonumber(oldest[j + 1]) + window - now)}
            end
        end
        return {i, window}
    end
end
for i = 1, (#KEYS - 1) / 2 do
    local set, total = KEYS[2 * i - 1], KEYS[2 * i]
    local window, cost = ARGV[3 * i - 1], ARGV[3 * i + 1]
    redis.call('ZADD', set, now, cost .. '|' .. ARGV[1] .. '|' .. i)
    redis.call('INCRBY', total, cost)
    redis.call('PEXPIRE', set, window)
    redis.call('PEXPIRE', total, window)
end
return {0, 0}
"""

# KEYS as ACQUIRE_LUA's; ARGV[1] - the call's token, ARGV[2] - how long the tombstone lives
# (ms: the longest window), ARGV[2 + i] - the i-th check's cost. Takes back what the call took
# (a member of its token, and its units from the total) and leaves the tombstone, so a call
# that reaches Redis only after this takes nothing. Returns 1.
GIVE_BACK_LUA = """
for i = 1, (#KEYS - 1) / 2 do
    local set, total = KEYS[2 * i - 1], KEYS[2 * i]
    local cost = ARGV[2 + i]
    if redis.call('ZREM', set, cost .. '|' .. ARGV[1] .. '|' .. i) == 1
            and redis.call('EXISTS', total) == 1 then
        redis.call('DECRBY', total, cost)
    end
end
redis.call('SET', KEYS[#KEYS], '1', 'PX', ARGV[2])
return 1
"""

_TRANSLATED = (RedisError, RedisClusterException, OSError, UnicodeError)


def tombstone_key(first_key: str, token: str) -> str:
    """The key that marks the call ``token`` given back: beside its first bucket's sorted set
    ``first_key`` (the same ``{rl}`` slot)."""
    return f"{first_key}:x:{token}"


def limit_key(prefix: str, check: LimitCheck) -> str:
    """The sorted set of ``check``'s bucket: ``<prefix>rl:{rl}:<label>:<32 hex>`` (the hash
    tag keeps one message's buckets in one cluster slot; the bucket's value is hashed); its
    total is the same key with ``:n`` appended."""
    digest = hashlib.sha256(check.bucket.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return f"{prefix}rl:{{rl}}:{check.label}:{digest}"


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class RedisRateLimiter:
    """:class:`relay.core.interfaces.RateLimiter` on the store's Redis ``client`` (one server,
    Sentinel's master or a cluster), keys under ``prefix``; ``op_timeout_s`` bounds a call.
    Raises :class:`relay.core.errors.StoreError` (op ``rate_limit``)."""

    def __init__(self, *, client: Client, prefix: str, op_timeout_s: float = 2.0) -> None:
        self._client = client
        self._prefix = prefix
        self._op_timeout_s = op_timeout_s
        self._script = client.register_script(ACQUIRE_LUA)
        self._give_back_script = client.register_script(GIVE_BACK_LUA)

    async def acquire(self, checks: Sequence[LimitCheck]) -> LimitVerdict:
        """Take every check's cost or none, in one script (see the module docstring)."""
        if not checks:
            return LimitVerdict(allowed=True)
        keys: list[str] = []
        for check in checks:
            key = limit_key(self._prefix, check)
            keys += [key, f"{key}:n"]
        token = secrets.token_hex(8)
        keys.append(tombstone_key(keys[0], token))
        args: list[str | int] = [token]
        for check in checks:
            args += [_ms(check.per_s), check.limit, check.cost]
        try:
            async with asyncio.timeout(self._op_timeout_s):
                result = await self._run(self._script, keys, args)
        except TimeoutError as exc:
            await self._give_back(keys, token, checks)
            raise StoreError("rate_limit", f"redis did not answer within "
                                           f"{self._op_timeout_s:g} s") from exc
        except _TRANSLATED as exc:
            await self._give_back(keys, token, checks)
            raise StoreError("rate_limit",
                             f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT_MAX]) from exc
        except asyncio.CancelledError:
            # a shutdown cut the call: its message is answered 4yz and never sent, so what
            # the script took (or takes when it lands later) is given back, to the end
            await run_to_end(asyncio.ensure_future(self._give_back(keys, token, checks)))
            raise
        index, wait_ms = int(result[0]), int(result[1])
        if index == 0:
            return LimitVerdict(allowed=True)
        return LimitVerdict(allowed=False, refused=checks[index - 1],
                            retry_after_s=None if wait_ms < 0 else wait_ms / 1000)

    async def _give_back(self, keys: list[str], token: str,
                         checks: Sequence[LimitCheck]) -> None:
        """Undo whatever of the failed call ``token`` landed or may still land (its message is
        answered 4yz and not sent, so its units must not count), within ``op_timeout_s``; a
        Redis that does not answer keeps them: they leave with their window."""
        args: list[str | int] = [token, max(_ms(c.per_s) for c in checks),
                                 *(c.cost for c in checks)]
        try:
            async with asyncio.timeout(self._op_timeout_s):
                await self._run(self._give_back_script, keys, args)
        except (TimeoutError, *_TRANSLATED) as exc:
            log.warning("rate limit: cannot give back the units of a failed call (%s): they "
                        "count until their window ends", type(exc).__name__)

    async def _run(self, script: Any, keys: list[str], args: list[str | int]) -> Any:
        """EVALSHA, or EVAL when the server does not know the script (restarted, flushed,
        a node never used before)."""
        try:
            return await self._client.execute_command(
                "EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self._client.execute_command(
                "EVAL", script.script, len(keys), *keys, *args)
