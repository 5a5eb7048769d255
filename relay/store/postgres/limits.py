"""Rate limits on the PostgreSQL store (design.md §4.7): :class:`PostgresRateLimiter` implements
:class:`relay.core.interfaces.RateLimiter` with one statement per message.

The sliding-window log of the SQLite store (:mod:`relay.store.sqlite.limits`) as rows of
``dedup_relay_rate_events`` (schema step 2 of the ``store`` component,
:mod:`relay.store.postgres.migrations`): one row per call and bucket, ``(bucket, at, cost,
expires_at, call_id)``. A call is one ``SELECT dedup_relay_rate_acquire(...)`` (one round trip,
one transaction): the PL/pgSQL function takes ``pg_advisory_xact_lock(space, hashtext(bucket))``
for each of its buckets in the order of the hashes (two calls sharing buckets never wait for
each other in opposite orders), reads the database's ``clock_timestamp()`` once it holds them,
deletes the expired rows of its buckets, sums each bucket's window and inserts only when every
bucket has room. Two relays acquiring one bucket at once are serialized by its lock, and each
statement after the lock sees the rows the previous holder committed (READ COMMITTED: the
function refuses to run under another isolation level rather than count from a stale
snapshot). The bucket column is ``<prefix>rl:<label>:<sha256 of the bucket, 32 hex>``: no
domain or user name in the table, as in Redis's keys. Times are the database server's clock,
never a relay's.

A call that fails or times out after its statement was sent (the relay answers ``451 4.3.0``
and sends nothing) is given back as on Redis: ``dedup_relay_rate_give_back`` takes the same
locks (so it waits for the call if it is still running), deletes the call's rows and leaves a
tombstone row (``dedup_relay_rate_given_back``, one longest window), so a call that reaches
the database only afterwards takes nothing. The connection of such a call is closed, not
reused. Expired rows of the buckets a call touches go in that call; the rest (buckets no longer
used, old tombstones) go in the store's cleanup rounds, bounded like the fingerprints'
(:func:`delete_expired`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections.abc import Sequence
from typing import Any

import asyncpg

from relay.core.cancellation import run_to_end
from relay.core.errors import StoreError
from relay.core.interfaces import LimitCheck, LimitVerdict
from relay.store.postgres.calls import ERRORS, release, storable, terminate
from relay.store.postgres.calls import milliseconds as _ms
from relay.store.postgres.migrations import (
    RATE_ACQUIRE,
    RATE_EVENTS,
    RATE_GIVE_BACK,
    RATE_GIVEN_BACK,
)

log = logging.getLogger(__name__)

_ACQUIRE = (f"SELECT {RATE_ACQUIRE}($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], "
            "$5::text)")
_GIVE_BACK = f"SELECT {RATE_GIVE_BACK}($1::text[], $2::text, $3::bigint)"
# $1 most rows to delete (see relay.store.postgres.store's _CLEANUP)
_CLEANUP = tuple(f"""
DELETE FROM {table} WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {table} WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED))
    AND expires_at <= now()
""" for table in (RATE_EVENTS, RATE_GIVEN_BACK))

_ERRORS = (*ERRORS, UnicodeError)
_ERROR_TEXT_MAX = 300


def bucket_name(prefix: str, check: LimitCheck) -> str:
    """The ``bucket`` column of ``check``'s rows: ``<prefix>rl:<label>:<32 hex>`` (the bucket's
    value hashed; lone surrogates and NUL, which a text column refuses, as U+FFFD)."""
    digest = hashlib.sha256(check.bucket.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return storable(f"{prefix}rl:{check.label}:{digest}")


class PostgresRateLimiter:
    """:class:`relay.core.interfaces.RateLimiter` on the PostgreSQL store's asyncpg ``pool``,
    buckets under ``prefix``; ``op_timeout_s`` (seconds) bounds a call, the wait for a pooled
    connection included. Raises :class:`relay.core.errors.StoreError` (op ``rate_limit``)."""

    def __init__(self, *, pool: asyncpg.Pool, prefix: str, op_timeout_s: float = 1.0) -> None:
        self._pool = pool
        self._prefix = prefix
        self._op_timeout_s = op_timeout_s

    async def acquire(self, checks: Sequence[LimitCheck]) -> LimitVerdict:
        """Take every check's cost or none, in one statement (see the module docstring).
        Raises :class:`StoreError` when the database fails or does not answer within
        ``op_timeout_s``; a call whose statement was sent is given back first."""
        if not checks:
            return LimitVerdict(allowed=True)
        buckets = [bucket_name(self._prefix, c) for c in checks]
        call_id = secrets.token_hex(8)
        args = (buckets, [_ms(c.per_s) for c in checks], [c.limit for c in checks],
                [c.cost for c in checks], call_id)
        conn: Any = None
        result: Any = None
        try:
            async with asyncio.timeout(self._op_timeout_s):
                conn = await self._pool.acquire()
                result = await conn.fetchval(_ACQUIRE, *args)
        except TimeoutError as exc:
            await self._failed(conn, buckets, call_id, checks)
            raise StoreError("rate_limit", f"PostgreSQL did not answer within "
                                           f"{self._op_timeout_s:g} s") from exc
        except asyncpg.PostgresError as exc:
            # the server refused the statement: its transaction is rolled back, nothing taken
            await self._release(conn)
            raise StoreError("rate_limit",
                             f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT_MAX]) from exc
        except _ERRORS as exc:
            await self._failed(conn, buckets, call_id, checks)
            raise StoreError("rate_limit",
                             f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT_MAX]) from exc
        except asyncio.CancelledError:
            # a shutdown past its grace cut the call: its message is answered 4yz and never
            # sent, so what the statement took (or takes if it lands later) is given back
            await run_to_end(asyncio.ensure_future(
                self._failed(conn, buckets, call_id, checks)))
            raise
        await self._release(conn)
        index, wait_ms = int(result[0]), int(result[1])
        if index == 0:
            return LimitVerdict(allowed=True)
        return LimitVerdict(allowed=False, refused=checks[index - 1],
                            retry_after_s=None if wait_ms < 0 else wait_ms / 1000)

    async def _failed(self, conn: Any, buckets: list[str], call_id: str,
                      checks: Sequence[LimitCheck]) -> None:
        """After a failed call: close its connection (a statement may still be on its way or
        running) and, when the statement was sent, give the call back."""
        if conn is None:
            return  # no connection: the statement never left
        terminate(conn)
        await self._release(conn)
        await self._give_back(buckets, call_id, checks)

    async def _release(self, conn: Any) -> None:
        """Hand ``conn`` back to the pool (:func:`relay.store.postgres.calls.release`); None:
        none."""
        if conn is not None:
            await release(self._pool, conn, self._op_timeout_s)

    async def _give_back(self, buckets: list[str], call_id: str,
                         checks: Sequence[LimitCheck]) -> None:
        """Undo whatever of the failed call ``call_id`` landed or may still land (its message
        is answered 4yz and not sent, so its units must not count), within ``op_timeout_s``;
        a database that does not answer keeps them: they leave with their window."""
        keep_ms = max(_ms(c.per_s) for c in checks)
        conn: Any = None
        done = False
        try:
            async with asyncio.timeout(self._op_timeout_s):
                conn = await self._pool.acquire()
                await conn.fetchval(_GIVE_BACK, buckets, call_id, keep_ms)
                done = True
        except (TimeoutError, *_ERRORS) as exc:
            log.warning("rate limit: cannot give back the units of a failed call (%s): they "
                        "count until their window ends", type(exc).__name__)
        finally:
            if conn is not None and not done:
                terminate(conn)  # never wait for a server that may be hanging
            await self._release(conn)


async def delete_expired(conn: asyncpg.Connection, batch: int) -> int:
    """Delete at most ``batch`` expired rows of each rate-limit table (the events, the
    tombstones) on ``conn``; return how many in all. asyncpg errors pass through."""
    total = 0
    for statement in _CLEANUP:
        status = await conn.execute(statement, batch)
        total += int(status.split()[-1])
    return total
