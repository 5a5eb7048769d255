"""Redis fingerprint store: every transition is one Lua script on one key (design.md §3).

The scripts and the values they write are in :mod:`relay.store.redis.scripts`. Each script
touches ``KEYS[1]`` only, so the store works on Redis Cluster without hash tags. A
message's keys are reserved in one pipeline and settled in another: one round trip on a single
server or a Sentinel-managed master; on a cluster redis-py splits the pipeline by node and
sends the parts in parallel, one round trip per node. Every redis, socket and timeout error is
translated into :class:`relay.core.errors.StoreError` here, at the adapter boundary; callers never
see a redis-py exception.

The servers are named by a URL: ``redis://``, ``rediss://`` or ``unix://`` for one server, and
``redis+cluster://`` or ``redis+sentinel://`` (with ``rediss+`` forms) for a cluster or a
Sentinel-managed master, see :mod:`relay.store.redis.urls`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Self, cast

import redis.asyncio
from redis.asyncio.cluster import ClusterNode
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from relay.core.errors import StoreError
from relay.core.interfaces import (
    Record,
    Reservation,
    Settle,
    SettleOp,
    SettleWatch,
    State,
    StateCounts,
)
from relay.store.redis.checks import ConfigGet, server_warnings
from relay.store.redis.clients import Client, SentinelService, open_client
from relay.store.redis.counting import StateTally, match_pattern
from relay.store.redis.limits import RedisRateLimiter
from relay.store.redis.replicas import ReplicaAcks
from relay.store.redis.scripts import (
    FORCE_SENT_LUA,
    INSPECT_LUA,
    MARK_SENDING_LUA,
    MARK_SENT_LUA,
    MARK_UNKNOWN_LUA,
    RELEASE_IF_LUA,
    RELEASE_LUA,
    RENEW_LUA,
    RESERVE_LUA,
    decode_value,
    digest_mark,
    reply_bytes,
)
from relay.store.redis.settled import SettleChannels

IDENTITY_KEY = "dedup-relay:store-id"
"""The key of the store's identity (:meth:`RedisStore.identity`), outside any key prefix."""
_ERROR_TEXT_MAX = 300  # characters of a redis error kept in StoreError (pipeline errors are long)

_ScriptCall = tuple[AsyncScript, str, tuple[str | int | bytes, ...]]

_SCAN_COUNT = 1000  # the COUNT hint of each SCAN of count_states: keys per round trip


def _ms(seconds: float) -> int:
    """Convert a duration in seconds to whole milliseconds, at least 1 ms."""
    return max(1, int(seconds * 1000))


def _reservation(key: str, result: Any, lease_ms: int, window_ms: int) -> Reservation:
    """Interpret one reserve script result (see ``RESERVE_LUA``): the age of a SENDING record
    and the send time of a SENT one are judged by the server's time the script returned,
    never the relay's clock."""
    if result == 1:
        return Reservation(key=key, reserved=True)
    value, pttl_ms, took_over, server_ms = result
    found = decode_value(bytes(value), int(pttl_ms), lease_ms=lease_ms, now_ms=int(server_ms),
                         window_ms=window_ms)
    return Reservation(key=key, reserved=bool(took_over), found=found)


# RedisClusterException: no slot owner known (mid-failover), not a RedisError in redis-py
# UnicodeError: redis-py encodes str arguments strictly (a key holding a lone surrogate)
_TRANSLATED = (RedisError, RedisClusterException, OSError, UnicodeError)


class _translated:  # lower case: used like the function it replaced
    """Bound the body by ``timeout_s`` seconds; raise every failure as ``StoreError(op, ...)``.

    A plain class, not an ``asynccontextmanager``: it runs on every store call, and a
    generator-based context manager costs a generator and its frames each time."""

    __slots__ = ("_op", "_timeout", "_timeout_s")

    def __init__(self, op: str, timeout_s: float) -> None:
        self._op = op
        self._timeout_s = timeout_s
        self._timeout = asyncio.timeout(timeout_s)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError as timed_out:
            raise StoreError(self._op, f"redis did not answer within {self._timeout_s:g} s"
                             ) from timed_out
        if isinstance(exc, _TRANSLATED):
            text = f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT_MAX]
            raise StoreError(self._op, text) from exc


class RedisStore:
    """:class:`relay.core.interfaces.FingerprintStore` on Redis, Redis Cluster or Sentinel.

    ``client`` is owned by the store from now on (``close`` closes it, and ``sentinel``'s
    connections); it must be created with ``decode_responses=False``. ``sentinel`` names the
    sentinels and service behind a Sentinel-managed ``client``. ``op_timeout_s`` bounds every
    operation, in seconds, connect, retries and redirections included. Every method raises
    :class:`relay.core.errors.StoreError` on any failure.

    On a cluster or a Sentinel-managed master the writes the relay relies on (a reserve; a
    settle that marks SENT or UNKNOWN) wait for one replica, or raise StoreError while a
    failover is under way (:mod:`relay.store.redis.replicas`, docs/design.md §3). Releases are
    not waited on: a lost one frees its key when the lease ends anyway. A single server is
    never waited on.

    ``window_s`` is the dedup window in seconds: a SENT record's send time is read as its
    expiry time less the window (:func:`relay.store.redis.scripts.decode_value`).
    """

    def __init__(
        self,
        *,
        client: Client,
        op_timeout_s: float = 2.0,
        sentinel: SentinelService | None = None,
        window_s: float = 86400.0,
    ) -> None:
        self._client = client
        self._op_timeout_s = op_timeout_s
        self._window_ms = _ms(window_s)
        self._sentinel = sentinel
        replicated = sentinel is not None or isinstance(client, redis.asyncio.RedisCluster)
        self._replicated = replicated
        self._acks = ReplicaAcks(client=client, enabled=replicated, op_timeout_s=op_timeout_s)
        self._reserve_script = client.register_script(RESERVE_LUA)
        self._mark_sent_script = client.register_script(MARK_SENT_LUA)
        self._mark_unknown_script = client.register_script(MARK_UNKNOWN_LUA)
        self._release_script = client.register_script(RELEASE_LUA)
        self._mark_sending_script = client.register_script(MARK_SENDING_LUA)
        self._renew_script = client.register_script(RENEW_LUA)
        self._inspect_script = client.register_script(INSPECT_LUA)
        self._release_if_script = client.register_script(RELEASE_IF_LUA)
        self._force_sent_script = client.register_script(FORCE_SENT_LUA)
        self._settles = SettleChannels(client, op_timeout_s)

    def watch_settles(self, keys: Sequence[str]) -> AbstractAsyncContextManager[SettleWatch]:
        """The settles of ``keys``, heard on their pub/sub channels (one connection per store:
        :class:`relay.store.redis.settled.SettleChannels`)."""
        return self._settles.watching(keys)

    @classmethod
    def from_url(cls, url: str, *, op_timeout_s: float = 2.0, window_s: float = 86400.0) -> Self:
        """Build a store from a ``redis://``, ``rediss://`` (TLS) or ``unix://`` URL, or a
        ``redis+cluster://`` or ``redis+sentinel://`` URL (:mod:`relay.store.redis.urls`).

        Socket connect and read timeouts are ``op_timeout_s`` seconds; ``window_s`` the dedup
        window (see the class). Nothing is connected yet. Raises :class:`ValueError` for another
        scheme or a malformed URL.
        """
        client, sentinel = open_client(url, op_timeout_s=op_timeout_s)
        return cls(client=client, op_timeout_s=op_timeout_s, sentinel=sentinel,
                   window_s=window_s)

    async def reserve(
        self, keys: Sequence[str], *, token: str, lease_s: float, resend_unknown: bool = False,
        content_digest: str = "", replace_other_content: bool = False,
    ) -> list[Reservation]:
        """Create ``P|token#<content_digest>`` (``P|token`` without one) with a TTL of
        ``lease_s`` seconds under every absent key.

        One pipeline for all keys; one :class:`Reservation` per key, in order. A key that
        already holds ``P|token`` (same token) reports ``reserved=True`` again. A record the
        script's twin of :func:`relay.core.rules.takes_over` names (``resend_unknown``: in
        doubt; ``replace_other_content``: of other content) is replaced too
        (``reserved=True``, ``found`` the record replaced). Raises :class:`StoreError` (op
        ``reserve``), ``ValueError`` for a digest outside ``[A-Za-z0-9_-]``.
        """
        if not keys:
            return []
        lease_ms = _ms(lease_s)
        args = (token, lease_ms, "1" if resend_unknown else "0", digest_mark(content_digest),
                "1" if replace_other_content else "0")
        calls = [(self._reserve_script, key, args) for key in keys]
        async with _translated("reserve", self._op_timeout_s):
            results = await self._run_scripts(
                calls, durable=set(keys) if self._replicated else frozenset())
        return [_reservation(key, result, lease_ms, self._window_ms)
                for key, result in zip(keys, results, strict=True)]

    async def renew(self, keys: Sequence[str], *, token: str, lease_s: float,
                    window_s: float = 0.0) -> list[bool]:
        """Keep this attempt's reservations alive: PENDING(token) gets a TTL of ``lease_s``
        seconds again, SENDING(token) the server's time as its heartbeat and, with ``window_s``
        > 0, a TTL of at least ``window_s`` seconds. One pipeline; per key, whether it was
        still this attempt's. Raises :class:`StoreError` (op ``renew``)."""
        if not keys:
            return []
        window_ms = _ms(window_s) if window_s > 0 else 0
        calls = [(self._renew_script, key, (token, _ms(lease_s), window_ms)) for key in keys]
        async with _translated("renew", self._op_timeout_s):
            results = await self._run_scripts(calls, durable=frozenset())
        return [result == 1 for result in results]

    async def settle(
        self, ops: Sequence[SettleOp], *, token: str, window_s: float
    ) -> list[bool]:
        """Apply every settlement in one pipeline, each only if its key holds ``P|token`` (or
        ``D|token|...``).

        SENT and UNKNOWN get a TTL of ``window_s`` seconds from the Redis server's time; SENT
        keeps no reply text (``op.reply`` is not stored) and is the one-byte ``0`` when
        ``window_s`` is the store's window. Returns per op whether it was applied.
        Raises :class:`StoreError` (op ``settle``).
        """
        if not ops:
            return []
        window_ms = _ms(window_s)
        calls: list[_ScriptCall] = []
        for op in ops:
            if op.action is Settle.SENT:
                own = "1" if window_ms == self._window_ms else "0"
                calls.append((self._mark_sent_script, op.key, (token, window_ms, own)))
            elif op.action is Settle.UNKNOWN:
                calls.append((self._mark_unknown_script, op.key, (token, window_ms)))
            elif op.action is Settle.SENDING:
                sending_args = (token, window_ms, _ms(op.lease_s) if op.lease_s > 0 else 0)
                calls.append((self._mark_sending_script, op.key, sending_args))
            else:
                calls.append((self._release_script, op.key, (token,)))
        marks: AbstractSet[str] = frozenset()
        if self._replicated:
            marks = {op.key for op in ops if op.action is not Settle.RELEASE}
        async with _translated("settle", self._op_timeout_s):
            results = await self._run_scripts(calls, durable=marks)
        return [result == 1 for result in results]

    async def inspect(self, key: str) -> Record:
        """Return what ``key`` holds, with ``ttl_s`` in seconds from PTTL (None: no expiry).

        Raises :class:`StoreError` (op ``inspect``).
        """
        async with _translated("inspect", self._op_timeout_s):
            [(value, pttl_ms, server_ms)] = await self._run_scripts(
                [(self._inspect_script, key, ())], durable=frozenset())
        return self._inspected(value, pttl_ms, server_ms)

    async def inspect_many(self, keys: Sequence[str]) -> list[Record]:
        """What each of ``keys`` holds, as :meth:`inspect` reads one, in one pipeline (on a
        cluster one per node, in parallel). Raises :class:`StoreError` (op ``inspect``)."""
        if not keys:
            return []
        async with _translated("inspect", self._op_timeout_s):
            results = await self._run_scripts(
                [(self._inspect_script, key, ()) for key in keys], durable=frozenset())
        return [self._inspected(value, pttl_ms, server_ms)
                for value, pttl_ms, server_ms in results]

    def _inspected(self, value: Any, pttl_ms: Any, server_ms: Any) -> Record:
        """One ``INSPECT_LUA`` result as a :class:`Record` (ages by the server's clock)."""
        if value == 0:
            return Record(State.ABSENT)
        record = dataclasses.replace(
            decode_value(bytes(value), int(pttl_ms), now_ms=int(server_ms),
                         window_ms=self._window_ms), raw=bytes(value))
        if record.at is None:
            return record
        return dataclasses.replace(record, age_s=int(server_ms) / 1000 - record.at)

    async def force_release(self, key: str, *, expected: Record | None = None) -> bool:
        """Delete ``key``; with ``expected`` only while it still holds ``expected.raw`` (one
        script). True when something was deleted. Raises :class:`StoreError` (op
        ``force_release``)."""
        if expected is not None and expected.state is State.ABSENT:
            return False
        args: tuple[bytes, ...] = (b"0", b"")
        if expected is not None and expected.raw:
            args = (b"1", expected.raw)
        async with _translated("force_release", self._op_timeout_s):
            [deleted] = await self._run_scripts(
                [(self._release_if_script, key, args)], durable=frozenset())
        return bool(deleted)

    async def force_mark_sent(self, key: str, *, reply: str, window_s: float,
                              expected: Record | None = None) -> bool:
        """Set ``S|<server time ms>|reply`` under ``key`` with a TTL of ``window_s`` seconds
        (an operator's decision); with ``expected`` only while the key still holds
        ``expected.raw`` (nothing, for ABSENT), in one script. True when written. Raises
        :class:`StoreError` (op ``force_mark_sent``)."""
        guard: tuple[bytes, bytes] = (b"any", b"")
        if expected is not None and expected.state is State.ABSENT:
            guard = (b"absent", b"")
        elif expected is not None and expected.raw is not None:
            guard = (b"value", expected.raw)
        call = (self._force_sent_script, key, (reply_bytes(reply), _ms(window_s), *guard))
        async with _translated("force_mark_sent", self._op_timeout_s):
            [written] = await self._run_scripts([call], durable={key})
        return bool(written)

    async def count_states(self, prefix: str, *, lease_s: float, older_than_s: float,
                           max_keys: int | None = None,
                           progress: Callable[[int], None] | None = None) -> StateCounts:
        """Count the records under ``prefix`` by state
        (:class:`relay.core.interfaces.StateCounter`).

        ``SCAN MATCH prefix* COUNT 1000`` on the one server, the Sentinel-managed master or
        each primary of a cluster in turn; each batch of keys is read in one round trip (one
        MGET; on a cluster a pipeline of GETs, one round trip per node its keys live on; no
        figure needs a TTL). Ages are by the server's clock (TIME once per server, then this
        host's monotonic clock). Stops once ``max_keys`` keys were looked at (``complete``
        False when the scan had not ended). SCAN may return a key twice while Redis rehashes,
        so a count can be off by the keys that moved. ``op_timeout_s`` bounds each round trip,
        not the whole count. Raises :class:`StoreError` (op ``count_states``).
        """
        tally = StateTally(lease_ms=_ms(lease_s), older_than_ms=int(older_than_s * 1000))
        match = match_pattern(prefix)
        prefix_bytes = prefix.encode("utf-8", "surrogateescape")
        complete = True
        for node in await self._scan_targets():
            async with _translated("count_states", self._op_timeout_s):
                seconds, micros = await (self._client.time() if node is None
                                         else self._client.time(target_nodes=node))
            clock = (int(seconds) * 1000 + int(micros) // 1000, time.monotonic())
            cursor: int | None = None
            while cursor != 0:
                left = None if max_keys is None else max_keys - tally.scanned
                if left is not None and left <= 0:
                    complete = False
                    break
                async with _translated("count_states", self._op_timeout_s):
                    cursor, keys = await self._scan(node, cursor or 0, match)
                keys = [key for key in keys if key.startswith(prefix_bytes)]
                if left is not None and len(keys) > left:
                    keys, complete = keys[:left], False
                if keys:
                    await self._tally(keys, tally, clock)
                    if progress is not None:
                        progress(tally.scanned)
            if not complete:
                break
        return tally.counts(complete=complete)

    async def _scan_targets(self) -> list[ClusterNode | None]:
        """The servers a scan covers: every primary of a cluster, else the one client (None)."""
        client = self._client
        if not isinstance(client, redis.asyncio.RedisCluster):
            return [None]
        async with _translated("count_states", self._op_timeout_s):
            await client.initialize()
        return list(client.get_primaries())

    async def _scan(self, node: ClusterNode | None, cursor: int,
                    match: str) -> tuple[int, list[bytes]]:
        """One SCAN call on ``node`` (None: the one server): the next cursor and its keys."""
        client = self._client
        if node is None or not isinstance(client, redis.asyncio.RedisCluster):
            found, keys = await client.scan(cursor=cursor, match=match, count=_SCAN_COUNT)
            return int(found), cast(list[bytes], keys)  # decode_responses=False
        # a cluster answers {node name: cursor} (redis-py's parse_scan_result)
        cursors, keys = await client.scan(cursor=cursor, match=match, count=_SCAN_COUNT,
                                          target_nodes=node)
        return int(cast(dict[str, int], cursors)[node.name]), cast(list[bytes], keys)

    async def _tally(self, keys: list[bytes], tally: StateTally,
                     clock: tuple[int, float]) -> None:
        """Read every key's value in one round trip and count it (``clock``: the server's unix
        ms and this host's monotonic time when it was read). A key MGET or GET found no string
        under is asked its TYPE (another round trip, only then): gone (expired since SCAN), or
        of another type, which counts as what a reserve reads it as (SENT)."""
        async with _translated("count_states", self._op_timeout_s):
            values = await self._values(keys)
            missing = [i for i, value in enumerate(values) if value is None]
            if missing:
                async with self._client.pipeline(transaction=False) as pipe:
                    for i in missing:
                        pipe.type(keys[i])
                    types: list[Any] = await pipe.execute()
                for i, kind in zip(missing, types, strict=True):
                    values[i] = None if kind in (b"none", "none") else b""
        server_ms, at_monotonic = clock
        now_ms = server_ms + int((time.monotonic() - at_monotonic) * 1000)
        for value in values:
            tally.add_key()
            tally.add(value, now_ms)

    async def _values(self, keys: list[bytes]) -> list[bytes | None]:
        """The string under each key, None where there is none (gone, or another type): one
        MGET on one server; on a cluster (keys of many slots) one pipeline of GETs."""
        if not isinstance(self._client, redis.asyncio.RedisCluster):
            return cast(list[bytes | None], await self._client.mget(keys))
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
            results: list[Any] = await pipe.execute(raise_on_error=False)
        values: list[bytes | None] = []
        for result in results:
            if isinstance(result, ResponseError) and str(result).startswith("WRONGTYPE"):
                values.append(None)  # its TYPE is asked next
            elif isinstance(result, Exception):
                raise result
            else:
                values.append(result)
        return values

    def rate_limiter(self, prefix: str) -> RedisRateLimiter:
        """The rate limiter on this store's client, its keys under ``prefix``
        (:mod:`relay.store.redis.limits`)."""
        return RedisRateLimiter(client=self._client, prefix=prefix,
                                op_timeout_s=self._op_timeout_s)

    async def ping(self) -> None:
        """Check that Redis answers PING; raises :class:`StoreError` (op ``ping``)."""
        async with _translated("ping", self._op_timeout_s):
            await self._client.ping()

    async def identity(self) -> str:
        """``redis:<uuid>``: a random id the first relay wrote (SET NX) under
        :data:`IDENTITY_KEY` in this database, read back; never expires. Outside the key
        prefix, so no scan of the fingerprints sees it; a cluster keeps it on one shard.
        Raises :class:`StoreError` (op ``identity``)."""
        async with _translated("identity", self._op_timeout_s):
            await self._client.set(IDENTITY_KEY, uuid.uuid4().hex, nx=True)
            value = await self._client.get(IDENTITY_KEY)
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
        return f"redis:{text}"

    async def check_server(self) -> list[str]:
        """Return readable warnings about the servers' settings (empty when all is well).

        For the one server, the Sentinel-managed master or every master of a cluster: warns
        when ``maxmemory-policy`` is not ``noeviction`` (an evicted PENDING or SENT key lets a
        duplicate through), when persistence is off (``appendonly no`` and an empty ``save``),
        and when these cannot be read (CONFIG refused, as on many managed services). With
        Sentinel, also when the sentinels know no live replica. Raises :class:`StoreError`
        (op ``check_server``) only when a server cannot be reached.
        """
        warnings: list[str] = []
        async with _translated("check_server", self._op_timeout_s):
            for where, config_get in await self._config_readers():
                warnings.extend(await server_warnings(where, config_get))
            if self._sentinel is not None:
                service = self._sentinel.service
                if not await self._sentinel.sentinel.discover_slaves(service):
                    warnings.append(
                        f"Redis Sentinel knows no live replica of {service!r}: a failover of "
                        "its master has nothing to promote"
                    )
        return warnings

    async def close(self) -> None:
        """Close the client, its connections and the sentinels'. Never raises for a broken
        connection."""
        await self._settles.close()
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
        if self._sentinel is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._sentinel.sentinel.aclose()

    async def _config_readers(self) -> list[tuple[str, ConfigGet]]:
        """One ``(name, CONFIG GET function)`` per server to check: every master of a cluster."""
        client = self._client
        if not isinstance(client, redis.asyncio.RedisCluster):
            return [("Redis", client.config_get)]
        await client.initialize()

        def reader(node: ClusterNode) -> ConfigGet:
            return lambda name: client.config_get(name, target_nodes=node)

        return [(f"Redis at {node.name}", reader(node)) for node in client.get_primaries()]

    async def _run_scripts(
        self, calls: Sequence[_ScriptCall], *, durable: AbstractSet[str]
    ) -> list[Any]:
        """Run ``calls`` by EVALSHA in one non-transactional pipeline; return their results.

        The writes to the keys in ``durable`` are followed by WAIT (see the class docstring).
        A server that does not know a script (NOSCRIPT: restarted, flushed, a replica just
        promoted, a cluster node never used before) gets the calls that failed for that reason
        again as EVAL, which runs the script and caches it on that server: one more round trip,
        on that server only. Any other script error is raised as its redis-py exception.
        """
        if len(calls) == 1 and not self._replicated:
            return [await self._run_one(*calls[0])]
        results = await self._pipeline(calls, durable, by_sha=True)
        missing = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if missing:
            retried = await self._pipeline([calls[i] for i in missing], durable, by_sha=False)
            for i, result in zip(missing, retried, strict=True):
                results[i] = result
        for result in results:
            if isinstance(result, Exception):
                raise result
        return results

    async def _run_one(self, script: AsyncScript, key: str,
                       args: tuple[str | int | bytes, ...]) -> Any:
        """One script on a single server (nothing to WAIT for), without a pipeline: a
        message's reserve, mark and settle are one key each. NOSCRIPT: EVAL, as above."""
        try:
            return await self._client.execute_command("EVALSHA", script.sha, 1, key, *args)
        except NoScriptError:
            return await self._client.execute_command("EVAL", script.script, 1, key, *args)

    async def _pipeline(
        self, calls: Sequence[_ScriptCall], durable: AbstractSet[str], *, by_sha: bool
    ) -> list[Any]:
        """Send ``calls``, then a WAIT per server written to for ``durable`` keys, in one
        pipeline; return the calls' results.

        On a cluster, redis-py groups the commands by node and runs the groups in parallel,
        each on one connection, so a WAIT aimed at a node follows the writes sent to it. A
        write answered with MOVED or ASK is sent again on its own, and its WAIT still goes to
        the old node: after a failover that node is a replica and refuses WAIT, which fails
        the call (the slot map is right for the next one); while slots migrate, the old node's
        answer does not cover the moved write.
        """
        targets = await self._acks.targets([key for _, key, _ in calls if key in durable])
        async with self._client.pipeline(transaction=False) as pipe:
            for script, key, args in calls:
                if by_sha:
                    # execute_command: ClusterPipeline blocks its evalsha() helper method
                    pipe.execute_command("EVALSHA", script.sha, 1, key, *args)
                else:
                    pipe.execute_command("EVAL", script.script, 1, key, *args)
            self._acks.add_waits(pipe, targets)
            results: list[Any] = await pipe.execute(raise_on_error=False)
        await self._acks.note(targets, results[len(calls) :])
        return results[: len(calls)]
