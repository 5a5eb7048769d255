"""The audit ledger on PostgreSQL (design.md §6.7): the rows of
``dedup_relay_ledger`` (:mod:`.migrations`), written off the hot path.

:class:`PostgresLedger` implements :class:`relay.core.interfaces.AuditLedger`: ``record`` puts
rows into a bounded in-memory queue and returns; one writer task takes up to
:data:`BATCH_ROWS` of them at a time into one ``INSERT ... SELECT FROM unnest(...)`` statement
(one round trip), idempotent on the relay's ``row_id`` so that a batch written again after a
lost reply adds nothing. While the database fails, rows stay queued and the writer retries with
a growing pause; a full queue drops new rows (``relay_ledger_dropped_total{reason="full"}``)
unless the ledger is required, when :meth:`PostgresLedger.admits` says no and the core answers
new messages ``451 4.3.0`` instead. Rows still queued when the relay stops get a bounded time
to land, then are counted ``reason="shutdown"``. A cleanup task deletes rows older than the
retention in bounded batches, and a gauge task counts the unresolved in-doubt decisions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import asyncpg

from relay.core.address import mask_address, mask_addresses_in
from relay.core.errors import StartupError, StoreError
from relay.core.fingerprint import recipient_digest
from relay.core.interfaces import LedgerEntry
from relay.store.postgres import migrations
from relay.store.postgres.calls import (
    STARTUP_CHECK_S,
    WRITABLE,
    bounded_call,
    close_pool,
    delete_in_batches,
    deleted_rows,
    open_pool,
    refused_connect,
    storable,
)
from relay.store.postgres.migrations import LEDGER as _L_

log = logging.getLogger(__name__)

BATCH_ROWS = 500
"""Most rows one INSERT writes."""
POOL_SIZE = 3
"""Most connections one relay process opens to the ledger's database (writer, cleanup, gauge)."""
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0
"""The writer's pause after a failed batch: doubling from the first to the second."""
CLEANUP_INTERVAL_S = 60.0
CLEANUP_BATCH = 5000
CLEANUP_MAX_BATCHES = 20
GAUGE_INTERVAL_S = 30.0
BACKGROUND_TIMEOUT_S = 30.0
"""Bound of a cleanup statement or an in-doubt count (seconds): background work, not a
message's path, and a large ledger's count reads more than a write."""

COLUMNS = ("row_id", "decided_at", "action", "outcome", "store_key", "recipient", "template",
           "dedupe_key", "reply", "upstream_queue_id", "upstream", "message_id", "queue_id",
           "client_reply", "instance", "key_source", "key_reused", "recipient_digest",
           "received_at", "sending_at")
"""The columns a row (:func:`row_of`) holds, in its order. ``decided_at`` is unix seconds on
the clock the row was decided on; ``received_at`` and ``sending_at`` are the seconds before
it (None: none), so that the one move of ``decided_at`` onto the database's clock moves
them too."""

# $21: the offset in seconds of the database's clock from the clock the rows' decided_at were
# read on (:func:`clock_offset`); ``decided_at`` is stored on the database's clock, so rows of
# relays whose clocks disagree still sort in the order their decisions were taken (a relay
# 10 min ahead would otherwise list a duplicate before its send).
_INSERT = f"""
INSERT INTO {_L_} ({", ".join(COLUMNS)})
SELECT r, to_timestamp(d + $21::float8), a, o, sk, rc, t, k, rp, uq, u, m, q, cr, i, ks, kr,
       rd, to_timestamp(d + $21::float8 - rb), to_timestamp(d + $21::float8 - sb)
FROM unnest($1::uuid[], $2::float8[], $3::text[], $4::text[], $5::text[], $6::text[],
            $7::text[], $8::text[], $9::text[], $10::text[], $11::text[], $12::text[],
            $13::text[], $14::text[], $15::text[], $16::text[], $17::boolean[], $18::text[],
            $19::float8[], $20::float8[])
     AS t(r, d, a, o, sk, rc, t, k, rp, uq, u, m, q, cr, i, ks, kr, rd, rb, sb)
ON CONFLICT (row_id) DO NOTHING
"""

# $1 most rows; rows recorded more than $2 ms ago
_CLEANUP = f"""
DELETE FROM {_L_} WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {_L_} WHERE recorded_at < now() - $2::bigint * interval '1 millisecond'
    LIMIT $1 FOR UPDATE SKIP LOCKED))
"""

IN_DOUBT = ("unknown", "suppressed_unknown", "held")
"""Outcomes that say a fingerprint's record is in doubt: the final dot went out and no reply
came (``unknown``), or a retry found a record in doubt (``suppressed_unknown``, ``held``): a
relay that died after its final dot writes no ``unknown`` row, and its client's retry is the
ledger's only evidence."""

RESOLVING = ("relayed", "would_suppress", "released", "marked_sent", "reconciled_sent",
             "reconciled_released")
"""Outcomes of a later row for the same store key that resolve an in-doubt (``unknown``)
decision: the record was sent again, released or marked sent by an operator, or by the
reconciler on the smarthost's own record (``reconcile_given_up`` resolves nothing: it is left
to an operator)."""

# rows saying a fingerprint is in doubt (IN_DOUBT, with a store key) that no later row of the
# same store key resolved, decided at least $1 ms ago. "Later" by decided_at alone, which every
# writer puts on the database's clock (relays and the admin commands alike): when a row landed
# says nothing of when it was decided (a relay's old `relayed` row, queued
# through an outage, could land after a newer `unknown` and hide it). Counted per store key (a
# record in doubt has one row per retry).
UNRESOLVED_WHERE = f"""
u.outcome IN ({", ".join(f"'{o}'" for o in IN_DOUBT)}) AND u.store_key IS NOT NULL
AND u.decided_at <= now() - $1::bigint * interval '1 millisecond'
AND NOT EXISTS (
    SELECT 1 FROM {_L_} r WHERE r.store_key = u.store_key AND r.decided_at > u.decided_at
    AND r.outcome IN ({", ".join(f"'{o}'" for o in RESOLVING)}))
"""
COUNT_UNRESOLVED = f"SELECT count(DISTINCT u.store_key) FROM {_L_} u WHERE {UNRESOLVED_WHERE}"
"""$1 min age in ms: how many store keys are in doubt, unresolved (the gauge, the console)."""


def _refused_data(exc: StoreError) -> bool:
    """Whether ``exc`` is the database refusing the rows themselves (SQLSTATE class 22, data
    exception, or 23, integrity constraint), which no retry changes."""
    cause = exc.__cause__
    state = getattr(cause, "sqlstate", None) if isinstance(cause, asyncpg.PostgresError) else None
    return isinstance(state, str) and state[:2] in ("22", "23")


class LedgerMetrics(Protocol):
    """What the ledger reports (implemented by :class:`relay.ops.metrics.PrometheusMetrics`)."""

    def ledger_written(self, rows: int) -> None:
        """Count ``rows`` rows that landed in the ledger."""
        ...

    def ledger_dropped(self, reason: str, rows: int) -> None:
        """Count ``rows`` rows dropped: ``full`` (the queue was full), ``shutdown`` or
        ``rejected`` (the database refused the row's data)."""
        ...

    def ledger_queued(self, rows: int) -> None:
        """Set the number of rows waiting in this process's queue."""
        ...

    def component_up(self, component: str, up: bool) -> None:
        """Record whether the ``ledger`` component answers (its last write or probe)."""
        ...

    def in_doubt_unresolved(self, count: int) -> None:
        """Set the number of unresolved in-doubt decisions older than the operator's window."""
        ...


@dataclass(frozen=True)
class LedgerOptions:
    """How rows are written: ``instance`` names this relay process in every row;
    ``recipients_full`` keeps recipients as given (else masked, ``j***@example.com``);
    ``keys_plain`` keeps dedupe keys as given (else SHA-256 hex, HMAC-SHA-256 with
    ``secret`` when one is set); every row's ``recipient_digest`` is keyed by ``secret`` too,
    its recipient normalized as the relay's fingerprints are (``local_part_case_sensitive``);
    ``queue_max`` rows wait at most; ``required`` fails closed; ``retention_s`` seconds a row
    is kept; ``in_doubt_after_s`` the age from which an unresolved in-doubt decision counts in
    the gauge."""

    instance: str = ""
    recipients_full: bool = False
    keys_plain: bool = False
    secret: bytes | None = None
    local_part_case_sensitive: bool = False
    queue_max: int = 10000
    required: bool = False
    retention_s: float = 400 * 86400.0
    in_doubt_after_s: float = 3600.0


def _clean(text: str | None) -> str | None:
    """``text`` storable in a text column (:func:`storable`), None as it is."""
    return None if text is None else storable(text)


def key_digest(key: str, secret: bytes | None) -> str:
    """The ledger's form of a dedupe key: SHA-256 hex of its UTF-8, HMAC-SHA-256 with
    ``secret`` when one is set (a guessable key, such as an order number, is not readable
    back from the ledger without the secret)."""
    data = key.encode("utf-8", "surrogatepass")
    if secret is not None:
        return hmac.new(secret, data, hashlib.sha256).hexdigest()
    return hashlib.sha256(data).hexdigest()


def _before(entry: LedgerEntry, at: float | None) -> float | None:
    """Seconds from ``at`` to the entry's decision (None for None)."""
    return None if at is None else entry.decided_at - at


def row_of(entry: LedgerEntry, options: LedgerOptions) -> tuple[Any, ...]:
    """``entry`` as the values of :data:`COLUMNS`, recipient masked (an empty one kept
    empty), the addresses in the reply texts masked too, key hashed per ``options``, and the
    recipient's keyed digest (:func:`relay.core.fingerprint.recipient_digest`; None for an
    empty recipient or one that does not normalize)."""
    recipient = (entry.recipient if options.recipients_full or not entry.recipient
                 else mask_address(entry.recipient))  # "" (an operator's row) stays ""
    # an upstream's reply quotes recipients (450 4.2.0 <jane.roe@example.net>: greylisted)
    shown: Callable[[str], str] = (
        (lambda text: text) if options.recipients_full else mask_addresses_in)
    key = entry.dedupe_key
    if key is not None and not options.keys_plain:
        key = key_digest(key, options.secret)
    return (uuid.uuid4(), entry.decided_at, entry.action.value, entry.outcome,
            _clean(entry.store_key), _clean(recipient), _clean(entry.template), _clean(key),
            _clean(shown(entry.reply)), _clean(entry.upstream_queue_id),
            _clean(entry.upstream), _clean(entry.message_id), _clean(entry.queue_id),
            _clean(shown(entry.client_reply)),
            _clean(options.instance), _clean(entry.key_source), entry.key_reused,
            recipient_digest(entry.recipient, secret=options.secret,
                             local_part_case_sensitive=options.local_part_case_sensitive),
            _before(entry, entry.received_at), _before(entry, entry.sending_at))


OFFSET_EVERY_S = 60.0
"""How often a writer measures its clock's offset from the database's again (seconds)."""


async def clock_offset(conn: asyncpg.Connection, clock: Callable[[], float]) -> float:
    """The database's clock less ``clock`` (seconds), measured with one query as NTP does: the
    database's time against the midpoint of the local times before and after (error at most
    half the round trip). asyncpg errors pass through."""
    before = clock()
    database = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8")
    after = clock()
    return float(database) - (before + after) / 2


async def insert_rows(conn: asyncpg.Connection, rows: Sequence[tuple[Any, ...]], *,
                      offset_s: float = 0.0) -> None:
    """Write ``rows`` (tuples of :data:`COLUMNS`) in one statement, their ``decided_at`` moved
    by ``offset_s`` seconds onto the database's clock (:func:`clock_offset`; 0: as they are);
    asyncpg errors pass through."""
    if rows:
        await conn.execute(_INSERT, *(list(column) for column in zip(*rows, strict=True)),
                           offset_s)


@dataclass(frozen=True)
class LedgerStatus:
    """What ``/readyz`` says of the ledger: whether its last write (or probe) landed, the
    rows waiting, the rows this process dropped, and whether it is required."""

    up: bool
    queued: int
    dropped: int
    required: bool


class PostgresLedger:
    """:class:`relay.core.interfaces.AuditLedger` on PostgreSQL. Build it with :meth:`open`
    (inside a running event loop); ``await close()`` flushes what it can."""

    def __init__(self, pool: asyncpg.Pool, *, metrics: LedgerMetrics, options: LedgerOptions,
                 op_timeout_s: float = 5.0, batch_rows: int = BATCH_ROWS,
                 cleanup_interval_s: float | None = CLEANUP_INTERVAL_S,
                 gauge_interval_s: float | None = GAUGE_INTERVAL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._clock = clock  # the clock of the entries' decided_at (the core's)
        self._offset_s = 0.0  # the database's clock less the monotonic one (the writer's)
        self._offset_at = -math.inf  # when (time.monotonic()); -inf: not yet
        self._pool = pool
        self._metrics = metrics
        self._options = options
        self._op_timeout_s = op_timeout_s
        self._batch_rows = batch_rows
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()  # set by close(): the writer's retry pause ends
        self._drained = asyncio.Event()  # set when a write empties the queue
        self._up = True  # until a write fails: a ledger is not known down before it is used
        self._error = ""  # why it is down (the last failure), for /readyz
        self._schema_checked = False  # open() checked it, or a probe did since
        self._dropped = 0
        self._closing = False
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._writer(), name="ledger-writer")]
        if cleanup_interval_s is not None:
            self._tasks.append(loop.create_task(self._every(cleanup_interval_s, self.cleanup),
                                                name="ledger-cleanup"))
        if gauge_interval_s is not None:
            self._tasks.append(loop.create_task(
                self._every(gauge_interval_s, self.refresh_in_doubt, first=True),
                name="ledger-in-doubt"))
        metrics.component_up("ledger", True)

    @classmethod
    async def open(cls, url: str, *, metrics: LedgerMetrics, options: LedgerOptions,
                   op_timeout_s: float = 5.0, check_schema: bool = True,
                   **kwargs: Any) -> PostgresLedger:
        """A ledger on the database ``url`` names (as for the store: libpq's query
        parameters pass through). The schema is checked on a first connection:
        :class:`StartupError` naming ``dedup-relay db upgrade --ledger`` when it is missing or
        old; a database that does not answer is logged, the rows queue until it does (and a
        required ledger refuses messages meanwhile). :class:`StoreError` for a URL asyncpg
        refuses."""
        pool = await open_pool(url, max_size=POOL_SIZE, op_name="ledger open",
                               limit_s=op_timeout_s)
        ledger = cls(pool, metrics=metrics, options=options, op_timeout_s=op_timeout_s,
                     **kwargs)
        if not check_schema:
            ledger._schema_checked = True
            return ledger
        try:  # not a message's path: a database slow to connect gets longer than a write
            await ledger._call("ledger check_schema",
                               lambda conn: migrations.check(conn, "ledger"),
                               timeout_s=max(STARTUP_CHECK_S, op_timeout_s))
            ledger._schema_checked = True
            await ledger.ping()  # takes writes? (a read-only server: down from the start)
        except migrations.SchemaError as exc:
            await ledger.close(flush_s=0)
            raise StartupError(str(exc)) from exc
        except StoreError as exc:
            refused = refused_connect(exc)
            if refused is not None:  # a URL no retry makes right
                await ledger.close(flush_s=0)
                raise StartupError(f"the ledger's database refused the connection: {refused}; "
                                   "fix the URL, or create the database and run `dedup-relay "
                                   "db upgrade --ledger`") from exc
            ledger._set_up(False, str(exc))
            log.warning("audit ledger not usable at start-up (%s): rows queue until it "
                        "is%s", exc, "; messages are refused meanwhile (ledger_required)"
                        if options.required else "")
        return ledger

    # -- AuditLedger ---------------------------------------------------------------------------

    def record(self, entries: Sequence[LedgerEntry], *, admitted: bool = True) -> None:
        """Queue one row per entry (see the module docstring); never raises. With a
        required ledger the rows of an ``admitted`` message are kept past the bound, those
        of a message it refused only while there is room."""
        if not entries:
            return
        rows = self._rows(entries)
        room = self._options.queue_max - len(self._queue)
        bounded = not self._options.required or not admitted
        if self._closing or (bounded and room < len(rows)):
            kept = 0 if self._closing else max(0, room)
            self._queue.extend(rows[:kept])
            self._drop("shutdown" if self._closing else "full", len(rows) - kept)
        else:
            # required: a message admitted while there was room keeps its rows even past the
            # bound (by at most the messages in flight), so none of an admitted one is lost
            self._queue.extend(rows)
        self._metrics.ledger_queued(len(self._queue))
        if self._queue:
            self._drained.clear()
        self._wake.set()

    def admits(self) -> bool:
        """True unless the ledger is required and down or its queue full."""
        if not self._options.required:
            return True
        return self._up and len(self._queue) < self._options.queue_max

    # -- operations ------------------------------------------------------------------------------

    def status(self) -> LedgerStatus:
        """The ledger's state for ``/readyz``."""
        return LedgerStatus(up=self._up, queued=len(self._queue), dropped=self._dropped,
                            required=self._options.required)

    @property
    def required(self) -> bool:
        """Whether the ledger fails closed (``ledger_required``)."""
        return self._options.required

    def report(self) -> dict[str, object]:
        """The ``ledger`` part of the ``/readyz`` body: ``state`` (``up`` / ``down``),
        ``required``, rows ``queued`` and ``dropped`` by this process."""
        status = self.status()
        report: dict[str, object] = {
            "state": "up" if status.up else "down", "required": status.required,
            "queued": status.queued, "dropped": status.dropped}
        if not status.up:
            report["error"] = self._error[:300]
        return report

    async def ping(self) -> None:
        """Raise :class:`StoreError` unless the ledger is writable: the last batch landed, or
        (nothing waiting) the database answers, takes writes (not a read-only session or a
        standby) and, when start-up could not tell, holds this relay's schema."""
        if self._queue and not self._up:
            raise StoreError("ledger", f"{len(self._queue)} row(s) waiting, the last write "
                                       "failed")
        try:
            if not self._schema_checked:
                await self._call("ledger ping", lambda conn: migrations.check(conn, "ledger"))
                self._schema_checked = True
            writable = await self._call("ledger ping", lambda conn: conn.fetchval(WRITABLE))
            if writable is not True:
                raise StoreError("ledger ping", "the database takes no writes (a read-only "
                                                "session or a standby in recovery)")
        except migrations.SchemaError as exc:
            log.error("audit ledger: %s", exc)
            self._set_up(False, str(exc))
            raise StoreError("ledger ping", str(exc)) from exc
        except StoreError as exc:
            self._set_up(False, str(exc))
            raise
        if not self._queue:
            self._set_up(True)

    async def write_now(self, entries: Sequence[LedgerEntry]) -> None:
        """Write ``entries`` at once, bypassing the queue (an admin command's audit row).
        Raises :class:`StoreError`."""
        rows = self._rows(entries)
        await self._call("ledger write", lambda conn: self._insert(conn, rows))

    async def cleanup(self) -> int:
        """Delete rows older than the retention, in at most ``CLEANUP_MAX_BATCHES``
        statements of ``CLEANUP_BATCH`` rows; return how many. Raises :class:`StoreError`."""
        retention_ms = int(self._options.retention_s * 1000)

        async def one() -> int:
            return deleted_rows(await self._call(
                "ledger cleanup", lambda conn: conn.execute(_CLEANUP, CLEANUP_BATCH,
                                                            retention_ms),
                timeout_s=BACKGROUND_TIMEOUT_S))
        return await delete_in_batches(one, batch=CLEANUP_BATCH,
                                       max_batches=CLEANUP_MAX_BATCHES)

    async def refresh_in_doubt(self) -> int:
        """Count the unresolved in-doubt decisions older than ``in_doubt_after_s`` into the
        gauge; return the count. Raises :class:`StoreError`."""
        count = await self._call("ledger in-doubt", lambda conn: conn.fetchval(
            COUNT_UNRESOLVED, int(self._options.in_doubt_after_s * 1000)),
            timeout_s=BACKGROUND_TIMEOUT_S)
        value = int(count) if isinstance(count, int) else 0
        self._metrics.in_doubt_unresolved(value)
        return value

    async def close(self, flush_s: float = 5.0) -> None:
        """Give the queued rows up to ``flush_s`` seconds to land, count the rest dropped
        (``shutdown``, logged), stop the tasks and close the pool."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._stopping.set()
        if self._queue and flush_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(flush_s):
                    await self._drained.wait()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._queue:
            log.error("audit ledger: %d row(s) not written before the relay stopped",
                      len(self._queue))
            self._drop("shutdown", len(self._queue))
            self._queue.clear()
            self._metrics.ledger_queued(0)
        await close_pool(self._pool, max(1.0, self._op_timeout_s))

    # -- internals -----------------------------------------------------------------------------

    def _drop(self, reason: str, rows: int) -> None:
        if rows <= 0:
            return
        if self._dropped == 0 or reason == "shutdown":
            log.error("audit ledger: dropped %d row(s) (%s)", rows,
                      {"full": "queue full", "shutdown": "relay stopping"}.get(reason, reason))
        self._dropped += rows
        self._metrics.ledger_dropped(reason, rows)

    def _set_up(self, up: bool, error: str = "") -> None:
        if up != self._up:
            if up:
                log.warning("audit ledger is up again: writing %d queued row(s)",
                            len(self._queue))
            else:
                log.error("audit ledger write failed (%s): rows queue (%d now)", error,
                          len(self._queue))
        self._up = up
        self._error = "" if up else error
        self._metrics.component_up("ledger", up)

    async def _writer(self) -> None:
        """Write queued rows in batches until cancelled; a failed batch stays at the head of
        the queue and is tried again after a pause (the same row ids: no copy). A batch the
        database refuses for its data (SQLSTATE class 22 or 23: no retry would change that) is
        written row by row, and the rows it refuses are dropped (``reason="rejected"``): one
        bad row never holds the queue (and a required ledger's relay) up for good."""
        pause = RETRY_MIN_S
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue[i] for i in range(min(self._batch_rows, len(self._queue)))]
            try:
                written = await self._write(batch)
            except StoreError as exc:
                self._set_up(False, str(exc))
                await self._pause(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            except Exception:  # a defect: logged, and the batch retried like a failure
                log.exception("audit ledger writer: unexpected error")
                self._set_up(False, "unexpected error (logged)")
                await self._pause(RETRY_MAX_S)
                continue
            pause = RETRY_MIN_S
            for _ in batch:  # record() only appends: the head is still this batch
                self._queue.popleft()
            if not self._queue:
                self._drained.set()
            self._metrics.ledger_written(written)
            self._metrics.ledger_queued(len(self._queue))
            self._set_up(True)

    def _rows(self, entries: Sequence[LedgerEntry]) -> list[tuple[Any, ...]]:
        """The rows of ``entries``, their ``decided_at`` moved from the deciding clock (the
        core's wall clock, read a moment ago) onto this process's monotonic clock: a row that
        waits in the queue through an outage keeps its place in time across a step of the
        wall clock (NTP, an operator) before it is written."""
        wall, mono = self._clock(), time.monotonic()
        rows = []
        for entry in entries:
            row = row_of(entry, self._options)
            rows.append((row[0], mono - (wall - entry.decided_at), *row[2:]))
        return rows

    async def _insert(self, conn: asyncpg.Connection, rows: Sequence[tuple[Any, ...]]) -> None:
        """Write ``rows`` (``decided_at`` on the monotonic clock) with this process's offset
        of the database's clock from the monotonic one, measured again on ``conn`` every
        :data:`OFFSET_EVERY_S` (one estimate for every batch between: the rows of one relay
        keep their order, which a per-batch measurement's noise could swap)."""
        if time.monotonic() - self._offset_at > OFFSET_EVERY_S:
            self._offset_s = await clock_offset(conn, time.monotonic)
            self._offset_at = time.monotonic()
        await insert_rows(conn, rows, offset_s=self._offset_s)

    async def _pause(self, seconds: float) -> None:
        """The writer's pause after a failure: ``seconds``, or until :meth:`close` asks for
        the queue (the database may be back: the rows get their flush at once)."""
        if self._stopping.is_set():
            await asyncio.sleep(0.05)  # closing: try again soon, within close()'s flush bound
            return
        # asyncio.timeout, not wait_for: on 3.11 wait_for returns normally when the event is
        # set as the task is cancelled (close() does both), and the cancellation is lost
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()

    async def _write(self, batch: Sequence[tuple[Any, ...]]) -> int:
        """Write ``batch`` in one statement, or, when the database refuses it for its data,
        row by row (:meth:`_write_singly`); return how many rows were written. Raises
        :class:`StoreError` for any other failure (the rows are then kept)."""
        try:
            await self._call("ledger write", lambda conn: self._insert(conn, batch))
        except StoreError as exc:
            if not _refused_data(exc):
                raise
            return await self._write_singly(batch)
        return len(batch)

    async def _write_singly(self, batch: Sequence[tuple[Any, ...]]) -> int:
        """Write ``batch`` one row per statement, dropping (and counting) the rows the
        database refuses for their data; return how many were written. Raises
        :class:`StoreError` for any other failure (the rows are then kept)."""
        written = 0
        for row in batch:
            try:
                await self._call("ledger write",
                                 lambda conn, one=row: self._insert(conn, [one]))
            except StoreError as exc:
                if not _refused_data(exc):
                    raise
                log.error("audit ledger refused a row (%s): dropped", exc)
                self._drop("rejected", 1)
                continue
            written += 1
        return written

    async def _every(self, interval_s: float, job: Any, *, first: bool = False) -> None:
        """Run ``job()`` every ``interval_s`` seconds (at once first with ``first``); a
        failure is logged at DEBUG (the writer reports the ledger's state)."""
        if not first:
            await asyncio.sleep(interval_s)
        while True:
            try:
                await job()
            except StoreError as exc:
                log.debug("audit ledger %s: %s", getattr(job, "__name__", "job"), exc)
            await asyncio.sleep(interval_s)

    async def _call(self, op_name: str, fn: Any, *, timeout_s: float | None = None) -> Any:
        """Run ``fn(conn)`` on a pooled connection within the op timeout, or ``timeout_s``
        seconds when longer (its statements then get a statement_timeout to match:
        :func:`relay.store.postgres.calls.longer`); every failure becomes
        :class:`StoreError` naming ``op_name``."""
        limit_s = self._op_timeout_s if timeout_s is None else max(timeout_s, self._op_timeout_s)
        return await bounded_call(self._pool, op_name, fn, limit_s,
                                  session_limit_s=self._op_timeout_s)
