"""PostgreSQL fingerprint store over an asyncpg pool (design.md §3).

One row per key in ``dedup_relay_fingerprints`` (:mod:`.migrations`): ``state`` (pending,
sending, sent, unknown; anything else was written by another application and counts as SENT),
the attempt's ``token`` (PENDING, SENDING), ``at`` (SENT / UNKNOWN: when; SENDING: its last
heartbeat), the upstream's ``reply`` (SENT), ``expires_at`` and, for SENDING, the attempt's
``lease_ms``. A row whose ``expires_at`` passed counts as absent: the next reserve takes it in
the same statement, and the cleanup task deletes such rows in bounded batches.

Every call is one statement, so one round trip for all the keys of a message phase, and every
time it records or compares is the database's ``now()``, never the relay's clock: relays whose
clocks disagree still agree on a record's age. Every transition compares the attempt's token
in its ``WHERE``. Every asyncpg, OS and timeout error becomes
:class:`relay.core.errors.StoreError` here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import asyncpg

from relay.core.errors import StartupError, StoreError
from relay.core.interfaces import (
    Record,
    Reservation,
    Settle,
    SettleOp,
    SettleWatch,
    State,
    StateCounts,
)
from relay.core.rules import same_record, sending_record
from relay.store.postgres import limits, migrations
from relay.store.postgres.calls import (
    ERRORS,
    STARTUP_CHECK_S,
    WRITABLE,
    as_store_error,
    bounded_call,
    close_connection,
    close_pool,
    delete_in_batches,
    deleted_rows,
    open_pool,
    refused_connect,
    storable,
)
from relay.store.postgres.calls import milliseconds as _ms
from relay.store.postgres.limits import PostgresRateLimiter
from relay.store.postgres.migrations import FINGERPRINTS as _T_
from relay.store.postgres.settled import NOTIFY, SETTLED_CHANNEL, PostgresSettles

log = logging.getLogger(__name__)

_R = TypeVar("_R")

POOL_SIZE = 10
"""Most connections one relay process (one worker) opens to PostgreSQL."""
CLEANUP_INTERVAL_S = 5.0
CLEANUP_BATCH = 1000
CLEANUP_MAX_BATCHES = 10
"""A cleanup round deletes at most ``CLEANUP_BATCH * CLEANUP_MAX_BATCHES`` expired rows."""
_COUNT_TIMEOUT_S = 120.0  # bound of count_states, a read of every row (an admin command's)
_RESERVE_ATTEMPTS = 5  # rounds for keys a concurrent transaction changed under a reserve

# the columns a record is read from, times as unix seconds (float8), plus the database's now
_COLUMNS = ("f.state, f.token, extract(epoch FROM f.at)::float8 AS at, f.reply, "
            "extract(epoch FROM f.expires_at)::float8 AS expires_at, f.lease_ms, "
            "f.content_digest")
_NOW = "extract(epoch FROM now())::float8"
_MS = "* interval '1 millisecond'"
_OURS = ("f.state IN ('pending', 'sending') AND f.token = $2 AND f.expires_at > now()")

# A live row in doubt: UNKNOWN, or SENDING whose last heartbeat is its own lease old ($3, the
# reserve's lease, for one that names none): the rule of relay.core.rules.heartbeat_state (the
# reference), judged here in the statement
_IN_DOUBT = f"""(f.state = 'unknown'
           OR (f.state = 'sending' AND f.token <> '' AND f.at IS NOT NULL
               AND now() - f.at >= coalesce(f.lease_ms, $3::bigint) {_MS}))"""

# $1 keys, $2 token, $3 lease ms, $4 take over a record in doubt, $5 the message's content digest
# (NULL: none), $6 take over a SENT or in-doubt record of other content (key_reuse = relay): the
# twin of relay.core.rules.takes_over. One row per key in order: whether this attempt holds
# PENDING(token, $5) now (inserted, an expired row or a record taken over, or its own PENDING:
# a retried reserve), ``took_at`` and ``took``: the time and the state#digest of a record it took
# over (kept in ``at`` and ``reply`` of the new PENDING row, read back by RETURNING: what the row
# held once its lock was ours; PostgreSQL before 18 has no RETURNING OLD), and the row as it was
# before (``seen``, the statement's snapshot, read before any wait for a lock: what a loser
# found). Rows are locked in key order (no deadlock between two multi-key reserves).
_RESERVE = f"""
WITH input AS (
    SELECT k, ord FROM unnest($1::text[]) WITH ORDINALITY AS t(k, ord)
), seen AS (
    SELECT f.key, {_COLUMNS} FROM {_T_} f WHERE f.key = ANY($1::text[])
), taken AS (
    INSERT INTO {_T_} AS f (key, state, token, expires_at, content_digest)
    SELECT DISTINCT k, 'pending', $2, now() + $3::bigint {_MS}, $5::text FROM input ORDER BY k
    ON CONFLICT (key) DO UPDATE
    SET state = 'pending', token = EXCLUDED.token,
        at = CASE WHEN f.expires_at > now() AND f.state IN ('unknown', 'sending', 'sent')
                  THEN coalesce(f.at, now()) END,
        reply = CASE WHEN f.expires_at > now() AND f.state IN ('unknown', 'sending', 'sent')
                     THEN f.state || coalesce('#' || f.content_digest, '') END,
        expires_at = EXCLUDED.expires_at, lease_ms = NULL,
        content_digest = EXCLUDED.content_digest
    WHERE f.expires_at <= now()
       OR (f.state = 'pending' AND f.token = EXCLUDED.token)
       OR ($4::boolean AND {_IN_DOUBT})
       OR ($6::boolean AND $5::text IS NOT NULL AND f.content_digest IS NOT NULL
           AND f.content_digest <> $5::text AND (f.state = 'sent' OR {_IN_DOUBT}))
    RETURNING f.key, extract(epoch FROM f.at)::float8 AS took_at, f.reply AS took
)
SELECT input.k AS key, taken.key IS NOT NULL AS reserved, taken.took_at, taken.took,
       seen.state, seen.token, seen.at, seen.reply, seen.expires_at, seen.lease_ms,
       seen.content_digest, {_NOW} AS now
FROM input LEFT JOIN taken ON taken.key = input.k LEFT JOIN seen ON seen.key = input.k
ORDER BY input.ord
"""

# The rows of ``keys`` (an SQL set), locked in key order before a statement changes any of them:
# an UPDATE or DELETE locks rows in the order of its plan (a bitmap heap scan: the order on
# disk), a reserve inserts in key order, so without this a renew or a settle and a retry's
# reserve of the same keys could each hold one and wait for the other (PostgreSQL then fails
# one as a deadlock). ORDER BY with FOR UPDATE takes each lock as the
# sorted rows are read (LockRows above Sort); MATERIALIZED keeps it one step the statement's
# changes join (a row is changed only once the CTE locked it).
_LOCKED = f"""locked AS MATERIALIZED (
    SELECT f.key FROM {_T_} f WHERE f.key IN {{keys}} ORDER BY f.key FOR UPDATE OF f
)"""

# $1 keys, $2 token, $3 actions, $4 replies, $5 SENDING leases in ms (NULL: none kept), $6 the
# windows in ms. PENDING|SENDING(token) -> SENT | UNKNOWN | SENDING (SENDING(token) again: a
# retry, left as it is) | deleted. One row per op in order: whether it applied.
_SETTLE = f"""
WITH ops AS (
    SELECT * FROM unnest($1::text[], $3::text[], $4::text[], $5::bigint[], $6::bigint[])
        WITH ORDINALITY AS o(key, action, reply, lease_ms, window_ms, ord)
), {_LOCKED.format(keys="(SELECT key FROM ops)")}, released AS (
    DELETE FROM {_T_} f USING ops, locked
    WHERE ops.action = 'release' AND f.key = ops.key AND locked.key = f.key AND {_OURS}
    RETURNING f.key
), changed AS (
    UPDATE {_T_} f SET
        state = ops.action,
        token = CASE WHEN ops.action = 'sending' THEN f.token END,
        at = CASE WHEN ops.action = 'sending' AND f.state = 'sending' THEN f.at ELSE now() END,
        reply = CASE WHEN ops.action = 'sent' THEN ops.reply END,
        expires_at = CASE WHEN ops.action = 'sending' AND f.state = 'sending' THEN f.expires_at
                          ELSE now() + ops.window_ms {_MS} END,
        lease_ms = CASE WHEN ops.action <> 'sending' THEN NULL
                        WHEN f.state = 'sending' THEN f.lease_ms ELSE ops.lease_ms END
    FROM ops, locked
    WHERE ops.action <> 'release' AND f.key = ops.key AND locked.key = f.key AND {_OURS}
    RETURNING f.key
)
SELECT d.done,
    CASE WHEN d.done AND d.action <> 'sending' THEN pg_notify('{SETTLED_CHANNEL}', d.key) END
FROM (SELECT (ops.action = 'release' AND ops.key IN (SELECT key FROM released))
             OR (ops.action <> 'release' AND ops.key IN (SELECT key FROM changed)) AS done,
             ops.action, ops.key, ops.ord
      FROM ops) d
ORDER BY d.ord
"""

# $1 keys, $2 token, $3 lease ms, $4 window ms (0: keep a SENDING row's expiry). PENDING(token)
# lives a lease from now again; SENDING(token) gets now as its heartbeat, the lease, and an
# expiry no sooner than the window from now. Returns the keys still this attempt's.
_RENEW = f"""
WITH {_LOCKED.format(keys="(SELECT unnest($1::text[]))")}
UPDATE {_T_} f SET
    expires_at = CASE WHEN f.state = 'pending' THEN now() + $3::bigint {_MS}
                      WHEN $4::bigint > 0 THEN greatest(f.expires_at, now() + $4::bigint {_MS})
                      ELSE f.expires_at END,
    at = CASE WHEN f.state = 'sending' THEN now() ELSE f.at END,
    lease_ms = CASE WHEN f.state = 'sending' THEN $3::bigint ELSE f.lease_ms END
FROM locked
WHERE f.key = locked.key AND {_OURS}
RETURNING f.key
"""

_INSPECT = f"SELECT {_COLUMNS}, {_NOW} AS now FROM {_T_} f WHERE f.key = $1"
_INSPECT_MANY = (f"SELECT f.key, {_COLUMNS}, {_NOW} AS now FROM {_T_} f "
                 "WHERE f.key = ANY($1::text[])")

_FORCE_SENT = f"""
INSERT INTO {_T_} AS f (key, state, at, reply, expires_at) VALUES ($1, 'sent', now(), $2,
    now() + $3::bigint {_MS})
ON CONFLICT (key) DO UPDATE SET state = 'sent', token = NULL, at = now(), reply = $2,
    expires_at = now() + $3::bigint {_MS}, lease_ms = NULL, content_digest = NULL
"""
# The same, only where the key holds no live row (an operator saw it absent); a row a
# concurrent reserve inserts is waited for and then left alone. Returns the key when written.
_FORCE_SENT_IF_ABSENT = _FORCE_SENT + " WHERE f.expires_at <= now() RETURNING f.key"

# $1 prefix, $2 lease ms for a SENDING row that names none, $3 the in-doubt age cutoff in ms.
# One row per state a live record under the prefix reads as ("foreign": a state the relay did
# not write, read as SENT): count, in doubt, the oldest in-doubt time, in doubt and older. A
# SENDING row is in doubt by the rule of relay.core.rules.heartbeat_state, judged in SQL.
_COUNT_STATES = f"""
SELECT reads, count(*) AS n, count(*) FILTER (WHERE doubt) AS doubt,
       extract(epoch FROM min(at) FILTER (WHERE doubt))::float8 AS oldest,
       count(*) FILTER (WHERE doubt AND at <= now() - $3::bigint {_MS}) AS older,
       {_NOW} AS now
FROM (
    SELECT reads, at,
           reads = 'unknown' OR (reads = 'sending'
               AND now() - at >= coalesce(lease_ms, $2::bigint) {_MS}) AS doubt
    FROM (
        SELECT CASE
                   WHEN state = 'pending' AND token <> '' THEN 'pending'
                   WHEN state = 'sending' AND token <> '' AND at IS NOT NULL THEN 'sending'
                   WHEN state = 'sent' THEN 'sent'
                   WHEN state = 'unknown' THEN 'unknown'
                   ELSE 'foreign'
               END AS reads, at, lease_ms
        FROM {_T_} WHERE left(key, length($1)) = $1 AND expires_at > now()
    ) AS live
) AS judged
GROUP BY reads
"""

# $1 most rows to delete. The ctid subselect bounds the work of one statement; a row taken
# over since the subselect read it has another ctid (and a later expiry) and stays. SKIP
# LOCKED: the cleanup never waits for a row lock, so it never deadlocks with a reserve taking
# the same expired rows over in key order (PostgreSQL would fail one of them as a deadlock).
_CLEANUP = f"""
DELETE FROM {_T_} WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {_T_} WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED))
    AND expires_at <= now()
"""


_ACTIONS = {Settle.SENT: "sent", Settle.UNKNOWN: "unknown", Settle.SENDING: "sending",
            Settle.RELEASE: "release"}


def _record(row: Any, lease_ms: int | None = None) -> Record:
    """A live row (``state, token, at, reply, expires_at, lease_ms, now``; times in unix
    seconds) as a :class:`Record`; an unrecognised state counts as SENT. With ``lease_ms`` (a
    reserve) SENDING reads as PENDING while its last heartbeat is younger than its own lease
    (``lease_ms`` when it names none), and as UNKNOWN after it."""
    state, token, at, reply = row["state"], row["token"], row["at"], row["reply"]
    now, digest = row["now"], row["content_digest"]
    expires_at = row["expires_at"]
    ttl_s = None if math.isinf(expires_at) else expires_at - now  # 'infinity': no expiry
    age_s = now - at if at is not None else None
    if state == "pending" and token:
        return Record(State.PENDING, token=token, ttl_s=ttl_s, content_digest=digest)
    if state == "sending" and token and at is not None:
        own_ms = row["lease_ms"]
        return dataclasses.replace(sending_record(
            token=token, at=at, ttl_s=ttl_s, age_s=age_s,
            own_lease_s=own_ms / 1000 if own_ms is not None else None,
            lease_s=lease_ms / 1000 if lease_ms is not None else None), content_digest=digest)
    if state == "sent":
        return Record(State.SENT, at=at, reply=reply, ttl_s=ttl_s, age_s=age_s,
                      content_digest=digest)
    if state == "unknown":
        return Record(State.UNKNOWN, at=at, ttl_s=ttl_s, age_s=age_s, content_digest=digest)
    return Record(State.SENT, ttl_s=ttl_s)


class PostgresStore:
    """:class:`relay.core.interfaces.FingerprintStore` and ``StateCounter`` on PostgreSQL.

    Build it with :meth:`open`. ``op_timeout_s`` bounds every call (waiting for a pooled
    connection included); a call that fails or times out raises :class:`StoreError` naming
    the operation.
    """

    def __init__(self, pool: asyncpg.Pool, *, op_timeout_s: float = 1.0,
                 cleanup_interval_s: float | None = CLEANUP_INTERVAL_S,
                 cleanup_batch: int = CLEANUP_BATCH,
                 cleanup_max_batches: int = CLEANUP_MAX_BATCHES) -> None:
        self._pool = pool
        self._op_timeout_s = op_timeout_s
        self._closed = False
        self._schema_checked = False  # open() checked it, or a probe did since
        self._cleanup_batch = cleanup_batch
        self._cleanup_max_batches = cleanup_max_batches
        self._cleanup: asyncio.Task[None] | None = None
        self._settles = PostgresSettles(pool, op_timeout_s)
        if cleanup_interval_s is not None:
            self._cleanup = asyncio.get_running_loop().create_task(
                self._cleanup_loop(cleanup_interval_s), name="postgres-cleanup")

    @classmethod
    async def open(cls, url: str, *, op_timeout_s: float = 1.0, pool_size: int = POOL_SIZE,
                   check_schema: bool = True,
                   cleanup_interval_s: float | None = CLEANUP_INTERVAL_S) -> PostgresStore:
        """A store on the database ``url`` names (``postgresql://USER[:PASSWORD]@HOST:PORT/DB``
        with libpq's query parameters: ``sslmode``, ``sslrootcert``, ``sslcert``, ``sslkey``,
        ``passfile``...; any other parameter is a server setting such as ``search_path``),
        at most ``pool_size`` connections. With ``check_schema`` the schema is checked on a
        first connection: :class:`relay.core.errors.StartupError` naming ``dedup-relay db
        upgrade`` when it is missing or old; a database that does not answer is logged and
        the store fails its calls until it does. Raises :class:`StoreError` for a URL asyncpg
        refuses. ``cleanup_interval_s`` (None: no cleanup task) is the pause between
        cleanup rounds."""
        pool = await open_pool(url, max_size=pool_size, op_name="open", limit_s=op_timeout_s)
        store = cls(pool, op_timeout_s=op_timeout_s, cleanup_interval_s=cleanup_interval_s)
        if not check_schema:
            store._schema_checked = True
            return store
        try:  # not a message's path: a database slow to connect gets longer than a call
            await store._call("check_schema", lambda conn: migrations.check(conn, "store"),
                              timeout_s=max(STARTUP_CHECK_S, op_timeout_s))
            store._schema_checked = True
        except migrations.SchemaError as exc:
            await store.close()
            raise StartupError(str(exc)) from exc
        except StoreError as exc:
            refused = refused_connect(exc)
            if refused is not None:  # a URL no retry makes right: do not serve 451 forever
                await store.close()
                raise StartupError(f"the store's database refused the connection: {refused}; "
                                   "fix the URL, or create the database and run `dedup-relay "
                                   "db upgrade`") from exc
            log.warning("postgresql not reachable at start-up (%s); its schema is checked by "
                        "the first readiness probe it answers (the store's calls fail until "
                        "then, answered per store_down)", exc)
        return store

    async def reserve(self, keys: Sequence[str], *, token: str, lease_s: float,
                      resend_unknown: bool = False, content_digest: str = "",
                      replace_other_content: bool = False) -> list[Reservation]:
        """Create PENDING(token) for ``lease_s`` seconds under every absent (or expired) key,
        its row keeping ``content_digest`` (NULL for ``""``), in one statement; also replace
        a record :func:`relay.core.rules.takes_over` names (``resend_unknown``: in doubt;
        ``replace_other_content``: of other content), judged in the statement. A key that a
        concurrent transaction changed under the statement is asked again (rare: another
        round trip). Raises :class:`StoreError` (op ``reserve``)."""
        if not keys:
            return []
        lease_ms = _ms(lease_s)
        answers: dict[str, Reservation] = {}
        todo = list(dict.fromkeys(keys))
        for _ in range(_RESERVE_ATTEMPTS):
            rows = await self._fetch("reserve", _RESERVE, todo, token, lease_ms,
                                     resend_unknown, content_digest or None,
                                     replace_other_content)
            todo = []
            for row in rows:
                answer = _reservation(row, token, lease_ms)
                if answer is None:
                    todo.append(row["key"])
                else:
                    answers[row["key"]] = answer
            if not todo:
                return [answers[key] for key in keys]
        raise StoreError("reserve", f"{len(todo)} key(s) kept changing under the reserve")

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        """Apply every settlement in one statement, each only while its key holds
        PENDING(token) or SENDING(token); SENT, UNKNOWN and SENDING expire the op's window
        (``window_s`` when it names none) from the database's now. Returns per op whether it
        applied. Raises :class:`StoreError` (op ``settle``)."""
        if not ops:
            return []
        # in key order, as a reserve locks its rows: two calls never wait for each other in
        # opposite orders (a deadlock PostgreSQL would break by failing one)
        order = sorted(range(len(ops)), key=lambda i: ops[i].key)
        sent = [ops[i] for i in order]
        args = ([op.key for op in sent], token, [_ACTIONS[op.action] for op in sent],
                [storable(op.reply) if op.action is Settle.SENT else None for op in sent],
                [_ms(op.lease_s) if op.action is Settle.SENDING and op.lease_s > 0 else None
                 for op in sent],
                [_ms(op.window_s if op.window_s > 0 else window_s) for op in sent])
        rows = await self._call("settle", lambda conn: conn.fetch(_SETTLE, *args))
        done = [False] * len(ops)
        for i, row in zip(order, rows, strict=True):
            done[i] = bool(row["done"])
        return done

    async def renew(self, keys: Sequence[str], *, token: str, lease_s: float,
                    window_s: float = 0.0) -> list[bool]:
        """Keep this attempt's reservations alive (see the Protocol), in one statement; per
        key, whether it was still this attempt's. Raises :class:`StoreError` (op ``renew``)."""
        if not keys:
            return []
        window_ms = _ms(window_s) if window_s > 0 else 0
        rows = await self._call("renew", lambda conn: conn.fetch(
            _RENEW, sorted(set(keys)), token, _ms(lease_s), window_ms))
        renewed = {row["key"] for row in rows}
        return [key in renewed for key in keys]

    async def inspect(self, key: str) -> Record:
        """What ``key`` holds (ABSENT when nothing live). Raises :class:`StoreError`."""
        row = await self._call("inspect", lambda conn: conn.fetchrow(_INSPECT, key))
        if row is None or row["expires_at"] <= row["now"]:
            return Record(State.ABSENT)
        return _record(row)

    async def inspect_many(self, keys: Sequence[str]) -> list[Record]:
        """What each of ``keys`` holds (ABSENT when nothing live), in one statement. Raises
        :class:`StoreError` (op ``inspect``)."""
        if not keys:
            return []
        rows = await self._fetch("inspect", _INSPECT_MANY, list(keys))
        found = {row["key"]: row for row in rows if row["expires_at"] > row["now"]}
        return [Record(State.ABSENT) if (row := found.get(key)) is None else _record(row)
                for key in keys]

    def watch_settles(self, keys: Sequence[str]) -> AbstractAsyncContextManager[SettleWatch]:
        """The settles of ``keys``, heard by LISTEN on one connection of this store
        (:class:`relay.store.postgres.settled.PostgresSettles`)."""
        return self._settles.watching(keys)

    async def force_release(self, key: str, *, expected: Record | None = None) -> bool:
        """Delete ``key``; True when a live row was deleted. With ``expected``, only while the
        row is still that record (read under a row lock in the same transaction). Raises
        :class:`StoreError` (op ``force_release``)."""
        async def body(conn: asyncpg.Connection) -> bool:
            async with conn.transaction():
                row = await conn.fetchrow(_INSPECT + " FOR UPDATE", key)
                if row is None:
                    return False
                live = row["expires_at"] > row["now"]
                if expected is not None and not (live and same_record(_record(row), expected)):
                    return False
                await conn.execute(f"DELETE FROM {_T_} WHERE key = $1", key)
                await conn.execute(NOTIFY, key)
                return bool(live)

        return await self._call("force_release", body)

    async def force_mark_sent(self, key: str, *, reply: str, window_s: float,
                              expected: Record | None = None) -> bool:
        """Set SENT(the database's now, ``reply``) for ``window_s`` seconds; with ``expected``
        only while ``key`` is still that record (read under a row lock in the same
        transaction; for ABSENT, only while no live row is there). True when written. Raises
        :class:`StoreError` (op ``force_mark_sent``)."""
        args = (key, storable(reply), _ms(window_s))

        async def body(conn: asyncpg.Connection) -> bool:
            if expected is not None and expected.state is State.ABSENT:
                return await conn.fetchval(_FORCE_SENT_IF_ABSENT, *args) is not None
            async with conn.transaction():
                if expected is not None:
                    row = await conn.fetchrow(_INSPECT + " FOR UPDATE", key)
                    if row is None or row["expires_at"] <= row["now"] or not same_record(
                            _record(row), expected):
                        return False
                await conn.execute(_FORCE_SENT, *args)
                await conn.execute(NOTIFY, key)  # sent on commit
                return True

        return await self._call("force_mark_sent", body)

    async def count_states(self, prefix: str, *, lease_s: float, older_than_s: float,
                           max_keys: int | None = None,
                           progress: Callable[[int], None] | None = None) -> StateCounts:
        """Count the live rows whose key starts with ``prefix`` by state, in one query (see
        :class:`relay.core.interfaces.StateCounter`; ``max_keys`` and ``progress`` are not
        used). Raises :class:`StoreError` (op ``count_states``)."""
        del max_keys, progress
        rows = await self._call("count_states", lambda conn: conn.fetch(
            _COUNT_STATES, prefix, _ms(lease_s), int(older_than_s * 1000)),
            timeout_s=max(self._op_timeout_s, _COUNT_TIMEOUT_S))
        by = {row["reads"]: row for row in rows}

        def n(reads: str, column: str = "n") -> int:
            return int(by[reads][column]) if reads in by else 0

        oldest = min((row["oldest"] for row in rows if row["oldest"] is not None), default=None)
        now = rows[0]["now"] if rows else None
        return StateCounts(
            pending=n("pending"), sending=n("sending"), sent=n("sent") + n("foreign"),
            unknown=n("unknown"), foreign=n("foreign"),
            sending_past_lease=n("sending", "doubt"), scanned=sum(int(r["n"]) for r in rows),
            complete=True, oldest_in_doubt_at=oldest,
            oldest_in_doubt_age_s=None if oldest is None or now is None else now - oldest,
            in_doubt_older=sum(int(r["older"]) for r in rows))

    def rate_limiter(self, prefix: str) -> PostgresRateLimiter:
        """The rate limiter on this store's database (:mod:`relay.store.postgres.limits`),
        its buckets under ``prefix``, on this store's pool and ``op_timeout_s``."""
        return PostgresRateLimiter(pool=self._pool, prefix=prefix,
                                   op_timeout_s=self._op_timeout_s)

    async def identity(self) -> str:
        """``postgresql:<system_identifier>/<database>/<schema>``: the cluster's identifier
        (``pg_control_system()``, made by initdb, kept by its replicas), the database and the
        schema the tables are in. Raises :class:`StoreError` (op ``identity``)."""
        row = await self._call("identity", lambda conn: conn.fetchrow(
            "SELECT (SELECT system_identifier FROM pg_control_system())::text AS cluster, "
            "current_database() AS db, current_schema() AS schema"))
        return f"postgresql:{row['cluster']}/{row['db']}/{row['schema']}"

    async def ping(self) -> None:
        """Check that the database answers and takes writes (a hot standby, or a session
        with ``default_transaction_read_only``, answers ``SELECT 1`` while every reserve
        fails), and, when start-up could not, that its schema is this relay's (a missing or
        old one fails every probe, logged at ERROR, naming ``dedup-relay db upgrade``).
        Raises :class:`StoreError` (op ``ping``)."""
        if not self._schema_checked:
            try:
                await self._call("ping", lambda conn: migrations.check(conn, "store"))
            except migrations.SchemaError as exc:
                log.error("postgresql store: %s", exc)
                raise StoreError("ping", str(exc)) from exc
            self._schema_checked = True
        writable = await self._call("ping", lambda conn: conn.fetchval(WRITABLE))
        if writable is not True:
            raise StoreError("ping", "the database takes no writes (a read-only session or a "
                                     "standby in recovery)")

    async def delete_expired(self, batch: int | None = None,
                             max_batches: int | None = None) -> int:
        """Delete expired rows, at most ``batch`` per statement and ``max_batches`` statements
        (the store's cleanup bounds by default); return how many. Raises :class:`StoreError`
        (op ``cleanup``)."""
        size = self._cleanup_batch if batch is None else batch
        rounds = self._cleanup_max_batches if max_batches is None else max_batches

        async def one() -> int:
            return deleted_rows(await self._call(
                "cleanup", lambda conn: conn.execute(_CLEANUP, size)))
        return await delete_in_batches(one, batch=size, max_batches=rounds)

    async def delete_expired_limits(self, batch: int | None = None,
                                    max_batches: int | None = None) -> int:
        """Delete expired rate-limit rows (events of buckets no call touches any more, old
        tombstones: :func:`relay.store.postgres.limits.delete_expired`), at most ``batch`` per
        table and statement and ``max_batches`` rounds; return how many. Raises
        :class:`StoreError` (op ``cleanup``)."""
        size = self._cleanup_batch if batch is None else batch
        rounds = self._cleanup_max_batches if max_batches is None else max_batches

        async def one() -> int:
            return await self._call("cleanup", lambda conn: limits.delete_expired(conn, size))
        return await delete_in_batches(one, batch=size, max_batches=rounds)

    async def close(self) -> None:
        """Stop the cleanup task and close the pool; later calls raise StoreError."""
        if self._closed:
            return
        self._closed = True
        if self._cleanup is not None:
            self._cleanup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._cleanup
        await self._settles.close()
        await close_pool(self._pool, max(1.0, self._op_timeout_s))

    async def _cleanup_loop(self, interval_s: float) -> None:
        """Delete expired rows (fingerprints, then rate-limit rows) every ``interval_s``
        seconds, a bounded batch at a time."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                deleted = await self.delete_expired()
                deleted += await self.delete_expired_limits()
            except StoreError as exc:
                log.debug("postgresql cleanup: %s", exc)
                continue
            if deleted:
                log.debug("postgresql cleanup: deleted %d expired rows", deleted)

    async def _fetch(self, op_name: str, query: str, *args: object) -> list[Any]:
        """The rows of ``query`` with ``args`` (see :meth:`_call`)."""
        return await self._call(op_name, lambda conn: conn.fetch(query, *args))

    async def _call(self, op_name: str,
                    fn: Callable[[asyncpg.Connection], Awaitable[_R]], *,
                    timeout_s: float | None = None) -> _R:
        """Run ``fn`` on a pooled connection within ``op_timeout_s`` (or ``timeout_s``),
        translating every failure into :class:`StoreError` naming ``op_name``."""
        if self._closed:
            raise StoreError(op_name, "the PostgreSQL store is closed")
        limit_s = self._op_timeout_s if timeout_s is None else timeout_s
        return await bounded_call(self._pool, op_name, fn, limit_s,
                                  session_limit_s=self._op_timeout_s)


def _reservation(row: Any, token: str, lease_ms: int) -> Reservation | None:
    """One key's :class:`Reservation` from a reserve row; None when a concurrent transaction
    changed the key between the statement's snapshot and its insert (ask again)."""
    key = row["key"]
    if row["reserved"]:
        # what the row held when this statement took it (not the snapshot, read before the
        # statement may have waited for the row's lock): a record taken over keeps its time
        # in ``at`` (``took_at``) and its state#digest in ``reply`` (``took``); anything else
        # taken was absent or expired, or was this attempt's own PENDING (a retried reserve)
        took, took_at = row["took"], row["took_at"]
        if took is None or took_at is None:
            return Reservation(key=key, reserved=True)
        state, _, digest = took.partition("#")
        return Reservation(key=key, reserved=True, found=Record(
            State.SENT if state == "sent" else State.UNKNOWN, at=took_at,
            age_s=row["now"] - took_at, content_digest=digest or None))
    del token
    live = row["state"] is not None and row["expires_at"] > row["now"]
    found = _record(row, lease_ms) if live else None
    if found is None:
        return None
    return Reservation(key=key, reserved=False, found=found)


async def upgrade_schema(url: str, component: str = "store", *,
                         timeout_s: float = 30.0) -> tuple[int, int]:
    """Bring ``component``'s schema at ``url`` to this code's version (``dedup-relay db
    upgrade``); return (version before, after). Raises :class:`StoreError` when the database
    fails or does not answer within ``timeout_s`` seconds (a server that hangs mid-statement
    included: the connection is then closed without a word, so neither the rollback nor the
    close waits for it), :class:`migrations.SchemaError` when it holds a newer schema than
    this code."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    conn: asyncpg.Connection | None = None
    try:
        with as_store_error("upgrade", timeout_s, (*ERRORS, ValueError)):
            conn = await asyncpg.connect(url, timeout=timeout_s)
            work = asyncio.ensure_future(migrations.upgrade(conn, component))
            done, _ = await asyncio.wait({work}, timeout=max(0.0, deadline - loop.time()))
            if not done:  # the server hangs: end the connection, then the task fails at once
                conn.terminate()
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                raise TimeoutError
            return work.result()
    finally:
        await close_connection(conn)
