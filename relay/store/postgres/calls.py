"""The one way the relay's PostgreSQL parts (the store, the audit ledger) open a pool and run a
call on it, every call bounded in time whatever the server does.

A server that stops answering in the middle of a statement (a paused VM, a partition that drops
packets) keeps the TCP connection open: cancelling the query then makes asyncpg send a
CancelRequest and, when the connection goes back to the pool, wait for the server to
acknowledge it, without a bound. :func:`bounded_call` therefore terminates (closes without a
word) a connection whose call ran out of time or was cancelled, so that the caller gets its
:class:`relay.core.errors.StoreError` within the op timeout, and releases every other one with a
timeout. The pool resets a released connection without a round trip (:func:`_no_reset`): the
relay's statements leave no session state behind (no SET, no cursor, no LISTEN, advisory locks
only transaction-scoped), and asyncpg still rolls back a transaction left open.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

import asyncpg

from relay.core.errors import StoreError

_R = TypeVar("_R")

ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError,
          TimeoutError)
"""What a call on PostgreSQL may raise that is the database's failure, not the relay's.
``InternalClientError``: a pooled connection that read the server's "terminating connection"
(a fast shutdown) but not yet its close is handed out, and its next query fails so (uncaught,
it would turn a delivered message's SENT settle into an internal error)."""

INACTIVE_S = 60.0
"""Seconds an idle pooled connection lives before it is closed."""

STARTUP_CHECK_S = 15.0
"""Bound of a schema check at start-up (the store's, the ledger's), seconds, a connect
included: not a message's path, and a database slow to connect must still be checked."""

WRITABLE = ("SELECT NOT pg_is_in_recovery() "
            "AND current_setting('transaction_read_only') = 'off'")
"""True when the session can write: a hot standby, or a session with
``default_transaction_read_only``, answers ``SELECT 1`` while every write fails."""


def milliseconds(seconds: float) -> int:
    """A duration in seconds as whole milliseconds, at least 1 ms."""
    return max(1, int(seconds * 1000))


def storable(text: str) -> str:
    """``text`` storable in a PostgreSQL text column: lone surrogates and NUL become U+FFFD."""
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "\ufffd")


def deleted_rows(status: str) -> int:
    """The row count of a ``DELETE n`` command status."""
    return int(status.split()[-1])


async def delete_in_batches(delete_batch: Callable[[], Awaitable[int]], *, batch: int,
                            max_batches: int) -> int:
    """Run ``delete_batch()`` (one bounded DELETE of at most ``batch`` rows; it returns how
    many it deleted) until a round deletes fewer than ``batch`` or ``max_batches`` ran; return
    how many in all (a cleanup's backlog is worked off in bounded steps)."""
    total = 0
    for _ in range(max_batches):
        deleted = await delete_batch()
        total += deleted
        if deleted < batch:
            break
    return total


# SQLSTATEs of a connect that no retry changes: the URL names a database the server does not
# have (3D000, invalid_catalog_name), a role that may not log in or does not exist (28000), a
# wrong password (28P01). PostgreSQL Appendix A, "PostgreSQL Error Codes".
_REFUSED_CONNECT = frozenset({"3D000", "28000", "28P01"})


def refused_connect(exc: BaseException) -> str | None:
    """The server's word when ``exc`` (a :class:`StoreError`, or what it was raised from) is a
    connect the server refused for good (:data:`_REFUSED_CONNECT`: the database does not
    exist, the role or its password is refused), else None (not reachable, a timeout: worth
    waiting for)."""
    seen: BaseException | None = exc
    while seen is not None:
        if (isinstance(seen, asyncpg.PostgresError)
                and getattr(seen, "sqlstate", None) in _REFUSED_CONNECT):
            return f"{seen} (SQLSTATE {seen.sqlstate})"
        seen = seen.__cause__ or seen.__context__
    return None


class as_store_error:  # used as a function: ``with as_store_error(...):``
    """Turn a timeout (the caller's bound of ``limit_s`` seconds) and ``errors`` raised in the
    ``with`` block into :class:`StoreError` naming ``op_name``; nothing is swallowed."""

    def __init__(self, op_name: str, limit_s: float,
                 errors: tuple[type[BaseException], ...] = ERRORS) -> None:
        self._op_name, self._limit_s, self._errors = op_name, limit_s, errors

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, TimeoutError):
            raise StoreError(self._op_name, f"PostgreSQL did not answer within "
                                            f"{self._limit_s:g} s") from exc
        if isinstance(exc, self._errors):
            raise StoreError(self._op_name, f"{type(exc).__name__}: {exc}") from exc


async def close_connection(conn: asyncpg.Connection | None) -> None:
    """Close ``conn`` (one of its own, not pooled) within a second, else drop it without a
    word; None: nothing. A cancellation drops it and goes on."""
    if conn is None or conn.is_closed():
        return
    try:
        async with asyncio.timeout(1.0):
            await conn.close()
    except ERRORS:
        conn.terminate()
    except asyncio.CancelledError:
        conn.terminate()
        raise


async def close_pool(pool: asyncpg.Pool, timeout_s: float) -> None:
    """Close ``pool`` within ``timeout_s`` seconds, else terminate every connection."""
    try:
        async with asyncio.timeout(timeout_s):
            await pool.close()
    except ERRORS:
        pool.terminate()


async def _no_reset(conn: Any) -> None:
    """The pool's reset of a released connection: nothing to send (see the module docstring)."""
    del conn


ACQUIRE_SHARE = 0.4
"""The share of a call's bound it may spend waiting for a pooled connection (connecting
included); the statement then has at least the rest, more than :data:`STATEMENT_SHARE`."""
STATEMENT_SHARE = 0.5
"""The sessions' ``statement_timeout`` as a share of the calls' bound."""


def statement_timeout_ms(limit_s: float) -> int:
    """The server-side ``statement_timeout`` of calls bounded by ``limit_s`` seconds: with the
    wait for a connection bounded by :data:`ACQUIRE_SHARE` of it, a statement the relay stopped
    waiting for (its connection terminated: PostgreSQL may not notice a closed socket while
    the statement waits for a lock) has ended, committed or not, before the relay gives up and
    runs its cleanup after the failure (a reserve's release of what it may have taken), never
    after it (which would leave an orphan PENDING for a lease)."""
    return max(100, int(limit_s * STATEMENT_SHARE * 1000))


async def open_pool(url: str, *, max_size: int, op_name: str,
                    limit_s: float | None = None) -> asyncpg.Pool:
    """A pool of at most ``max_size`` connections to ``url`` (none opened yet); with
    ``limit_s`` (the calls' bound, seconds) each new session runs ``SET statement_timeout``
    to :func:`statement_timeout_ms` of it (a SET, not a startup parameter, which poolers
    such as PgBouncer refuse; a longer call raises it for itself: :func:`longer`). Raises
    :class:`StoreError` naming ``op_name`` for a URL asyncpg refuses."""
    init = None
    extra: dict[str, Any] = {}
    if limit_s is not None:
        statement = f"SET statement_timeout = {statement_timeout_ms(limit_s)}"

        async def set_timeout(conn: asyncpg.Connection) -> None:
            await conn.execute(statement, timeout=limit_s)
        init = set_timeout
        # a connect outlives a call's wait (it is handed to the pool when ready), but not
        # the bound itself: a blackholed address holds a pool slot that long, not asyncpg's
        # 60 s default (after a failover every slot would be stuck connecting that long)
        extra["timeout"] = limit_s
    try:
        pool = asyncpg.create_pool(url, min_size=0, max_size=max_size,
                                   max_inactive_connection_lifetime=INACTIVE_S,
                                   reset=_no_reset, init=init, **extra)
        await pool
    except (*ERRORS, ValueError) as exc:
        raise StoreError(op_name, f"{type(exc).__name__}: {exc}") from exc
    return pool


def longer(fn: Callable[[asyncpg.Connection], Awaitable[_R]],
           limit_s: float) -> Callable[[asyncpg.Connection], Awaitable[_R]]:
    """``fn`` run in a transaction whose ``statement_timeout`` fits ``limit_s`` seconds (an
    admin command's count, a cleanup round) instead of the pool's."""
    async def run(conn: asyncpg.Connection) -> _R:
        async with conn.transaction():
            await conn.execute(f"SET LOCAL statement_timeout = {statement_timeout_ms(limit_s)}")
            return await fn(conn)
    return run


async def bounded_call(pool: asyncpg.Pool, op_name: str,
                       fn: Callable[[asyncpg.Connection], Awaitable[_R]],
                       limit_s: float, *, session_limit_s: float | None = None) -> _R:
    """Run ``fn`` on a pooled connection, the wait for the connection included, within
    ``limit_s`` seconds; when that is longer than the bound the pool's sessions were opened
    for (``session_limit_s``, their ``statement_timeout``), ``fn`` runs under :func:`longer`.
    Raises :class:`StoreError` naming ``op_name`` on any failure or timeout; a connection
    whose call timed out or was cancelled is terminated, never waited for."""
    if session_limit_s is not None and limit_s > session_limit_s:
        fn = longer(fn, limit_s)
    conn: Any = None
    done = False
    try:
        with as_store_error(op_name, limit_s):
            conn = await _acquire(pool, op_name, limit_s * ACQUIRE_SHARE)
            async with asyncio.timeout(limit_s * (1 - ACQUIRE_SHARE)):
                result = await fn(conn)
                done = True
                return result
    finally:
        if conn is not None:
            if not done:
                # timed out, cancelled or failed mid-call: the server may be hanging; a
                # PostgresError left the connection usable, but a fresh one costs little
                terminate(conn)
            await release(pool, conn, limit_s)


async def release(pool: asyncpg.Pool, conn: Any, limit_s: float) -> None:
    """Hand ``conn`` back to ``pool`` within ``limit_s`` seconds (a terminated one is dropped
    by it), else terminate it; a cancellation terminates it and goes on."""
    try:
        await pool.release(conn, timeout=limit_s)
    except ERRORS:
        terminate(conn)
    except asyncio.CancelledError:
        terminate(conn)
        raise


async def _acquire(pool: asyncpg.Pool, op_name: str, limit_s: float) -> Any:
    """A pooled connection within ``limit_s`` seconds, or :class:`StoreError`. A connection
    still being opened when the wait ends is not abandoned: it goes to the pool when it is
    ready, for the next call (a database slow to connect, a long way off, would otherwise
    never be reached: every call would cancel its connect and the next start over)."""
    acquiring = asyncio.ensure_future(pool.acquire())
    try:
        async with asyncio.timeout(limit_s):
            return await asyncio.shield(acquiring)
    except TimeoutError as exc:
        acquiring.add_done_callback(functools.partial(_hand_back, pool))
        raise StoreError(op_name, f"no PostgreSQL connection within {limit_s:g} s (every "
                                  "pooled one busy, or the database slow to connect)") from exc
    except asyncio.CancelledError:
        acquiring.add_done_callback(functools.partial(_hand_back, pool))
        raise


def _hand_back(pool: asyncpg.Pool, acquiring: asyncio.Future[Any]) -> None:
    """Return the connection an abandoned wait got (when it got one) to ``pool``."""
    if acquiring.cancelled() or acquiring.exception() is not None:
        return
    task = asyncio.ensure_future(pool.release(acquiring.result()))
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen: never logged


_BACKGROUND: set[asyncio.Task[None]] = set()


def terminate(conn: Any) -> None:
    """Close ``conn`` at once, without a word to the server; nothing when it is closed
    already or was handed back to the pool meanwhile (a release that completed as it was
    cancelled: asyncpg then refuses with InterfaceError)."""
    with contextlib.suppress(asyncpg.InterfaceError):
        if not conn.is_closed():
            conn.terminate()
