"""The console's pages that read, but its lookups (``/history``, ``/message/<queue id>``:
:mod:`relay.console.history`): ``/in-doubt`` (the unresolved in-doubt decisions, each with what the
reconciler found and the operator's release and mark-sent form, for an operator only:
:mod:`relay.console.actions`),
``/stats`` (records by state, duplicates suppressed per template in the last 24 h, in-doubt
counts) and the style sheet.

A page is a handler here: it takes what it needs from the context (``request.app[CONTEXT]``:
the store, :meth:`~relay.console.context.ConsoleContext.ledger`), raises
:class:`relay.console.errors.ConsoleError` for a page of refusal, and renders its template
(:meth:`~relay.console.context.ConsoleContext.page`). What a page shows of an address is no
more than the ledger holds (``ledger_recipients``), or without a ledger than the log does.
"""

from __future__ import annotations

from aiohttp import web

from relay.admin import SelectionError, SelectionProblem, stats_report
from relay.console.context import CONTEXT, ConsoleContext, ledger_call
from relay.console.errors import ConsoleError
from relay.core.address import mask_address
from relay.settings import Settings, redact_url

MAX_IN_DOUBT = 1000  # in-doubt decisions the page lists at most (the oldest)
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


def selection_words(settings: Settings, exc: SelectionError) -> str:
    """How the console says why :func:`relay.admin.selected_key` refused a selection."""
    words = _SELECTION_WORDS.get(exc.problem)
    return str(exc) if words is None else words.format(prefix=settings.store_prefix)


def refused_selection(settings: Settings, exc: SelectionError) -> ConsoleError:
    """The 400 page of a selection :func:`relay.admin.selected_key` refused."""
    return ConsoleError(400, selection_words(settings, exc))


@routes.get("/")
async def home(request: web.Request) -> web.StreamResponse:
    """The console's home is the history page."""
    raise web.HTTPFound("/history")


@routes.get("/static/console.css")
async def style(request: web.Request) -> web.StreamResponse:
    """The style sheet (read once, at start)."""
    return web.Response(text=request.app[CONTEXT].style, content_type="text/css",
                        charset="utf-8")


def shown_address(ctx: ConsoleContext, address: str) -> str:
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
        rows = await ledger_call(reader.in_doubt(older_than_s=0, limit=MAX_IN_DOUBT))
        last_look = await ledger_call(reader.last_look())
    return ctx.page("in_doubt.html", request, rows=rows, cut=len(rows) >= MAX_IN_DOUBT,
                    last_look=last_look, reconciling=ctx.settings.reconciling)


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
