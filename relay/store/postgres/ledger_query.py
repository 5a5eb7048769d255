"""The lookups of the audit ledger as SQL (design.md §6.7): what support asks by (a recipient's
digest, a Message-ID, the relay's or the smarthost's queue id, a template, a store key, a
period), one page at a time, and one message's timeline.

Pure: no driver is imported here (the admin layer builds a :class:`LedgerQuery` without the
postgres extra); :class:`relay.store.postgres.ledger_read.LedgerReader` runs what
:func:`search_sql` and :data:`TIMELINE` give.

Pages are keyset pages (no OFFSET): rows in the order of ``(decided_at, row_id)``, newest first
unless ``oldest_first``, and the next page starts after the last row's :class:`Position`.
Every lookup column has an index ending in ``(decided_at, row_id)``
(:mod:`.migrations`, ledger step 4), so a page reads about its own rows whatever the ledger
holds. The partial indexes' predicates are repeated in the queries (``message_id <> ''``,
...): a prepared statement's generic plan cannot prove them from ``message_id = $1`` alone.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from relay.store.postgres.migrations import LEDGER as _L_

FIELDS = ("row_id, decided_at, recorded_at, action, outcome, store_key, recipient, template, "
          "dedupe_key, reply, upstream_queue_id, upstream, message_id, queue_id, "
          "client_reply, instance, key_source, key_reused, received_at, sending_at")
"""The columns a lookup reads (every one but the recipient's digest)."""

TIMELINE_ROWS = 500
"""Most rows a message's timeline reads."""

# $1 the relay's queue id, $2 most rows: the message's own rows and every row of the store
# keys it decided on (the send a duplicate of it was suppressed by, its later retries, the
# operators' actions), oldest first
TIMELINE = f"""
SELECT {FIELDS} FROM {_L_} WHERE queue_id = $1 AND queue_id <> ''
UNION
SELECT {FIELDS} FROM {_L_} WHERE store_key IN (
    SELECT store_key FROM {_L_}
    WHERE queue_id = $1 AND queue_id <> '' AND store_key IS NOT NULL)
ORDER BY decided_at, recorded_at, row_id LIMIT $2
"""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_TOKEN = re.compile(r"(-?\d{1,20})\.([0-9a-f]{32})")


@dataclass(frozen=True)
class Position:
    """Where a page ended: the last row's ``decided_at`` (timezone-aware, microseconds as the
    database keeps them) and ``row_id``."""

    decided_at: datetime
    row_id: uuid.UUID

    def token(self) -> str:
        """The position as a URL-safe text: ``MICROSECONDS.ROWIDHEX`` (microseconds since the
        Unix epoch, UTC)."""
        micros = (self.decided_at - _EPOCH) // timedelta(microseconds=1)
        return f"{micros}.{self.row_id.hex}"

    @classmethod
    def parse(cls, token: str) -> Position:
        """The position :meth:`token` wrote. Raises ``ValueError`` for any other text."""
        found = _TOKEN.fullmatch(token.strip())
        if found is None:
            raise ValueError("not a page position")
        try:
            at = _EPOCH + timedelta(microseconds=int(found.group(1)))
        except OverflowError:
            raise ValueError("not a page position") from None
        return cls(at, uuid.UUID(hex=found.group(2)))


@dataclass(frozen=True)
class LedgerQuery:
    """One lookup: the rows that match every field given (None or empty: not asked).

    ``recipient_digests``: any of the recipient's keyed digests
    (:func:`relay.core.fingerprint.recipient_digest`: under the fingerprint secret and, during
    a rotation, under the previous one); ``message_ids``: any of these Message-IDs as written
    (with and without angle brackets, say); ``queue_id``: the relay's or the smarthost's queue
    id; ``template``; ``store_keys``: any of one fingerprint's store keys (its key and, during
    a rotation, its key under the previous secret); ``since`` / ``until``: decided in
    [since, until) (timezone-aware). Newest first, unless ``oldest_first`` (a fingerprint's
    rows, read as its story)."""

    recipient_digests: Sequence[str] = ()
    message_ids: Sequence[str] = ()
    queue_id: str | None = None
    template: str | None = None
    store_keys: Sequence[str] = ()
    since: datetime | None = None
    until: datetime | None = None
    oldest_first: bool = False

    def asks(self) -> bool:
        """Whether any field is given (an empty query would list the whole ledger)."""
        return any((self.recipient_digests, self.message_ids, self.queue_id,
                    self.template is not None, self.store_keys, self.since, self.until))


def _one_of(column: str, values: Sequence[str], arg: Callable[[object], str]) -> str:
    """``column`` equal to one of ``values`` (at least one): ``=`` for one, which reads the
    column's index in its order; ``= ANY`` for several (a rotation's two digests or keys),
    whose rows PostgreSQL sorts."""
    if len(values) == 1:
        return f"{column} = {arg(values[0])}"
    return f"{column} = ANY({arg(list(values))}::text[])"


def search_sql(query: LedgerQuery, after: Position | None, limit: int
               ) -> tuple[str, list[object]]:
    """The statement and its arguments of one page of ``query``: at most ``limit`` rows past
    ``after`` (None: from the start), in ``query``'s order."""
    where: list[str] = []
    args: list[object] = []

    def arg(value: object) -> str:
        args.append(value)
        return f"${len(args)}"

    if query.recipient_digests:
        where.append(_one_of("recipient_digest", query.recipient_digests, arg)
                     + " AND recipient_digest IS NOT NULL")
    if query.message_ids:
        where.append(f"message_id = ANY({arg(list(query.message_ids))}::text[]) "
                     "AND message_id <> ''")
    if query.queue_id:
        same = arg(query.queue_id)
        where.append(f"((queue_id = {same} AND queue_id <> '') "
                     f"OR (upstream_queue_id = {same} AND upstream_queue_id <> ''))")
    if query.template is not None:
        where.append(f"template = {arg(query.template)}")
    if query.store_keys:
        where.append(_one_of("store_key", query.store_keys, arg))
    if query.since is not None:
        where.append(f"decided_at >= {arg(query.since)}")
    if query.until is not None:
        where.append(f"decided_at < {arg(query.until)}")
    order = "ASC" if query.oldest_first else "DESC"
    if after is not None:
        past = ">" if query.oldest_first else "<"
        where.append(f"(decided_at, row_id) {past} "
                     f"({arg(after.decided_at)}::timestamptz, {arg(after.row_id)}::uuid)")
    sql = (f"SELECT {FIELDS} FROM {_L_} WHERE {' AND '.join(where) or 'true'} "
           f"ORDER BY decided_at {order}, row_id {order} LIMIT {arg(limit)}")
    return sql, args
