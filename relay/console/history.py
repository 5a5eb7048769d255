"""The console's lookups (design.md §6.9): ``/history`` finds messages by what support holds
and shows one fingerprint's rows; ``/message/<queue id>`` is one message's page.

``/history`` answers three ways. With a key (recipient, template and ``key``) or a
``store_key``: that fingerprint, its record in the store and its ledger rows oldest first
(:func:`relay.admin.selected_keys`, the CLI's rule; while ``fingerprint_secret_previous``
is set, its key under that secret too). Else with any of ``rcpt``,
``message_id``, ``queue_id`` (the relay's or the smarthost's), ``template``, ``since`` and
``until``: the ledger rows that match every one, newest first
(:func:`relay.admin.search.ledger_query`, the CLI's rule). Both in keyset pages of
:data:`PAGE_ROWS` rows, each with a ``next`` link (``after=``, the last row's position) while
more follow. A lookup refused (an address the relay refuses, a time it cannot read) is the
same page, ``400``, with what was typed still in the form.

``/message/<queue id>`` (the relay's queue id, as the decision log line names it and its
``console`` link points to): the message's rows, what the store holds now for each of its
recipients, and its timeline oldest first: received, marked SENDING before the final dot,
each recipient's decision, and every other row of its store keys (the send it was a duplicate
of, later retries, operators' actions).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from aiohttp import web

from relay.admin import Selection, SelectionError, describe, located, selected_keys
from relay.admin.search import Lookup, LookupRefused, ledger_query
from relay.console.context import CONTEXT, ConsoleContext, ledger_call
from relay.console.errors import ConsoleError
from relay.console.pages import DONE, selection_words, shown_address
from relay.core.errors import StoreError
from relay.store.postgres.ledger_query import TIMELINE_ROWS, LedgerQuery, Position

if TYPE_CHECKING:  # the postgres extra: imported once a ledger is configured
    from relay.store.postgres.ledger_read import HistoryRow, Page

PAGE_ROWS = 50
"""Rows a page of a lookup shows (then a ``next`` link)."""
MAX_RECORDS = 50
"""Store records a message's page reads at most (one per distinct store key)."""
FIELDS = ("rcpt", "template", "key", "store_key", "message_id", "queue_id", "since", "until")
"""The lookup form's fields, as the query string names them."""
_SEARCH_ONLY = ("message_id", "queue_id", "since", "until")

OUTCOME_WORDS = {
    "relayed": "relayed", "suppressed": "duplicate suppressed",
    "unknown": "in doubt: the final dot went out, no reply came",
    "suppressed_unknown": "retry suppressed: an earlier copy is in doubt",
    "held": "retry held: an earlier copy is in doubt",
    "would_suppress": "relayed (shadow mode: would have been suppressed)",
    "released": "released by an operator", "marked_sent": "marked sent by an operator",
    "refused_temp": "refused for now (4yz)", "refused_perm": "refused (5yz)",
    "reconciled_sent": "marked sent by the reconciler: the smarthost's records show it "
                       "accepted",
    "reconciled_released": "released by the reconciler: the smarthost's records show it "
                           "refused",
    "reconcile_given_up": "the reconciler gave up (no evidence): left to an operator",
}
"""What an outcome means on a timeline (others are shown as they are named)."""

routes = web.RouteTableDef()


class Refused(Exception):
    """A lookup the page refuses (400), in the page's words."""


@dataclass(frozen=True)
class Event:
    """One line of a message's timeline: when, a ``kind`` (an outcome, ``received``,
    ``sending``; the line's style), what happened, the reply or detail, and a link (another
    message's page, a fingerprint's history; "": none)."""

    at: datetime
    kind: str
    what: str
    detail: str = ""
    link: str = ""


def _fields(request: web.Request) -> dict[str, str]:
    return {name: request.query.get(name, "").strip() for name in FIELDS}


def _after(request: web.Request) -> Position | None:
    token = request.query.get("after", "")
    if not token:
        return None
    try:
        return Position.parse(token)
    except ValueError:
        raise Refused("That page link is damaged: look up again from the first page.") from None


def _urls(fields: dict[str, str], page: Page | None) -> tuple[str, str | None]:
    """The links of a page of rows: (its first page, the next; None: no more)."""
    given = {k: v for k, v in fields.items() if v}
    after = None if page is None or page.next is None else page.next.token()
    return ("/history?" + urlencode(given),
            None if after is None else "/history?" + urlencode({**given, "after": after}))


_HISTORY_DEFAULTS: dict[str, object] = {
    "view": None, "refused": "", "page": None, "query": None, "shown_rcpt": "", "first": True,
    "first_url": "/history", "next_url": None, "key": "", "heading": "", "template": "",
    "state": None, "state_at": None, "done": None}
"""What the history page shows when a view leaves it out."""


def _history_page(ctx: ConsoleContext, request: web.Request, *, status: int = 200,
                  **values: object) -> web.Response:
    return ctx.page("history.html", request, status=status, **{**_HISTORY_DEFAULTS, **values})


@routes.get("/history")
async def history(request: web.Request) -> web.StreamResponse:
    """A fingerprint's rows, or the rows that match a lookup (see the module's docstring)."""
    ctx = request.app[CONTEXT]
    fields = _fields(request)
    if not any(fields.values()):
        return _history_page(ctx, request, fields=fields, view=None)
    try:
        if fields["key"] or fields["store_key"]:
            return await _fingerprint(ctx, request, fields)
        return await _search(ctx, request, fields)
    except Refused as exc:
        return _history_page(ctx, request, status=400, fields=fields, view=None,
                        refused=str(exc))


async def _fingerprint(ctx: ConsoleContext, request: web.Request, fields: dict[str, str]
                       ) -> web.StreamResponse:
    """One fingerprint: its record in the store, its ledger rows oldest first."""
    if any(fields[name] for name in _SEARCH_ONLY):
        raise Refused("Look up one fingerprint (recipient, template and key, or a store key), "
                      "or search by recipient, Message-ID, queue id, template or period: "
                      "leave the key and store key empty to search.")
    try:
        chosen = selected_keys(ctx.settings, Selection(
            store_key=fields["store_key"] or None, rcpt=fields["rcpt"] or None,
            templates=[fields["template"]] if fields["template"] else [],
            keys=[fields["key"]] if fields["key"] else []))
    except SelectionError as exc:
        raise Refused(selection_words(ctx.settings, exc)) from exc
    after = _after(request)
    try:  # its key, or while a previous secret is set its key of that secret (design §2.3)
        key, record = await located(ctx.the_store(), chosen)
    except StoreError as exc:
        raise ConsoleError(503, f"The store did not answer: {exc}") from exc
    page: Page | None = None
    if ctx.settings.ledger is not None:
        async with ctx.ledger() as reader:
            page = await ledger_call(reader.search(
                LedgerQuery(store_keys=chosen, oldest_first=True), after=after, limit=PAGE_ROWS))
    first_url, next_url = _urls(fields, page)
    named = [row for row in (page.rows if page is not None else []) if row.recipient]
    heading = shown_address(ctx, fields["rcpt"]) or (named[0].recipient if named else "")
    template = fields["template"] or (named[0].template if named else "")
    return _history_page(ctx, request, fields=fields, view="fingerprint", key=key,
                    heading=heading, template=template,
                    state=describe(key, record, ctx.settings.lease), page=page,
                    state_at=None if record.at is None else datetime.fromtimestamp(
                        record.at, tz=UTC),
                    first=after is None, done=DONE.get(request.query.get("done", "")),
                    first_url=first_url, next_url=next_url)


async def _search(ctx: ConsoleContext, request: web.Request, fields: dict[str, str]
                  ) -> web.StreamResponse:
    """The ledger rows that match every field given, newest first."""
    if ctx.settings.ledger is None:
        return _history_page(ctx, request, fields=fields, view="no-ledger")
    try:
        query = ledger_query(ctx.settings, Lookup(
            rcpt=fields["rcpt"], message_id=fields["message_id"], queue_id=fields["queue_id"],
            template=fields["template"], since=fields["since"], until=fields["until"]),
            now=datetime.now(tz=UTC))
    except LookupRefused as exc:
        text = str(exc)
        raise Refused(text[:1].upper() + text[1:] + ".") from exc
    after = _after(request)
    async with ctx.ledger() as reader:
        page = await ledger_call(reader.search(query, after=after, limit=PAGE_ROWS))
    first_url, next_url = _urls(fields, page)
    return _history_page(ctx, request, fields=fields, view="search", page=page,
                    query=query, shown_rcpt=shown_address(ctx, fields["rcpt"]),
                    first=after is None, first_url=first_url, next_url=next_url)


@routes.get("/message/{queue_id}")
async def message(request: web.Request) -> web.StreamResponse:
    """One message by the relay's queue id: its recipients and timeline (404: no row has it)."""
    ctx = request.app[CONTEXT]
    queue_id = request.match_info["queue_id"].strip()
    if ctx.settings.ledger is None:
        raise ConsoleError(404, "No audit ledger is configured: a message's page is read from "
                                "the ledger. Look a recipient up by its template and key on "
                                "the history page.")
    async with ctx.ledger() as reader:
        rows = await ledger_call(reader.timeline(queue_id))
        own = [row for row in rows if row.queue_id == queue_id]
        looks = await ledger_call(reader.looks([r.store_key for r in own if r.store_key]))
    if not own:
        return ctx.page("message.html", request, status=404, queue_id=queue_id, own=[])
    records: dict[str, dict[str, object]] = {}
    for key in list(dict.fromkeys(r.store_key for r in own if r.store_key))[:MAX_RECORDS]:
        try:
            records[key] = describe(key, await ctx.the_store().inspect(key),
                                    ctx.settings.lease)
        except StoreError as exc:
            raise ConsoleError(503, f"The store did not answer: {exc}") from exc
    return ctx.page("message.html", request, queue_id=queue_id, own=own, first=own[0],
                    records=records, looks=looks, events=timeline(rows, queue_id),
                    cut=len(rows) >= TIMELINE_ROWS)


def timeline(rows: list[HistoryRow], queue_id: str) -> list[Event]:
    """The events of the message ``queue_id`` from its timeline's ``rows`` (oldest first):
    received and marked SENDING (the earliest of its rows' times), each of its recipients'
    decisions, and the other rows of its store keys (another message's decision, an
    operator's action), in the order they happened."""
    own = [r for r in rows if r.queue_id == queue_id]
    events: list[Event] = []
    received = min((r.received_at for r in own if r.received_at is not None), default=None)
    if received is not None:
        events.append(Event(received, "received", "received from the client",
                            own[0].message_id and f"Message-ID {own[0].message_id}"))
    sending = min((r.sending_at for r in own if r.sending_at is not None), default=None)
    if sending is not None:
        upstream = next((r.upstream for r in own if r.upstream), "")
        events.append(Event(sending, "sending", "marked SENDING: the final dot went upstream"
                            + (f" ({upstream})" if upstream else "")))
    for row in rows:
        words = OUTCOME_WORDS.get(row.outcome, row.outcome.replace("_", " "))
        if row.queue_id == queue_id:
            what = f"{row.recipient or '-'}: {words}"
            link = f"/history?{urlencode({'store_key': row.store_key})}" if row.store_key \
                else ""
        elif row.action != "relay" or not row.queue_id:
            what, link = words, ""
        else:
            what = f"{row.recipient or '-'}: {words}, in another message ({row.queue_id})"
            link = f"/message/{row.queue_id}"
        events.append(Event(row.decided_at, row.outcome, what, row.reply or row.client_reply,
                            link))
    return sorted(events, key=lambda e: e.at)
