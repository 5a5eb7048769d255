"""Redis fingerprint store: every transition is one Lua script on one key (DESIGN section 3).

Values under a key (the caller builds the key, prefix included)::

    P|<token>                        PENDING of the attempt holding <token>, TTL = lease
    S|<unix_ms>|<upstream reply>     SENT at <unix_ms>, TTL = dedup window
    U|<unix_ms>                      UNKNOWN since <unix_ms>, TTL = dedup window
    anything else (e.g. ``1``)       written by another application: counts as SENT

Each script touches ``KEYS[1]`` only, so the store works on Redis Cluster without hash tags. A
message's keys are reserved in one pipeline (one round trip) and settled in another. Every redis,
socket and timeout error is translated into :class:`relay.errors.StoreError` here, at the
adapter boundary; callers never see a redis-py exception.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.asyncio
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError, ResponseError

from relay.errors import StoreError
from relay.interfaces import Record, Reservation, Settle, SettleOp, State

# KEYS[1] - the fingerprint key
# ARGV[1] - the attempt's token
# ARGV[2] - the lease in milliseconds
# return 1 if KEYS[1] now holds PENDING(token) ("P|" .. token) of this attempt: created now, or by
# an earlier call with the same token (so a retried reserve is idempotent); otherwise the pair
# {value, pttl}: the value found ("" when the key holds a non-string type) and its remaining
# lifetime in milliseconds (-1: no expiry)
_RESERVE_LUA = """
local mine = 'P|' .. ARGV[1]
if redis.call('SET', KEYS[1], mine, 'NX', 'PX', ARGV[2]) then
    return 1
end
local value = redis.pcall('GET', KEYS[1])
if type(value) ~= 'string' then
    value = ''
end
if value == mine then
    return 1
end
return {value, redis.call('PTTL', KEYS[1])}
"""

# KEYS[1] - the fingerprint key
# ARGV[1] - the attempt's token
# ARGV[2] - the send time, unix milliseconds
# ARGV[3] - the upstream reply text
# ARGV[4] - the dedup window in milliseconds (TTL of the SENT value)
# return 1 if KEYS[1] held PENDING(token) and now holds SENT, otherwise 0 (nothing changed)
_MARK_SENT_LUA = """
if redis.pcall('GET', KEYS[1]) ~= 'P|' .. ARGV[1] then
    return 0
end
redis.call('SET', KEYS[1], 'S|' .. ARGV[2] .. '|' .. ARGV[3], 'PX', ARGV[4])
return 1
"""

# KEYS[1] - the fingerprint key
# ARGV[1] - the attempt's token
# ARGV[2] - the time of the in-doubt attempt, unix milliseconds
# ARGV[3] - the dedup window in milliseconds (TTL of the UNKNOWN value)
# return 1 if KEYS[1] held PENDING(token) and now holds UNKNOWN, otherwise 0 (nothing changed)
_MARK_UNKNOWN_LUA = """
if redis.pcall('GET', KEYS[1]) ~= 'P|' .. ARGV[1] then
    return 0
end
redis.call('SET', KEYS[1], 'U|' .. ARGV[2], 'PX', ARGV[3])
return 1
"""

# KEYS[1] - the fingerprint key
# ARGV[1] - the attempt's token
# return 1 if KEYS[1] held PENDING(token) and was deleted, otherwise 0 (nothing changed)
_RELEASE_LUA = """
if redis.pcall('GET', KEYS[1]) ~= 'P|' .. ARGV[1] then
    return 0
end
redis.call('DEL', KEYS[1])
return 1
"""

_ERROR_TEXT_MAX = 300  # characters of a redis error kept in StoreError (pipeline errors are long)

_ScriptCall = tuple[AsyncScript, str, tuple[str | int | bytes, ...]]


def _ms(seconds: float) -> int:
    """Convert a duration in seconds to whole milliseconds, at least 1 ms."""
    return max(1, int(seconds * 1000))


def _reply_bytes(reply: str) -> bytes:
    """Encode an upstream reply as UTF-8, replacing what cannot be encoded (lone surrogates)."""
    return reply.encode("utf-8", "replace")


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def decode_value(value: bytes, pttl_ms: int | None = None) -> Record:
    """Turn a raw value and its PTTL (milliseconds, negative: none) into a :class:`Record`.

    A value that is not one of the relay's encodings counts as SENT with ``at`` and ``reply``
    unknown (DESIGN section 3). Never raises.
    """
    ttl_s = pttl_ms / 1000 if pttl_ms is not None and pttl_ms >= 0 else None
    tag, sep, rest = value.partition(b"|")
    if sep and tag == b"P" and rest:
        return Record(State.PENDING, token=_text(rest), ttl_s=ttl_s)
    if sep and tag == b"S":
        at_ms, sep2, reply = rest.partition(b"|")
        if sep2 and at_ms.isdigit():
            return Record(State.SENT, at=int(at_ms) / 1000, reply=_text(reply), ttl_s=ttl_s)
    if sep and tag == b"U" and rest.isdigit():
        return Record(State.UNKNOWN, at=int(rest) / 1000, ttl_s=ttl_s)
    return Record(State.SENT, ttl_s=ttl_s)


def _reservation(key: str, result: Any) -> Reservation:
    """Interpret one reserve script result (see ``_RESERVE_LUA``)."""
    if result == 1:
        return Reservation(key=key, reserved=True)
    value, pttl_ms = result
    return Reservation(key=key, reserved=False, found=decode_value(bytes(value), int(pttl_ms)))


def _setting(config: Any, name: str) -> str | None:
    """Read ``name`` from a CONFIG GET answer, whose keys and values may be bytes or str."""
    if not isinstance(config, dict):
        return None
    for raw_key, raw_value in config.items():
        key = _text(raw_key) if isinstance(raw_key, bytes) else str(raw_key)
        if key.lower() == name:
            return _text(raw_value) if isinstance(raw_value, bytes) else str(raw_value)
    return None


@contextlib.asynccontextmanager
async def _translated(op: str, timeout_s: float) -> AsyncIterator[None]:
    """Bound the body by ``timeout_s`` seconds; raise every failure as ``StoreError(op, ...)``."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError as exc:
        raise StoreError(op, f"redis did not answer within {timeout_s:g} s") from exc
    # UnicodeError: redis-py encodes str arguments strictly (a key holding a lone surrogate)
    except (RedisError, OSError, UnicodeError) as exc:
        text = f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT_MAX]
        raise StoreError(op, text) from exc


class RedisStore:
    """:class:`relay.interfaces.FingerprintStore` on Redis (or a Redis-compatible server).

    ``client`` is owned by the store from now on (``close`` closes it); it must be created with
    ``decode_responses=False``. ``op_timeout_s`` bounds every operation, in seconds, connect and
    retries included. Every method raises :class:`relay.errors.StoreError` on any failure.
    """

    def __init__(self, *, client: redis.asyncio.Redis, op_timeout_s: float = 2.0) -> None:
        self._client = client
        self._op_timeout_s = op_timeout_s
        self._reserve_script = client.register_script(_RESERVE_LUA)
        self._mark_sent_script = client.register_script(_MARK_SENT_LUA)
        self._mark_unknown_script = client.register_script(_MARK_UNKNOWN_LUA)
        self._release_script = client.register_script(_RELEASE_LUA)

    @classmethod
    def from_url(cls, url: str, *, op_timeout_s: float = 2.0) -> RedisStore:
        """Build a store from a ``redis://``, ``rediss://`` (TLS) or ``unix://`` URL.

        Socket connect and read timeouts are ``op_timeout_s`` seconds. Nothing is connected yet.
        Raises :class:`ValueError` for another scheme or a malformed URL.
        """
        scheme = url.partition("://")[0].lower()
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"store URL scheme {scheme!r} is not redis://, rediss:// or unix://")
        client = redis.asyncio.from_url(
            url,
            socket_timeout=op_timeout_s,
            socket_connect_timeout=op_timeout_s,
            decode_responses=False,
        )
        return cls(client=client, op_timeout_s=op_timeout_s)

    async def reserve(
        self, keys: Sequence[str], *, token: str, lease_s: float
    ) -> list[Reservation]:
        """Create ``P|token`` with a TTL of ``lease_s`` seconds under every absent key.

        One round trip for all keys; one :class:`Reservation` per key, in order. A key that
        already holds ``P|token`` (same token) reports ``reserved=True`` again. Raises
        :class:`StoreError` (op ``reserve``).
        """
        if not keys:
            return []
        args = (token, _ms(lease_s))
        calls = [(self._reserve_script, key, args) for key in keys]
        async with _translated("reserve", self._op_timeout_s):
            results = await self._run_scripts(calls)
        return [_reservation(key, result) for key, result in zip(keys, results, strict=True)]

    async def settle(
        self, ops: Sequence[SettleOp], *, token: str, window_s: float, now: float
    ) -> list[bool]:
        """Apply every settlement in one round trip, each only if its key holds ``P|token``.

        SENT and UNKNOWN get a TTL of ``window_s`` seconds and record ``now`` (unix seconds) as
        whole milliseconds. Returns per op whether it was applied. Raises :class:`StoreError`
        (op ``settle``).
        """
        if not ops:
            return []
        at_ms, window_ms = int(now * 1000), _ms(window_s)
        calls: list[_ScriptCall] = []
        for op in ops:
            if op.action is Settle.SENT:
                sent_args = (token, at_ms, _reply_bytes(op.reply), window_ms)
                calls.append((self._mark_sent_script, op.key, sent_args))
            elif op.action is Settle.UNKNOWN:
                calls.append((self._mark_unknown_script, op.key, (token, at_ms, window_ms)))
            else:
                calls.append((self._release_script, op.key, (token,)))
        async with _translated("settle", self._op_timeout_s):
            results = await self._run_scripts(calls)
        return [result == 1 for result in results]

    async def inspect(self, key: str) -> Record:
        """Return what ``key`` holds, with ``ttl_s`` in seconds from PTTL (None: no expiry).

        Raises :class:`StoreError` (op ``inspect``).
        """
        async with _translated("inspect", self._op_timeout_s):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.get(key)
                pipe.pttl(key)
                value, pttl_ms = await pipe.execute(raise_on_error=False)
            if isinstance(pttl_ms, Exception):
                raise pttl_ms
        if isinstance(value, ResponseError) and str(value).startswith("WRONGTYPE"):
            value = b""  # a hash, list, ... written by someone else: a foreign value
        elif isinstance(value, Exception):
            raise StoreError("inspect", f"{type(value).__name__}: {value}"[:_ERROR_TEXT_MAX])
        if value is None:
            return Record(State.ABSENT)
        return decode_value(bytes(value), int(pttl_ms))

    async def force_release(self, key: str) -> bool:
        """Delete ``key`` whatever it holds; True when something was deleted.

        Raises :class:`StoreError` (op ``force_release``).
        """
        async with _translated("force_release", self._op_timeout_s):
            deleted = await self._client.delete(key)
        return bool(deleted)

    async def ping(self) -> None:
        """Check that Redis answers PING; raises :class:`StoreError` (op ``ping``)."""
        async with _translated("ping", self._op_timeout_s):
            await self._client.ping()

    async def check_server(self) -> list[str]:
        """Return readable warnings about the server's settings (empty when all is well).

        Warns when ``maxmemory-policy`` is not ``noeviction`` (an evicted PENDING or SENT key
        lets a duplicate through) and when the setting cannot be read (CONFIG refused, as on
        many managed services). Raises :class:`StoreError` (op ``check_server``) only when the
        server cannot be reached.
        """
        async with _translated("check_server", self._op_timeout_s):
            try:
                config = await self._client.config_get("maxmemory-policy")
            except ResponseError as exc:
                return [
                    "could not check Redis maxmemory-policy (CONFIG GET refused: "
                    f"{str(exc)[:_ERROR_TEXT_MAX]}); make sure it is noeviction"
                ]
        policy = _setting(config, "maxmemory-policy")
        if policy is None:
            return [
                "could not check Redis maxmemory-policy (not reported by CONFIG GET); "
                "make sure it is noeviction"
            ]
        if policy != "noeviction":
            return [
                f"Redis maxmemory-policy is {policy!r}, not 'noeviction': under memory pressure "
                "Redis may evict fingerprints and let duplicates through"
            ]
        return []

    async def close(self) -> None:
        """Close the client and its connection pool. Never raises for a broken connection."""
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()

    async def _run_scripts(self, calls: Sequence[_ScriptCall]) -> list[Any]:
        """Run ``calls`` by EVALSHA in one non-transactional pipeline; return their results.

        A script the server does not know (NOSCRIPT: restarted, flushed, failed over) is loaded
        and only the calls that failed for that reason are run again, so the common case stays
        one round trip. Any other script error is raised as its redis-py exception.
        """
        results = await self._pipeline(calls)
        missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if missing:
            for script in {calls[i][0] for i in missing}:
                sha = await self._client.script_load(script.script)
                script.sha = _text(sha) if isinstance(sha, bytes) else str(sha)
            retried = await self._pipeline([calls[i] for i in missing])
            for i, result in zip(missing, retried, strict=True):
                results[i] = result
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    async def _pipeline(self, calls: Sequence[_ScriptCall]) -> list[Any]:
        async with self._client.pipeline(transaction=False) as pipe:
            for script, key, args in calls:
                pipe.evalsha(script.sha, 1, key, *args)
            return await pipe.execute(raise_on_error=False)
