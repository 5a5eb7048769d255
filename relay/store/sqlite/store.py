"""SQLite fingerprint store: the embedded default when no Redis is configured (design.md §3).

One file in WAL mode holds one row per key; it survives a restart of the relay, and several
processes may share it (SQLite's file locks plus ``BEGIN IMMEDIATE`` keep every transition
atomic). Expiry is by wall clock (``time.time()``): a row whose ``expires_at_ms`` has passed
counts as absent and is replaced by the next reserve; :meth:`SqliteStore.purge_expired` deletes
such rows. A SENDING row's heartbeat is also dated on the host's boot clock
(``CLOCK_BOOTTIME``, shared by every process of the host and never stepped) with the boot's id,
and its age is judged on that clock: a step of the wall clock (NTP, a VM resumed) never makes a
live SENDING row read as in doubt (:func:`_heartbeat_age_ms`).

sqlite3 blocks, so every call runs in one dedicated worker thread that owns the one connection;
the event loop only awaits it, bounded by ``op_timeout_s``. Every sqlite3, OS and timeout error
is translated into :class:`relay.core.errors.StoreError` here, at the adapter boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from relay.core.errors import StoreError
from relay.core.interfaces import (
    LimitCheck,
    LimitVerdict,
    Record,
    Reservation,
    Settle,
    SettleOp,
    SettleWatch,
    State,
    StateCounts,
)
from relay.core.rules import same_record, sending_record, takes_over
from relay.store.sqlite import limits as sqlite_limits
from relay.store.sqlite.settled import SqliteSettles
from relay.store.sqlite.writer import (
    BUSY_POLL_MS,
    Op,
    Writer,
    begin_immediate,
    locked,
    pause,
)

_T = TypeVar("_T")

_PENDING, _SENT, _UNKNOWN = State.PENDING.value, State.SENT.value, State.UNKNOWN.value
_SENDING = State.SENDING.value

_SCHEMA = """
CREATE TABLE IF NOT EXISTS fingerprints (
    key TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    token TEXT,
    at_ms INTEGER,
    reply TEXT,
    expires_at_ms INTEGER,
    lease_ms INTEGER,
    boot_id TEXT,
    beat_ms INTEGER,
    content_digest TEXT
)
"""
# SENDING rows keep their attempt's lease (readers judge staleness by it); a file written by an
# earlier version gets the column on open
_ADD_LEASE = "ALTER TABLE fingerprints ADD COLUMN lease_ms INTEGER"
# SENDING rows' heartbeat on the boot clock (CLOCK_BOOTTIME, ms) and the boot it belongs to
_ADD_BEAT = ("ALTER TABLE fingerprints ADD COLUMN boot_id TEXT",
             "ALTER TABLE fingerprints ADD COLUMN beat_ms INTEGER")
# the stored digest of the content of the message that wrote the row (design.md §2.2), kept
# through every state; NULL in a row of an earlier version (never a key reused, §4.9)
_ADD_DIGEST = "ALTER TABLE fingerprints ADD COLUMN content_digest TEXT"
_INDEX = "CREATE INDEX IF NOT EXISTS fingerprints_expiry ON fingerprints (expires_at_ms)"
_SELECT = ("SELECT state, token, at_ms, reply, expires_at_ms, lease_ms, boot_id, beat_ms, "
           "content_digest FROM fingerprints WHERE key = ?")
_SELECT_MANY = ("SELECT key, state, token, at_ms, reply, expires_at_ms, lease_ms, boot_id, "
                "beat_ms, content_digest "
                "FROM fingerprints WHERE key IN (SELECT value FROM json_each(?))")
_UPSERT = (
    "INSERT OR REPLACE INTO fingerprints "
    "(key, state, token, at_ms, reply, expires_at_ms, content_digest) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
# Parameters: key, token, now_ms. Touch the row only while it holds PENDING(token) or
# SENDING(token), unexpired.
_RELEASE = (
    "DELETE FROM fingerprints "
    "WHERE key = ? AND state IN ('pending', 'sending') AND token = ? AND expires_at_ms > ?"
)
# Parameters: state, at_ms, reply, expires_at_ms, then key, token, now_ms as for _RELEASE.
_SETTLE = (
    "UPDATE fingerprints SET state = ?, token = NULL, at_ms = ?, reply = ?, expires_at_ms = ? "
    "WHERE key = ? AND state IN ('pending', 'sending') AND token = ? AND expires_at_ms > ?"
)
# Parameters: at_ms, expires_at_ms, lease_ms, boot_id, beat_ms, then key, token, now_ms.
# PENDING(token) -> SENDING(token); SENDING(token) again is a retried call of the same attempt
# (idempotent).
_TO_SENDING = (
    "UPDATE fingerprints SET state = 'sending', at_ms = ?, expires_at_ms = ?, lease_ms = ?, "
    "boot_id = ?, beat_ms = ? "
    "WHERE key = ? AND state IN ('pending', 'sending') AND token = ? AND expires_at_ms > ?"
)
# Parameters: expires_at_ms, then key, token, now_ms. Renews the lease of PENDING(token).
_RENEW_PENDING = (
    "UPDATE fingerprints SET expires_at_ms = ? "
    "WHERE key = ? AND state = 'pending' AND token = ? AND expires_at_ms > ?"
)
# Parameters: at_ms (the heartbeat), lease_ms, the earliest expiry (0: keep it), boot_id,
# beat_ms, then key, token, now_ms. Renews SENDING(token).
_RENEW_SENDING = (
    "UPDATE fingerprints SET at_ms = ?, lease_ms = ?, expires_at_ms = max(expires_at_ms, ?), "
    "boot_id = ?, beat_ms = ? "
    "WHERE key = ? AND state = 'sending' AND token = ? AND expires_at_ms > ?"
)
# Parameters: key, now_ms. Deletes the row only while it is live (not expired).
_DELETE_LIVE = (
    "DELETE FROM fingerprints WHERE key = ? AND (expires_at_ms IS NULL OR expires_at_ms > ?)"
)

# Parameters (named): prefix, prefix_chars, now_ms, lease_ms, cutoff_ms, boot_id, beat_ms. One
# row per state a live record under the prefix reads as (as _record reads it; "foreign": a
# state the relay did not write, read as SENT): the count, how many are in doubt (UNKNOWN, or
# SENDING whose last heartbeat is a lease old, by _heartbeat_age_ms's age and the rule of
# relay.core.rules.heartbeat_state: its own lease, else lease_ms), the oldest in-doubt time
# and how many in-doubt records are dated at or before cutoff_ms.
_COUNT_STATES = """
SELECT reads, count(*), sum(doubt), min(CASE WHEN doubt THEN at_ms END),
       sum(doubt AND at_ms <= :cutoff_ms)
FROM (
    SELECT reads, at_ms,
           reads = 'unknown' OR (reads = 'sending' AND (CASE
               WHEN boot_id IS NULL OR beat_ms IS NULL OR boot_id = 'unknown'
                    THEN :now_ms - at_ms
               WHEN boot_id = :boot_id THEN :beat_ms - beat_ms
               ELSE lease END) >= lease) AS doubt
    FROM (
        SELECT CASE
                   WHEN state = 'pending' AND token IS NOT NULL AND token != '' THEN 'pending'
                   WHEN state = 'sending' AND token IS NOT NULL AND token != ''
                        AND at_ms IS NOT NULL THEN 'sending'
                   WHEN state = 'sent' THEN 'sent'
                   WHEN state = 'unknown' THEN 'unknown'
                   ELSE 'foreign'
               END AS reads,
               at_ms, boot_id, beat_ms, coalesce(lease_ms, :lease_ms) AS lease
        FROM fingerprints
        WHERE substr(key, 1, :prefix_chars) = :prefix
          AND (expires_at_ms IS NULL OR expires_at_ms > :now_ms)
    )
)
GROUP BY reads
"""

_Row = tuple[str, str | None, int | None, str | None, int | None, int | None, str | None,
             int | None, str | None]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


@functools.cache
def _this_boot() -> str:
    """``/proc/sys/kernel/random/boot_id`` (read once: it cannot change while a process runs),
    else ``"unknown"``."""
    try:
        with open(_BOOT_ID, encoding="ascii") as source:
            return source.read().strip() or "unknown"
    except OSError:
        return "unknown"


def boot_beat() -> tuple[str, int]:
    """(the id of this boot of the host, ``CLOCK_BOOTTIME`` in ms): the clock every process of
    the host shares, which counts suspend and is never stepped (clock_gettime(2)). On a host
    without a boot id the id is ``"unknown"``, and heartbeats are judged by the wall clock as
    before."""
    return _this_boot(), time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000


def _heartbeat_age_ms(at_ms: int, boot_id: str | None, beat_ms: int | None, now_ms: int,
                      lease_ms: int) -> int:
    """How old a SENDING row's last heartbeat is, ms (design.md §3, "SENDING and the heartbeat").

    Written in this boot: by the boot clock, which no step of the wall clock moves. Written by
    an earlier version (no boot clock in the row), or on a host that has no boot id: by the
    wall clock ``now_ms - at_ms``. Written in another boot: ``lease_ms`` at least, since every
    process of that boot, the attempt's included, has ended (the row reads as in doubt)."""
    if boot_id is None or beat_ms is None or boot_id == "unknown":
        return now_ms - at_ms
    here, beat_now = boot_beat()
    if boot_id == here:
        return beat_now - beat_ms
    return max(lease_ms, now_ms - at_ms)


def _ms(seconds: float) -> int:
    """Convert a duration in seconds to whole milliseconds, at least 1 ms."""
    return max(1, int(seconds * 1000))


def _lease_ms(op: SettleOp) -> int | None:
    """The lease a SENDING row keeps, in ms; None when the op names none (readers' own)."""
    return _ms(op.lease_s) if op.lease_s > 0 else None


def _clean(text: str) -> str:
    """Make ``text`` storable as UTF-8 (lone surrogates become U+FFFD)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _record(row: _Row, now_ms: int, lease_ms: int | None = None) -> Record:
    """Turn a live row into a :class:`Record`; an unrecognised state counts as SENT.

    With ``lease_ms`` (a reserve) a SENDING row reads as PENDING while its last heartbeat is
    younger than its attempt's own lease (``lease_ms`` for a row of an earlier version) and as
    UNKNOWN after it (its attempt died after the final dot).
    """
    state, token, at_ms, reply, expires_at_ms, own_lease_ms, boot_id, beat_ms, digest = row
    ttl_s = (expires_at_ms - now_ms) / 1000 if expires_at_ms is not None else None
    at = at_ms / 1000 if at_ms is not None else None
    age_s = (now_ms - at_ms) / 1000 if at_ms is not None else None
    if state == _PENDING and token:
        return Record(State.PENDING, token=token, ttl_s=ttl_s, content_digest=digest)
    if state == _SENDING and token and at_ms is not None:
        lease = own_lease_ms if own_lease_ms is not None else lease_ms
        beat_age_ms = _heartbeat_age_ms(at_ms, boot_id, beat_ms, now_ms, lease or 0)
        assert at is not None
        return dataclasses.replace(sending_record(
            token=token, at=at, ttl_s=ttl_s, age_s=beat_age_ms / 1000,
            own_lease_s=own_lease_ms / 1000 if own_lease_ms is not None else None,
            lease_s=lease_ms / 1000 if lease_ms is not None else None), content_digest=digest)
    if state == _SENT:
        return Record(State.SENT, at=at, reply=reply, ttl_s=ttl_s, age_s=age_s,
                      content_digest=digest)
    if state == _UNKNOWN:
        return Record(State.UNKNOWN, at=at, ttl_s=ttl_s, age_s=age_s, content_digest=digest)
    return Record(State.SENT, ttl_s=ttl_s)


def _live(row: _Row | None, now_ms: int) -> _Row | None:
    """Return ``row`` unless it is missing or expired."""
    if row is None or (row[4] is not None and row[4] <= now_ms):
        return None
    return row


_QUEUE_LIMIT_S = 30.0  # how long a call may wait behind this process's other calls
_COUNT_TIMEOUT_S = 120.0  # bound of count_states, a read of every row (an admin command's)


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _within(future: asyncio.Future[_T], timeout_s: float) -> _T:
    """``future``'s result, waiting at most ``timeout_s`` seconds; raises TimeoutError only
    when it is really not done (a loop that woke late to a finished future is no timeout)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await asyncio.shield(future)
    except TimeoutError:
        if future.done():
            return future.result()
        raise


def _read_outcome(future: asyncio.Future[Any]) -> None:
    """Mark a call's failure as read: a caller that gave up on it (timed out, or cancelled
    before or after its batch started) no longer waits for it, and asyncio would log it as
    an unhandled error ("Future exception was never retrieved")."""
    if not future.cancelled():
        future.exception()


class SqliteStore:
    """A :class:`~relay.core.interfaces.FingerprintStore` in SQLite; create it with :meth:`open`.

    ``op_timeout_s`` (seconds) bounds every operation and is also the time a write waits for
    another process's write lock (polled about every millisecond). Writes of concurrent calls
    share one transaction and one fsync (:mod:`relay.store.sqlite.writer`). Every method raises
    :class:`relay.core.errors.StoreError` on any failure.
    """

    def __init__(self, *, path: str, op_timeout_s: float = 2.0) -> None:
        """Prepare a store on ``path`` without touching the file; :meth:`open` connects."""
        self._path = path
        self._op_timeout_s = op_timeout_s
        # owns the connection, in its own thread
        self._writer = Writer("sqlite-store", op_timeout_s)
        self._closed = False
        self._settles = SqliteSettles(self._inspect_keys)

    def watch_settles(self, keys: Sequence[str]) -> AbstractAsyncContextManager[SettleWatch]:
        """The settles of ``keys``: this process's at once, another process's within
        :data:`relay.store.sqlite.settled.REREAD_S` (one shared re-read of the keys waited
        for)."""
        return self._settles.watching(keys)

    async def _inspect_keys(self, keys: list[str]) -> list[Record]:
        """What each of ``keys`` holds, in one statement. Raises :class:`StoreError`."""
        return await self.inspect_many(keys)

    async def inspect_many(self, keys: Sequence[str]) -> list[Record]:
        """What each of ``keys`` holds (ABSENT for none), in one statement (the keys as one
        JSON array). Raises :class:`StoreError` (op ``inspect``)."""
        if not keys:
            return []
        return await self._call("inspect", lambda conn, _now: _inspect_many(conn, keys),
                                in_tx=False)

    @classmethod
    async def open(cls, path: str, *, op_timeout_s: float = 2.0) -> SqliteStore:
        """Open (creating when missing) the database file at ``path`` and its parent directory.

        Several processes may open one file at once. Raises :class:`StoreError` (op ``open``)
        when the file cannot be opened or set up within ``op_timeout_s`` seconds.
        """
        store = cls(path=path, op_timeout_s=op_timeout_s)
        try:
            await store._call("open", lambda _conn, _now: store._connect(), in_tx=False)
        except StoreError:
            await store.close()
            raise
        return store

    async def reserve(
        self, keys: Sequence[str], *, token: str, lease_s: float, resend_unknown: bool = False,
        content_digest: str = "", replace_other_content: bool = False,
    ) -> list[Reservation]:
        """Create ``PENDING(token)`` with a TTL of ``lease_s`` seconds for every absent key,
        its row keeping ``content_digest`` (NULL for ``""``).

        All keys in one transaction; one :class:`Reservation` per key, in order. A key already
        holding ``PENDING(token)`` (same token) reports ``reserved=True`` again. A record
        :func:`relay.core.rules.takes_over` names (``resend_unknown``: in doubt;
        ``replace_other_content``: of other content) is replaced too (``reserved=True``,
        ``found`` the record replaced). Raises :class:`StoreError` (op ``reserve``).
        """
        if not keys:
            return []
        lease_ms = _ms(lease_s)
        claim = _Claim(token, lease_ms, content_digest, resend_unknown, replace_other_content)

        def body(conn: sqlite3.Connection, now_ms: int) -> list[Reservation]:
            return _reserve(conn, now_ms, keys, claim)

        return await self._call("reserve", body)

    async def settle(
        self, ops: Sequence[SettleOp], *, token: str, window_s: float
    ) -> list[bool]:
        """Apply every settlement in one transaction, each only if its key holds PENDING(token)
        or SENDING(token).

        SENT, UNKNOWN and SENDING record the time of the transaction (the clock of the host
        that holds the file, read inside the transaction) and expire ``window_s`` seconds after
        it. Returns per op whether it was applied. Raises :class:`StoreError` (op ``settle``).
        """
        if not ops:
            return []
        window_ms = _ms(window_s)

        def body(conn: sqlite3.Connection, now_ms: int) -> list[bool]:
            return _settle(conn, now_ms, ops, token, window_ms)

        applied = await self._call("settle", body)
        self._settles.announce(op.key for op, done in zip(ops, applied, strict=True)
                               if done and op.action is not Settle.SENDING)
        return applied

    async def renew(self, keys: Sequence[str], *, token: str, lease_s: float,
                    window_s: float = 0.0) -> list[bool]:
        """Keep this attempt's reservations alive: PENDING(token) expires ``lease_s`` seconds
        from now again, SENDING(token) gets now as its heartbeat and, with ``window_s`` > 0,
        expires no sooner than ``window_s`` seconds from now (else its expiry is kept). One
        transaction; per key, whether it was still this attempt's. Raises :class:`StoreError`
        (op ``renew``)."""
        if not keys:
            return []
        lease_ms = _ms(lease_s)
        window_ms = _ms(window_s) if window_s > 0 else 0

        def body(conn: sqlite3.Connection, now_ms: int) -> list[bool]:
            return _renew(conn, now_ms, keys, token, lease_ms, window_ms)

        return await self._call("renew", body)

    async def inspect(self, key: str) -> Record:
        """Return what ``key`` holds, ``ttl_s`` in seconds (None: no expiry).

        Raises :class:`StoreError` (op ``inspect``).
        """
        return await self._call("inspect", lambda conn, _now: _inspect(conn, key), in_tx=False)

    async def force_release(self, key: str, *, expected: Record | None = None) -> bool:
        """Delete ``key``; with ``expected`` only while it still holds that record (read in
        the same write transaction). True when a live row was deleted.

        Raises :class:`StoreError` (op ``force_release``).
        """
        def body(conn: sqlite3.Connection, now_ms: int) -> bool:
            return _force_release(conn, now_ms, key, expected)

        released = await self._call("force_release", body)
        self._settles.announce([key] if released else [])
        return released

    async def force_mark_sent(self, key: str, *, reply: str, window_s: float,
                              expected: Record | None = None) -> bool:
        """Set SENT(now, ``reply``) under ``key`` for ``window_s`` seconds (an operator's
        decision); with ``expected``, only while the key still holds that record (no live row,
        for ABSENT), read in the same write transaction. True when written. Raises
        :class:`StoreError` (op ``force_mark_sent``)."""
        window_ms = _ms(window_s)

        def body(conn: sqlite3.Connection, now_ms: int) -> bool:
            if expected is not None and not _still(conn, now_ms, key, expected):
                return False
            conn.execute(_UPSERT, (key, _SENT, None, now_ms, _clean(reply), now_ms + window_ms,
                                   None))
            return True

        written = await self._call("force_mark_sent", body)
        self._settles.announce([key] if written else [])
        return written

    async def count_states(self, prefix: str, *, lease_s: float, older_than_s: float,
                           max_keys: int | None = None,
                           progress: Callable[[int], None] | None = None) -> StateCounts:
        """Count the live rows whose key starts with ``prefix`` by state, in one query
        (:class:`relay.core.interfaces.StateCounter`): a SENDING row is in doubt once its last
        heartbeat is its own lease old (``lease_s`` seconds for a row that names none); a
        state the relay did not write counts as SENT and ``foreign``. Times are this host's
        wall clock, as the store's. ``max_keys`` and ``progress`` are not used: the count is
        one query, always complete, reading every row (about a second per million), so it is
        bounded by ``_COUNT_TIMEOUT_S`` rather than ``op_timeout_s``. Raises
        :class:`StoreError` (op ``count_states``)."""
        del max_keys, progress  # one query: nothing to cap or to report on the way

        def body(conn: sqlite3.Connection | None, _now: int) -> StateCounts:
            return _count_states(conn, prefix, _ms(lease_s), int(older_than_s * 1000))

        return await self._call("count_states", body, in_tx=False,
                                timeout_s=max(self._op_timeout_s, _COUNT_TIMEOUT_S))

    def rate_limiter(self, prefix: str) -> SqliteRateLimiter:
        """The rate limiter in this store's file (:mod:`relay.store.sqlite.limits`), its
        buckets under ``prefix``."""
        return SqliteRateLimiter(self, prefix)

    async def acquire_limits(self, prefix: str, checks: Sequence[LimitCheck]) -> LimitVerdict:
        """Take every check's cost or none, in one transaction
        (:func:`relay.store.sqlite.limits.acquire_in`). Raises :class:`StoreError` (op
        ``rate_limit``)."""
        def body(conn: sqlite3.Connection, now_ms: int) -> LimitVerdict:
            return sqlite_limits.acquire_in(conn, now_ms, prefix, checks)

        return await self._call("rate_limit", body)

    async def ping(self) -> None:
        """Check that the database answers a query; raises :class:`StoreError` (op ``ping``)."""
        await self._call("ping", lambda conn, _now: _db(conn).execute("SELECT 1").fetchone(),
                         in_tx=False)

    async def identity(self) -> str:
        """``sqlite:<device>:<inode>`` of the database file (the same file under any path or
        link to it). Raises :class:`StoreError` (op ``identity``) when it cannot be read."""
        try:
            st = await asyncio.to_thread(os.stat, self._path)
        except OSError as exc:
            raise StoreError("identity", f"cannot stat {self._path}: {exc.strerror}") from exc
        return f"sqlite:{st.st_dev}:{st.st_ino}"

    async def purge_expired(self) -> int:
        """Delete expired rows; return how many. Raises :class:`StoreError` (op ``purge``)."""
        return await self._call("purge", _purge)

    async def close(self) -> None:
        """Close the connection and stop the writer thread once the calls queued before are
        done; later calls raise StoreError."""
        if self._closed:
            return
        self._closed = True
        await self._settles.close()
        op = Op(lambda _conn, _now: self._disconnect(), False, asyncio.get_running_loop())
        self._writer.submit(op)
        self._writer.stop()
        with contextlib.suppress(sqlite3.Error, OSError):
            await op.done

    # -- event-loop side ---------------------------------------------------------------------

    async def _call(self, op_name: str, fn: Callable[[Any, int], _T], *,
                    in_tx: bool = True, timeout_s: float | None = None) -> _T:
        """Queue ``fn`` for the writer thread, translating every failure into StoreError.

        ``fn(conn, now_ms)`` runs inside a shared write transaction when ``in_tx`` (``now_ms``
        read inside it), else alone with ``now_ms`` 0. The time limit is on the database, not on
        this process: ``op_timeout_s`` counts from when the writer starts ``fn``'s batch (time
        queued behind this process's own calls is not an outage; it does cover the wait for
        another process's write lock), and a call that finished is never reported as timed out
        because the event loop was too busy to notice in time. ``_QUEUE_LIMIT_S`` bounds the
        wait for the writer. ``timeout_s`` replaces ``op_timeout_s`` for one call.
        """
        if self._closed:
            raise StoreError(op_name, "the SQLite store is closed")
        op = Op(fn, in_tx, asyncio.get_running_loop())
        op.done.add_done_callback(_read_outcome)  # also read when this call gave up on it
        self._writer.submit(op)
        limit_s = self._op_timeout_s if timeout_s is None else timeout_s
        try:
            await _within(op.started, max(_QUEUE_LIMIT_S, self._op_timeout_s))
            result: _T = await _within(op.done, limit_s)
        except TimeoutError as exc:
            raise StoreError(op_name, f"SQLite did not answer within {limit_s:g} s") from exc
        # UnicodeError: a key or token that cannot be encoded as UTF-8 is refused by sqlite3
        except (sqlite3.Error, OSError, UnicodeError) as exc:
            raise StoreError(op_name, f"{type(exc).__name__}: {exc}") from exc
        return result

    # -- writer-thread side ------------------------------------------------------------------

    def _connect(self) -> None:
        if self._path != ":memory:":
            parent = os.path.dirname(os.path.abspath(self._path))
            os.makedirs(parent, exist_ok=True)
        # isolation_level=None: no implicit transactions; writes use BEGIN IMMEDIATE explicitly.
        conn = sqlite3.connect(self._path, isolation_level=None, timeout=BUSY_POLL_MS / 1000,
                               check_same_thread=False)
        try:
            _set_up(conn, time.monotonic() + self._op_timeout_s)
        except BaseException:
            conn.close()
            raise
        self._writer.conn = conn

    def _disconnect(self) -> None:
        if self._writer.conn is not None:
            self._writer.conn.close()
            self._writer.conn = None


class SqliteRateLimiter:
    """:class:`relay.core.interfaces.RateLimiter` in a :class:`SqliteStore`'s file, its buckets
    under ``prefix``. Raises :class:`StoreError` (op ``rate_limit``)."""

    def __init__(self, store: SqliteStore, prefix: str) -> None:
        self._store = store
        self._prefix = prefix

    async def acquire(self, checks: Sequence[LimitCheck]) -> LimitVerdict:
        """Take every check's cost or none (one transaction)."""
        if not checks:
            return LimitVerdict(allowed=True)
        return await self._store.acquire_limits(self._prefix, checks)


def _db(conn: sqlite3.Connection | None) -> sqlite3.Connection:
    if conn is None:
        raise sqlite3.ProgrammingError("the SQLite store is not open")
    return conn


def _set_up(conn: sqlite3.Connection, deadline: float) -> None:
    """Put the file in WAL mode and create the schema, retrying while another process holds a
    lock until ``deadline`` (``time.monotonic()``); raises sqlite3.Error after it.

    Switching to WAL takes an exclusive lock and does not wait through the busy timeout, so two
    processes opening a new file at once can see SQLITE_BUSY here; the schema is created and
    upgraded in one BEGIN IMMEDIATE so two processes never both add a column.
    """
    pause_s = 0.001
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            break
        except sqlite3.OperationalError as exc:
            if not locked(exc) or time.monotonic() + pause_s > deadline:
                raise
            pause(pause_s)
            pause_s = min(pause_s * 2, 0.05)
    # FULL, not NORMAL: in WAL mode NORMAL may lose the last commits on power loss or an OS
    # crash, and a lost SENDING or SENT row lets a retried message through twice. FULL fsyncs
    # the WAL at every COMMIT; group commit shares that fsync among concurrent calls.
    conn.execute("PRAGMA synchronous = FULL")
    begin_immediate(conn, deadline)
    try:
        conn.execute(_SCHEMA)
        _add_columns(conn)
        conn.execute(_INDEX)
        for statement in sqlite_limits.SCHEMA:
            conn.execute(statement)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


@dataclasses.dataclass(frozen=True)
class _Claim:
    """What one reserve writes and may replace: its ``token``, its lease (ms), the message's
    stored ``content_digest`` (``""``: none) and which records it takes over
    (:func:`relay.core.rules.takes_over`)."""

    token: str
    lease_ms: int
    content_digest: str
    resend_unknown: bool
    replace_other_content: bool


def _add_columns(conn: sqlite3.Connection) -> None:
    """Add the columns a file of an earlier version lacks (its rows stay, the new columns
    NULL): the SENDING attempt's lease, its boot clock, the content digest."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(fingerprints)")}
    if "lease_ms" not in columns:
        conn.execute(_ADD_LEASE)
    if "boot_id" not in columns:
        for statement in _ADD_BEAT:
            conn.execute(statement)
    if "content_digest" not in columns:
        conn.execute(_ADD_DIGEST)


def _reserve(conn: sqlite3.Connection, now_ms: int, keys: Sequence[str],
             claim: _Claim) -> list[Reservation]:
    out: list[Reservation] = []
    mine = (_PENDING, claim.token, None, None, now_ms + claim.lease_ms,
            claim.content_digest or None)
    for key in keys:
        row = _live(conn.execute(_SELECT, (key,)).fetchone(), now_ms)
        if row is None:
            conn.execute(_UPSERT, (key, *mine))
            out.append(Reservation(key=key, reserved=True))
        elif row[0] == _PENDING and row[1] == claim.token:
            out.append(Reservation(key=key, reserved=True))
        else:
            found = _record(row, now_ms, claim.lease_ms)
            take_over = takes_over(found, lease_s=claim.lease_ms / 1000,
                                   content_digest=claim.content_digest,
                                   resend_unknown=claim.resend_unknown,
                                   replace_other_content=claim.replace_other_content)
            if take_over:
                conn.execute(_UPSERT, (key, *mine))
            out.append(Reservation(key=key, reserved=take_over, found=found))
    return out


def _settle(conn: sqlite3.Connection, now_ms: int, ops: Sequence[SettleOp], token: str,
            window_ms: int) -> list[bool]:
    done: list[bool] = []
    at_ms, expires_ms = now_ms, now_ms + window_ms
    for op in ops:
        mine = (op.key, token, now_ms)
        if op.action is Settle.RELEASE:
            cursor = conn.execute(_RELEASE, mine)
        elif op.action is Settle.SENDING:
            cursor = conn.execute(_TO_SENDING, (at_ms, expires_ms, _lease_ms(op), *boot_beat(),
                                                *mine))
        else:
            state = _SENT if op.action is Settle.SENT else _UNKNOWN
            reply = _clean(op.reply) if op.action is Settle.SENT else None
            cursor = conn.execute(_SETTLE, (state, at_ms, reply, expires_ms, *mine))
        done.append(cursor.rowcount == 1)
    return done


def _renew(conn: sqlite3.Connection, now_ms: int, keys: Sequence[str], token: str,
           lease_ms: int, window_ms: int = 0) -> list[bool]:
    done: list[bool] = []
    expires_ms = now_ms + window_ms if window_ms else 0
    for key in keys:
        mine = (key, token, now_ms)
        cursor = conn.execute(_RENEW_PENDING, (now_ms + lease_ms, *mine))
        if cursor.rowcount != 1:
            cursor = conn.execute(_RENEW_SENDING, (now_ms, lease_ms, expires_ms, *boot_beat(),
                                                   *mine))
        done.append(cursor.rowcount == 1)
    return done


def _inspect(conn: sqlite3.Connection | None, key: str) -> Record:
    now_ms = int(time.time() * 1000)
    row = _live(_db(conn).execute(_SELECT, (key,)).fetchone(), now_ms)
    return Record(State.ABSENT) if row is None else _record(row, now_ms)


def _inspect_many(conn: sqlite3.Connection | None, keys: Sequence[str]) -> list[Record]:
    """What each of ``keys`` holds, read by one statement (the keys as one JSON array)."""
    now_ms = int(time.time() * 1000)
    rows = {row[0]: _live(row[1:], now_ms) for row in _db(conn).execute(
        _SELECT_MANY, (json.dumps(list(keys)),))}
    return [Record(State.ABSENT) if (row := rows.get(key)) is None else _record(row, now_ms)
            for key in keys]


def _count_states(conn: sqlite3.Connection | None, prefix: str, lease_ms: int,
                  older_than_ms: int) -> StateCounts:
    now_ms = int(time.time() * 1000)
    boot_id, beat_ms = boot_beat()
    rows = _db(conn).execute(_COUNT_STATES, {
        "prefix": prefix, "prefix_chars": len(prefix), "now_ms": now_ms, "lease_ms": lease_ms,
        "cutoff_ms": now_ms - older_than_ms,
        "boot_id": boot_id, "beat_ms": beat_ms}).fetchall()
    by_state = {reads: (count, doubt, oldest, older)
                for reads, count, doubt, oldest, older in rows}
    none = (0, 0, None, 0)
    foreign = by_state.get("foreign", none)[0]
    oldest_ms = min((row[2] for row in by_state.values() if row[2] is not None), default=None)
    return StateCounts(
        pending=by_state.get(_PENDING, none)[0], sending=by_state.get(_SENDING, none)[0],
        sent=by_state.get(_SENT, none)[0] + foreign, unknown=by_state.get(_UNKNOWN, none)[0],
        foreign=foreign, sending_past_lease=by_state.get(_SENDING, none)[1],
        scanned=sum(row[0] for row in by_state.values()), complete=True,
        oldest_in_doubt_at=None if oldest_ms is None else oldest_ms / 1000,
        oldest_in_doubt_age_s=None if oldest_ms is None else (now_ms - oldest_ms) / 1000,
        in_doubt_older=sum(row[3] or 0 for row in by_state.values()))


def _still(conn: sqlite3.Connection, now_ms: int, key: str, expected: Record) -> bool:
    """Whether ``key`` still holds the record ``expected`` an operator read (no live row,
    for ABSENT)."""
    row = _live(conn.execute(_SELECT, (key,)).fetchone(), now_ms)
    if row is None:
        return expected.state is State.ABSENT
    return same_record(_record(row, now_ms), expected)


def _force_release(conn: sqlite3.Connection, now_ms: int, key: str,
                   expected: Record | None) -> bool:
    if expected is not None and (expected.state is State.ABSENT
                                 or not _still(conn, now_ms, key, expected)):
        return False  # absent, or no longer what the operator saw
    cursor = conn.execute(_DELETE_LIVE, (key, now_ms))
    conn.execute("DELETE FROM fingerprints WHERE key = ?", (key,))  # an expired leftover
    return cursor.rowcount == 1


def _purge(conn: sqlite3.Connection, now_ms: int) -> int:
    cursor = conn.execute(
        "DELETE FROM fingerprints WHERE expires_at_ms IS NOT NULL AND expires_at_ms <= ?",
        (now_ms,),
    )
    return cursor.rowcount
