"""The console's pages that read: ``/history`` (one fingerprint's ledger rows oldest first
and the store's state), ``/in-doubt`` (the unresolved in-doubt decisions, each with the
operator's release and mark-sent form: :mod:`relay.console.actions`), ``/stats`` (records by
state, duplicates suppressed per template in the last 24 h, in-doubt counts) and the style
sheet.

A page is a handler here: it takes what it needs from the context (``request.app[CONTEXT]``:
the store, :meth:`~relay.console.context.ConsoleContext.ledger`), raises
:class:`relay.console.errors.ConsoleError` for a page of refusal, and renders its template
(:meth:`~relay.console.context.ConsoleContext.page`). What a page shows of an address is no
more than the ledger holds (``ledger_recipients``), or without a ledger than the log does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from relay.admin import (
    Selection,
    SelectionError,
    SelectionProblem,
    describe,
    located,
    selected_keys,
    stats_report,
)
from relay.console.context import CONTEXT, ConsoleContext, ledger_call
from relay.console.errors import ConsoleError
from relay.core.address import mask_address
from relay.core.errors import StoreError
from relay.settings import Settings, redact_url

if TYPE_CHECKING:  # the postgres extra: imported once a ledger is configured
    from relay.store.postgres.ledger_read import HistoryRow

MAX_ROWS = 1000  # rows a page shows at most (the oldest); the CSV export has no cap
STATS_TEMPLATES = 50  # templates the stats page lists at most
DONE = {"released": "released", "marked_sent": "marked sent",
        "settled": "no longer in the store (its window passed): its in-doubt row is settled"}
"""What an operator's action did, by the ``done`` code of the page it leads to."""
_SELECTION_WORDS = {
    SelectionProblem.BOTH: "Give a recipient and key, or a store key, not both.",
    SelectionProblem.FOREIGN: "That is no fingerprint of this relay: its store keys start "
                              "with {prefix!r}.",
    SelectionProblem.INCOMPLETE: "Give the recipient and the X-Dedupe-Key (and the X-Template "
                                 "when the message had one), or a store key.",
}
"""How the console words a refused selection (:class:`relay.admin.SelectionError`; a
recipient or key the relay refuses is said in the relay's own words)."""

routes = web.RouteTableDef()


def refused_selection(settings: Settings, exc: SelectionError) -> ConsoleError:
    """The 400 page of a selection :func:`relay.admin.selected_key` refused."""
    words = _SELECTION_WORDS.get(exc.problem)
    return ConsoleError(400, str(exc) if words is None
                        else words.format(prefix=settings.store_prefix))


@routes.get("/")
async def home(request: web.Request) -> web.StreamResponse:
    """The console's home is the history page."""
    raise web.HTTPFound("/history")


@routes.get("/static/console.css")
async def style(request: web.Request) -> web.StreamResponse:
    """The style sheet (read once, at start)."""
    return web.Response(text=request.app[CONTEXT].style, content_type="text/css",
                        charset="utf-8")


@routes.get("/history")
async def history(request: web.Request) -> web.StreamResponse:
    """One fingerprint: by recipient + template + key, or by its store key."""
    ctx = request.app[CONTEXT]
    query = request.query
    fields = {name: query.get(name, "").strip() for name in
              ("rcpt", "template", "key", "store_key")}
    if not any(fields.values()):
        return ctx.page("history.html", request, fields=fields, key=None)
    try:
        chosen = selected_keys(ctx.settings, Selection(
            store_key=fields["store_key"] or None, rcpt=fields["rcpt"] or None,
            templates=[fields["template"]] if fields["template"] else [],
            keys=[fields["key"]] if fields["key"] else []))
    except SelectionError as exc:
        raise refused_selection(ctx.settings, exc) from exc
    try:  # its key, or while a previous secret is set its key of that secret (design §2.3)
        key, record = await located(ctx.the_store(), chosen)
    except StoreError as exc:
        raise ConsoleError(503, f"The store did not answer: {exc}") from exc
    rows: list[HistoryRow] | None = None
    if ctx.settings.ledger is not None:
        async with ctx.ledger() as reader:
            rows = await ledger_call(reader.history(*chosen, limit=MAX_ROWS))
    return ctx.page("history.html", request, fields=fields, key=key,
                    shown_rcpt=_shown(ctx, fields["rcpt"]),
                    state=describe(key, record, ctx.settings.lease), rows=rows,
                    cut=rows is not None and len(rows) >= MAX_ROWS,
                    done=DONE.get(query.get("done", "")))


def _shown(ctx: ConsoleContext, address: str) -> str:
    """An address as far as the ledger (or, without one, the log) shows it."""
    s = ctx.settings
    full = s.ledger_recipients == "full" if s.ledger is not None else s.log_recipients
    return address if full or not address else mask_address(address)


@routes.get("/in-doubt")
async def in_doubt(request: web.Request) -> web.StreamResponse:
    """The ledger's unresolved in-doubt decisions, the oldest first."""
    ctx = request.app[CONTEXT]
    if ctx.settings.ledger is None:
        return ctx.page("in_doubt.html", request, rows=None, cut=False)
    async with ctx.ledger() as reader:
        rows = await ledger_call(reader.in_doubt(older_than_s=0, limit=MAX_ROWS))
    return ctx.page("in_doubt.html", request, rows=rows, cut=len(rows) >= MAX_ROWS)


@routes.get("/stats")
async def stats(request: web.Request) -> web.StreamResponse:
    """The store's records by state and, with a ledger, the last 24 h's suppressions."""
    ctx = request.app[CONTEXT]
    report = stats_report(ctx.settings, await ctx.counts(), 24)
    templates: list[tuple[str, int]] | None = None
    unresolved: int | None = None
    if ctx.settings.ledger is not None:
        async with ctx.ledger() as reader:
            templates = await ledger_call(reader.suppressed_by_template(
                since_s=86400, limit=STATS_TEMPLATES))
            unresolved = await ledger_call(reader.count_unresolved())
    return ctx.page("stats.html", request, report=report, templates=templates,
                    unresolved=unresolved, store=redact_url(ctx.settings.store))
