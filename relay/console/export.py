"""The console's CSV export of the audit ledger (``/export.csv``, :func:`export`): the period
asked for, the cells, and the streaming of the rows.

Order: the period is checked (:func:`period_of`); the ledger reads its rows in one short
transaction, within :data:`READ_TIMEOUT_S`, into a cursor that outlives it
(:meth:`relay.store.postgres.ledger_read.LedgerReader.period`), and they come from it in
batches; each batch is written as CSV lines (RFC 4180, CRLF) once the previous was taken by
the client. A
write that waits :data:`WRITE_TIMEOUT_S` for the client to read ends the download (the
connection is aborted); a ledger failure after the first batch ends the file with a line
saying it is incomplete (the status line was sent already). Memory: one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING
from urllib.parse import quote

from aiohttp import web

from relay.admin.search import LookupRefused
from relay.admin.search import parse_instant as instant
from relay.console.context import CONTEXT, SESSION, ledger_call
from relay.console.errors import ConsoleError
from relay.core.errors import StoreError

if TYPE_CHECKING:  # the postgres extra: imported once a ledger is configured
    from relay.store.postgres.ledger_read import HistoryRow

CSV_FIELDS = ("decided_at", "recorded_at", "action", "outcome", "store_key", "recipient",
              "template", "dedupe_key", "reply", "upstream_queue_id", "upstream",
              "message_id", "queue_id", "client_reply", "instance", "key_source",
              "key_reused", "received_at", "sending_at")
"""The columns of ``/export.csv``, in order: the ledger's own (times ISO 8601 UTC; the
recipient's digest is left out: it identifies an address to whoever can guess it)."""
MAX_EXPORT_DAYS = 400
"""The longest period (days): the ledger keeps rows 400 days by default; longer is a typo."""
WRITE_TIMEOUT_S = 30.0
"""Seconds one write of an export waits for the client to read, at most."""
READ_TIMEOUT_S = 60.0
"""Seconds the ledger may take to read an export's period (its one transaction: the rows are
then fetched outside any, however slowly the client downloads them)."""
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")

log = logging.getLogger("relay.console")

routes = web.RouteTableDef()


def csv_cell(value: object) -> str:
    """``value`` as a CSV cell a spreadsheet shows as text: a text starting with ``=``, ``+``,
    ``-``, ``@``, a tab or a carriage return gets a leading ``'`` (OWASP's advice against
    formula injection: a recipient or reply is the sender's text); None is empty; a time is
    ISO 8601 UTC; a truth value ``true`` or ``false``."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    return "'" + text if text.startswith(_FORMULA_START) else text


def iso(at: datetime) -> str:
    """``at`` as ISO 8601 UTC to the millisecond: ``2026-12-05T14:30:00.000Z``."""
    return at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_instant(text: str, *, what: str) -> datetime:
    """``2026-12-05`` (midnight UTC), ``2026-12-05T14:30`` or a full ISO 8601 time (UTC when it
    names no offset) as a timezone-aware datetime (:func:`relay.admin.search.parse_instant`,
    the lookups' rule). Raises :class:`ConsoleError` (400)."""
    try:
        return instant(text, what=what)
    except LookupRefused as exc:
        raise ConsoleError(400, str(exc)) from None


def period_of(start_text: str, end_text: str, *, now: datetime) -> tuple[datetime, datetime]:
    """The period [start, end) of ``from`` and ``to`` (either empty: the last 24 h up to
    ``now``). Raises :class:`ConsoleError` (400) for a date it cannot read, an empty period
    or one longer than :data:`MAX_EXPORT_DAYS`."""
    start = parse_instant(start_text, what="from") if start_text else now - timedelta(days=1)
    end = parse_instant(end_text, what="to") if end_text else now
    if end <= start:
        raise ConsoleError(400, "The period is empty: 'to' must come after 'from'.")
    if end - start > timedelta(days=MAX_EXPORT_DAYS):
        raise ConsoleError(400, f"The period is longer than {MAX_EXPORT_DAYS} days.")
    return start, end


def file_name(start: datetime, end: datetime) -> str:
    """The downloaded file's name, URL-quoted: ``dedup-relay-ledger-START-END.csv``."""
    return quote(f"dedup-relay-ledger-{start:%Y%m%dT%H%M}-{end:%Y%m%dT%H%M}.csv")


@dataclass
class Sent:
    """How far an export got: ``started`` (its status line went), ``rows`` written, whether
    it was ``whole``, and ``why`` not."""

    started: bool = False
    rows: int = 0
    whole: bool = False
    why: str = ""


async def _within(timeout_s: float, call: Awaitable[None]) -> None:
    async with asyncio.timeout(timeout_s):
        await call


async def stream_csv(request: web.Request, response: web.StreamResponse,
                     first: list[HistoryRow], rest: AsyncIterator[list[HistoryRow]],
                     sent: Sent) -> None:
    """Write the header, ``first`` and every later batch of ``rest`` to the prepared
    ``response``, counting in ``sent``; end it. A client that left or stopped reading
    (:data:`WRITE_TIMEOUT_S`) gets its connection aborted (never raises for it)."""
    sent.started = True
    try:
        await _write_rows(response, first, rest, sent)
        await _within(WRITE_TIMEOUT_S, response.write_eof())
        sent.whole = not sent.why
    except (ConnectionError, TimeoutError) as exc:
        if request.transport is not None:
            request.transport.abort()
        sent.why = f"the client left or stopped reading ({type(exc).__name__})"
    except asyncio.CancelledError:
        sent.why = "the relay stopped"
        raise


async def _write_rows(response: web.StreamResponse, first: list[HistoryRow],
                      rest: AsyncIterator[list[HistoryRow]], sent: Sent) -> None:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow(CSV_FIELDS)
    batch = first
    while batch:
        for row in batch:
            writer.writerow([csv_cell(getattr(row, name)) for name in CSV_FIELDS])
        await _within(WRITE_TIMEOUT_S, response.write(buffer.getvalue().encode("utf-8")))
        sent.rows += len(batch)
        buffer.seek(0)
        buffer.truncate()
        try:
            batch = await anext(rest, [])
        except StoreError as exc:
            sent.why = f"the ledger failed: {exc}"
            writer.writerow([f"# incomplete: the ledger failed after {sent.rows} rows: {exc}"])
            batch = []
    await _within(WRITE_TIMEOUT_S, response.write(buffer.getvalue().encode("utf-8")))


@routes.get("/export.csv")
async def export(request: web.Request) -> web.StreamResponse:
    """The ledger rows decided in [from, to) as CSV, streamed."""
    ctx = request.app[CONTEXT]
    session = request[SESSION]
    if ctx.settings.ledger is None:
        raise ConsoleError(404, "No audit ledger is configured: there is nothing to export.")
    start, end = period_of(request.query.get("from", ""), request.query.get("to", ""),
                           now=datetime.now(tz=UTC))
    sent = Sent()
    try:
        async with ctx.ledger(ctx.export_slots) as reader, \
                contextlib.aclosing(reader.period(
                    start, end, read_timeout_s=READ_TIMEOUT_S)) as batches:
            # closed here, also when the client leaves mid-download: its transaction ends
            # before the connection does
            first = await ledger_call(anext(batches, []))
            response = web.StreamResponse(headers={
                "Content-Type": "text/csv; charset=utf-8",
                "Content-Disposition": f"attachment; filename=\"{file_name(start, end)}\""})
            ctx.headers(response)
            await response.prepare(request)
            await stream_csv(request, response, first, batches, sent)
    finally:
        if sent.started:
            log.log(logging.INFO if sent.whole else logging.WARNING,
                    "console export" if sent.whole else "console export cut short",
                    extra={"user": session.user, "role": session.role, "from": iso(start),
                           "to": iso(end), "rows": sent.rows, "why": sent.why,
                           "peer": request.remote})
    return response
