"""The audit ledger as the admin commands and the console read and write it (design.md §6.7):
``dedup-relay history``, ``dedup-relay in-doubt``, the operator rows of ``release`` and
``mark-sent``, the console's stats and CSV export.

:class:`LedgerReader` holds one connection (no pool, no background task: a command's life is
one question) to the database of ``dedup_relay_ledger`` (:mod:`.migrations`), opened with the
schema checked. Rows come back as :class:`HistoryRow` / :class:`InDoubtRow`, times as the
database holds them (UTC), ages by the database's clock (as :data:`.ledger.UNRESOLVED_WHERE`
counts them for the gauge).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from relay.core.interfaces import LedgerEntry
from relay.store.postgres import migrations
from relay.store.postgres.calls import ERRORS, as_store_error, close_connection
from relay.store.postgres.ledger import (
    COUNT_UNRESOLVED,
    UNRESOLVED_WHERE,
    LedgerOptions,
    clock_offset,
    insert_rows,
    row_of,
)
from relay.store.postgres.ledger_query import (
    FIELDS,
    TIMELINE,
    TIMELINE_ROWS,
    LedgerQuery,
    Position,
    search_sql,
)
from relay.store.postgres.migrations import LEDGER as _L_
from relay.store.postgres.migrations import RECONCILE_LOOKS as _R_

__all__ = ["HistoryRow", "InDoubtRow", "LedgerReader", "Looks", "Page"]

_ERRORS = (*ERRORS, ValueError)

_FIELDS = FIELDS

# $1 store keys (one fingerprint's: its key and, during a rotation, its previous secret's
# key), $2 most rows: the oldest first (decided_at, then the order they landed)
_HISTORY = f"""
SELECT {_FIELDS} FROM {_L_} WHERE store_key = ANY($1::text[])
ORDER BY decided_at, recorded_at, row_id LIMIT $2
"""

# $1 min age in ms (UNRESOLVED_WHERE), $2 most rows: one row per store key in doubt (its
# ``unknown`` row when there is one: the transaction's own Message-ID and reply; else its
# earliest retry's), the oldest first, with the reconciler's looks at that row (none: 0, NULL)
# and whether it gave the doubt up (a ``reconcile_given_up`` row since); {where}: more rules,
# {first}: what comes before the age in the order
_IN_DOUBT_OF = f"""
SELECT * FROM (
    SELECT DISTINCT ON (u.store_key) {_FIELDS},
           extract(epoch FROM now() - u.decided_at)::float8 AS age_s
    FROM {_L_} u WHERE {UNRESOLVED_WHERE}
    ORDER BY u.store_key, u.outcome <> 'unknown', u.decided_at, u.recorded_at
) AS each_key
LEFT JOIN LATERAL (
    SELECT lk.looks AS reconcile_looks, lk.looked_at AS reconcile_looked_at,
           lk.answer AS reconcile_answer
    FROM {_R_} lk WHERE lk.store_key = each_key.store_key AND lk.row_id = each_key.row_id
) AS looked ON true
CROSS JOIN LATERAL (
    SELECT EXISTS (SELECT 1 FROM {_L_} g WHERE g.store_key = each_key.store_key
                   AND g.outcome = 'reconcile_given_up' AND g.decided_at >= each_key.decided_at)
           AS reconcile_given_up
) AS given_up
{{where}}
ORDER BY {{first}} decided_at, recorded_at LIMIT $2
"""
_IN_DOUBT = _IN_DOUBT_OF.format(where="", first="")
# the reconciler's: those not looked at first, then the least recently looked at, so that a
# round bounded below the list's length reaches every record in turn
_TO_RECONCILE = _IN_DOUBT_OF.format(where="WHERE NOT given_up.reconcile_given_up",
                                    first="reconcile_looked_at NULLS FIRST,")

# $1 store keys, $2 the in-doubt rows looked at, $3 each one's answer: one more look each
_LOOKED = f"""
INSERT INTO {_R_} (store_key, row_id, answer)
SELECT * FROM unnest($1::text[], $2::uuid[], $3::text[])
ON CONFLICT (store_key) DO UPDATE SET
    looks = CASE WHEN {_R_}.row_id = EXCLUDED.row_id THEN {_R_}.looks + 1 ELSE 1 END,
    first_looked_at = CASE WHEN {_R_}.row_id = EXCLUDED.row_id
                      THEN {_R_}.first_looked_at ELSE now() END,
    row_id = EXCLUDED.row_id, looked_at = now(), answer = EXCLUDED.answer
"""

# $1 seconds: the looks not renewed for so long (their doubt resolved, or given up long ago)
_FORGET_LOOKS = f"""
DELETE FROM {_R_} WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {_R_} WHERE looked_at < now() - make_interval(secs => $1) LIMIT 5000))
"""

_LAST_LOOK = f"SELECT max(looked_at) FROM {_R_}"

# $1 store keys: the reconciler's looks at each
_LOOKS_OF = f"""
SELECT store_key, looks, first_looked_at, looked_at, answer FROM {_R_}
WHERE store_key = ANY($1::text[])
"""

# $1 seconds back from now, $2 most templates: the suppressed duplicates per template decided in
# that time. recorded_at >= decided_at (a row lands after it was decided, both on the
# database's clock), so the recorded_at bound only lets its index skip older rows.
_SUPPRESSED = f"""
SELECT template, count(*) AS suppressed FROM {_L_}
WHERE recorded_at >= now() - make_interval(secs => $1)
  AND decided_at >= now() - make_interval(secs => $1) AND outcome = 'suppressed'
GROUP BY template ORDER BY suppressed DESC, template LIMIT $2
"""

# $1 from, $2 to (timestamptz): the rows decided in [from, to), oldest first (recorded_at bound
# as above), into a cursor that outlives its transaction (WITH HOLD: the rows are read when the
# transaction commits, then fetched without one); one export per connection, so one name
_EXPORT_CURSOR = "dedup_relay_export"
_PERIOD = f"""
DECLARE {_EXPORT_CURSOR} NO SCROLL CURSOR WITH HOLD FOR
SELECT {_FIELDS} FROM {_L_}
WHERE recorded_at >= $1 AND decided_at >= $1 AND decided_at < $2
ORDER BY decided_at, recorded_at, row_id
"""

# $1 min age in ms (UNRESOLVED_WHERE), $2 store key: whether it is in doubt, unresolved
_UNRESOLVED_KEY = f"""
SELECT EXISTS (SELECT 1 FROM {_L_} u WHERE u.store_key = $2 AND {UNRESOLVED_WHERE}) AS found
"""

EXPORT_BATCH = 500
"""Rows an export reads from the database at a time (its memory bound)."""
_PERIOD_BATCH = f"FETCH FORWARD {EXPORT_BATCH} FROM {_EXPORT_CURSOR}"


@dataclass(frozen=True)
class HistoryRow:
    """One ledger row. ``decided_at``: when it was decided, on the database's clock (each
    writer moves its own time onto it); ``recorded_at``: when the row landed (both UTC).
    ``store_key`` is None for a decision without a fingerprint; ``dedupe_key`` as the ledger
    keeps it (SHA-256 hex, HMAC or plain, per ``ledger_keys``), None without one;
    ``recipient`` masked or full per ``ledger_recipients``. The other texts are "" when there
    was none (``key_source``: where the key came from, ``header`` or ``rule:NAME``);
    ``key_reused``: the recipient's key held a record of other content (design.md §4.9).
    ``received_at``: when the message came in; ``sending_at``: when its records were marked
    SENDING, right before the final dot went upstream (None: not known, not sent with a
    reservation, or a row written before the ledger's schema version 4); ``row_id``: the
    row's own id (a page's :class:`Position`)."""

    decided_at: datetime
    recorded_at: datetime
    action: str
    outcome: str
    store_key: str | None
    recipient: str
    template: str
    dedupe_key: str | None
    reply: str
    upstream_queue_id: str
    upstream: str
    message_id: str
    queue_id: str
    client_reply: str
    instance: str
    key_source: str
    key_reused: bool
    received_at: datetime | None = None
    sending_at: datetime | None = None
    row_id: uuid.UUID | None = None

    @property
    def position(self) -> Position:
        """Where a page ending at this row ends."""
        assert self.row_id is not None
        return Position(self.decided_at, self.row_id)


@dataclass(frozen=True)
class Page:
    """One page of a lookup: its ``rows`` and where the next starts (None: this is the
    last)."""

    rows: list[HistoryRow]
    next: Position | None


@dataclass(frozen=True)
class Looks:
    """The reconciler's looks at one store key in doubt: how many rounds asked the evidence
    sources (``looks``), the first and the last (``first_looked_at``, ``looked_at``, the
    database's clock) and what the last found (``answer``: ``wait: mx1 unknown`` ...)."""

    looks: int
    first_looked_at: datetime
    looked_at: datetime
    answer: str


@dataclass(frozen=True)
class InDoubtRow(HistoryRow):
    """The row of a fingerprint in doubt (``unknown``, or a retry's ``suppressed_unknown`` /
    ``held``) no later row resolved; ``age_s``: seconds since it was decided, by the
    database's clock."""

    age_s: float = 0.0
    reconcile_looks: int | None = None
    reconcile_looked_at: datetime | None = None
    reconcile_answer: str | None = None
    reconcile_given_up: bool = False

    @property
    def attempt_at(self) -> datetime:
        """When the in-doubt attempt's final dot went out: ``sending_at``, else (a row
        without it) ``decided_at``."""
        return self.sending_at if self.sending_at is not None else self.decided_at


def _history_row(record: Any) -> HistoryRow:
    return HistoryRow(**{name: record[name] for name in HistoryRow.__dataclass_fields__})


def _in_doubt_row(record: Any) -> InDoubtRow:
    return InDoubtRow(**{name: record[name] for name in InDoubtRow.__dataclass_fields__})


class LedgerReader:
    """One connection to the ledger's database. Build it with :meth:`open`; ``await
    close()``, or ``async with await LedgerReader.open(url) as reader:``. Every method raises
    :class:`StoreError` (op ``ledger ...``) when the database fails or does not answer within
    the timeout."""

    def __init__(self, conn: asyncpg.Connection, timeout_s: float) -> None:
        self._conn = conn
        self._timeout_s = timeout_s

    @classmethod
    async def open(cls, url: str, *, timeout_s: float = 10.0) -> LedgerReader:
        """Connect to ``url`` (a ``postgresql://`` URL, libpq's query parameters passed
        through) and check the ledger's schema. Raises :class:`StoreError` (op ``ledger
        open``) when the database refuses or does not answer within ``timeout_s`` seconds,
        :class:`migrations.SchemaError` (naming ``dedup-relay db upgrade --ledger``) when the
        schema is missing, old or newer than this code."""
        conn: asyncpg.Connection | None = None
        try:
            with as_store_error("ledger open", timeout_s, _ERRORS):
                async with asyncio.timeout(timeout_s):
                    conn = await asyncpg.connect(url)
                    await migrations.check(conn, "ledger")
        except BaseException:
            await close_connection(conn)
            raise
        return cls(conn, timeout_s)

    async def close(self) -> None:
        """Close the connection (never raises)."""
        await close_connection(self._conn)

    async def __aenter__(self) -> LedgerReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def history(self, *store_keys: str, limit: int) -> list[HistoryRow]:
        """The rows of ``store_keys`` (one fingerprint's: its key, and its key under the
        previous fingerprint secret during a rotation), oldest first (by ``decided_at``, then
        ``recorded_at``), at most ``limit``."""
        records = await self._call("ledger history", _HISTORY, list(store_keys), limit)
        return [_history_row(r) for r in records]

    async def search(self, query: LedgerQuery, *, after: Position | None = None,
                     limit: int) -> Page:
        """One page of ``query``: at most ``limit`` rows past ``after`` (None: the first
        page), in ``query``'s order (:func:`.ledger_query.search_sql`), and the position of
        the next page when there are more."""
        sql, args = search_sql(query, after, limit + 1)
        records = await self._call("ledger search", sql, *args)
        rows = [_history_row(r) for r in records[:limit]]
        return Page(rows, rows[-1].position if len(records) > limit else None)

    async def timeline(self, queue_id: str, *, limit: int = TIMELINE_ROWS) -> list[HistoryRow]:
        """The rows of the message the relay gave ``queue_id`` and every row of the store keys
        it decided on (the send its duplicate was suppressed by, later retries, operators'
        actions), oldest first, at most ``limit``."""
        records = await self._call("ledger timeline", TIMELINE, queue_id, limit)
        return [_history_row(r) for r in records]

    async def in_doubt(self, *, older_than_s: float, limit: int) -> list[InDoubtRow]:
        """The fingerprints in doubt (a row of :data:`.ledger.IN_DOUBT`: ``unknown``, or a
        retry's ``suppressed_unknown`` / ``held``) that no later row of their store key
        resolved (:data:`.ledger.RESOLVING`), decided at least ``older_than_s`` seconds ago;
        one row per store key (its ``unknown`` row when there is one), oldest first, at most
        ``limit``."""
        records = await self._call("ledger in-doubt", _IN_DOUBT,
                                   max(0, int(older_than_s * 1000)), limit)
        return [_in_doubt_row(r) for r in records]

    async def to_reconcile(self, *, limit: int) -> list[InDoubtRow]:
        """The fingerprints in doubt as :meth:`in_doubt` lists them (any age) but those the
        reconciler gave up (a ``reconcile_given_up`` row since their in-doubt row): its work
        list, those it never looked at first, then the least recently looked at, each group
        oldest first, at most ``limit`` (a round bounded below the list's length reaches every
        record in turn)."""
        records = await self._call("ledger in-doubt", _TO_RECONCILE, 0, limit)
        return [_in_doubt_row(r) for r in records]

    async def note_looks(self, looks: Sequence[tuple[InDoubtRow, str]]) -> None:
        """Count one look of the reconciler at each (in-doubt row, what it found): the row's
        count goes up by one (back to 1 for a new doubt of its key), its time is now."""
        if not looks:
            return
        keys = [row.store_key for row, _ in looks]
        row_ids = [row.row_id for row, _ in looks]
        answers = [answer[:1024] for _, answer in looks]
        await self._call("ledger reconcile", _LOOKED, keys, row_ids, answers)

    async def forget_looks(self, *, older_than_s: float) -> None:
        """Delete the looks not renewed for ``older_than_s`` seconds (at most 5,000)."""
        await self._call("ledger reconcile", _FORGET_LOOKS, float(older_than_s))

    async def looks(self, store_keys: Sequence[str]) -> dict[str, Looks]:
        """The reconciler's looks at each of ``store_keys`` that it looked at."""
        records = await self._call("ledger reconcile", _LOOKS_OF, list(store_keys))
        return {r["store_key"]: Looks(r["looks"], r["first_looked_at"], r["looked_at"],
                                      r["answer"]) for r in records}

    async def last_look(self) -> datetime | None:
        """When the reconciler last looked at any in-doubt record (None: never, or not
        since its looks were forgotten)."""
        records = await self._call("ledger reconcile", _LAST_LOOK)
        return records[0][0] if records else None

    async def unresolved(self, store_key: str) -> bool:
        """Whether ``store_key`` is in doubt in the ledger, unresolved (as :meth:`in_doubt`
        lists it)."""
        records = await self._call("ledger in-doubt", _UNRESOLVED_KEY, 0, store_key)
        return bool(records and records[0]["found"])

    async def count_unresolved(self) -> int:
        """How many store keys are in doubt, unresolved (as :meth:`in_doubt` lists them)."""
        records = await self._call("ledger in-doubt", COUNT_UNRESOLVED, 0)
        return int(records[0][0]) if records else 0

    async def suppressed_by_template(self, *, since_s: float, limit: int
                                     ) -> list[tuple[str, int]]:
        """(template, duplicates suppressed) decided in the last ``since_s`` seconds, the most
        first, at most ``limit`` templates (``""``: messages without a template)."""
        records = await self._call("ledger stats", _SUPPRESSED, float(since_s), limit)
        return [(str(r["template"]), int(r["suppressed"])) for r in records]

    async def period(self, start: datetime, end: datetime, *, read_timeout_s: float
                     ) -> AsyncGenerator[list[HistoryRow], None]:
        """The rows decided in [``start``, ``end``) (timezone-aware), oldest first, in batches
        of :data:`EXPORT_BATCH` fetched one at a time from a server-side cursor (memory
        bounded whatever the period holds).

        The cursor is held past its read-only transaction (``WITH HOLD``): the database reads
        the period's rows when that transaction commits, within ``read_timeout_s`` seconds
        (the transaction's longest life), and keeps them (in its temporary space) for the
        cursor; the batches are then fetched outside any transaction. So however slowly the
        rows are taken, no transaction stays open and VACUUM is held back by none. Each
        batch's fetch is bounded by the reader's timeout; the cursor is closed at the end (or
        with the connection). Raises :class:`StoreError` as every method, also when the
        period is not read within ``read_timeout_s``."""
        with as_store_error("ledger export", read_timeout_s, _ERRORS):
            async with asyncio.timeout(read_timeout_s), \
                    self._conn.transaction(readonly=True, isolation="repeatable_read"):
                await self._conn.execute(_PERIOD, start, end)
        try:
            while True:
                with as_store_error("ledger export", self._timeout_s, _ERRORS):
                    async with asyncio.timeout(self._timeout_s):
                        records = await self._conn.fetch(_PERIOD_BATCH)
                if not records:
                    break
                yield [_history_row(r) for r in records]
        finally:
            with contextlib.suppress(*_ERRORS, TimeoutError):
                async with asyncio.timeout(self._timeout_s):
                    await self._conn.execute(f"CLOSE {_EXPORT_CURSOR}")

    async def write(self, entries: Sequence[LedgerEntry], options: LedgerOptions) -> None:
        """Write ``entries`` now, in one statement (an operator action's audit row), recipient
        masked and key hashed per ``options`` (an entry without a recipient keeps ``""``)."""
        rows = [row_of(entry, options) for entry in entries]
        with as_store_error("ledger write", self._timeout_s, _ERRORS):
            async with asyncio.timeout(self._timeout_s):
                offset_s = await clock_offset(self._conn, time.time)
                await insert_rows(self._conn, rows, offset_s=offset_s)

    async def _call(self, op_name: str, query: str, *args: object) -> list[Any]:
        with as_store_error(op_name, self._timeout_s, _ERRORS):
            async with asyncio.timeout(self._timeout_s):
                return list(await self._conn.fetch(query, *args))
