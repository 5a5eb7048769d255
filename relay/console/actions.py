"""The console's actions: an operator's release or mark-sent of one in-doubt fingerprint, with
a reason (``POST /in-doubt/resolve``), the CLI's own audited action
(:func:`relay.admin.decide`: the ledger first, then the store, then the row).

Only an operator acts (a viewer gets ``403``); the record must still be in doubt (read as
unknown in the store, or gone from it and listed unresolved in the ledger), else ``409``; the
row names the console user and role (``instance`` ``HOSTNAME/console``) and the ``relay.audit``
line ``console:USER``. One action per store key at a time in this console: the second of two
sent together reads what the first left (the store's compare refuses it too, across
processes). Done, the browser goes to the fingerprint's history page, which says what was
done (:data:`relay.console.pages.DONE`).
"""

from __future__ import annotations

import contextlib
import logging
from urllib.parse import urlencode

from aiohttp import web

from relay.admin import (
    Decision,
    InFlightError,
    LedgerRefused,
    Outcome,
    SelectionError,
    changed_meanwhile,
    decide,
    own_store_key,
)
from relay.console.context import CONTEXT, SESSION, ConsoleContext
from relay.console.errors import ConsoleError
from relay.console.forms import form_of
from relay.console.pages import DONE, refused_selection
from relay.console.sessions import Session
from relay.core.errors import StoreError
from relay.core.interfaces import LedgerAction

log = logging.getLogger("relay.console")

_ACTIONS = {"release": LedgerAction.RELEASE, "mark_sent": LedgerAction.MARK_SENT}

routes = web.RouteTableDef()


@routes.post("/in-doubt/resolve")
async def resolve(request: web.Request) -> web.StreamResponse:
    """An operator's release or mark-sent of one in-doubt fingerprint, with a reason."""
    ctx = request.app[CONTEXT]
    session = request[SESSION]
    form = await form_of(request)
    action, key = str(form.get("action", "")), str(form.get("store_key", "")).strip()
    reason = str(form.get("reason", "")).strip()
    if session.role != "operator":
        ctx.metrics.refused("role")
        log.warning("console action refused: not an operator", extra={
            "user": session.user, "role": session.role, "action": action,
            "store_key": key, "peer": request.remote})
        raise ConsoleError(403, "Only an operator can release or mark sent; you are "
                                f"signed in as a {session.role}.")
    if action not in _ACTIONS:
        raise ConsoleError(400, "Choose release or mark sent.")
    if not reason:
        raise ConsoleError(400, "Say why (the reason goes into the audit ledger and log).")
    try:
        own_store_key(ctx.settings, key)
    except SelectionError as exc:
        raise refused_selection(ctx.settings, exc) from exc
    async with ctx.one_at_a_time(key):
        outcome = await _decided(ctx, session, Decision(
            _ACTIONS[action], key, reason, who=f"{session.user} ({session.role}, console)",
            operator=f"console:{session.user}", role=session.role, keep_expiry=True,
            in_doubt_only=True))
    done = _done_code(_ACTIONS[action], outcome)
    ctx.metrics.acted(action)
    log.info("console %s", action.replace("_", " "), extra={
        "user": session.user, "role": session.role, "store_key": key, "done": done,
        "reason": reason, "recorded": outcome.entry is not None, "peer": request.remote})
    raise web.HTTPSeeOther("/history?" + urlencode({"store_key": key, "done": done}))


async def _decided(ctx: ConsoleContext, session: Session, decision: Decision) -> Outcome:
    """``decision`` done on the console's store with its ledger (when there is one); its
    refusals as pages: 503 when the ledger or the store does not answer, 409 when the record
    is in flight, no longer in doubt, or changed under the compare."""
    s = ctx.settings
    ledger = None if s.ledger is None else ctx.ledger()
    try:
        outcome = await decide(s, decision, store=contextlib.nullcontext(ctx.the_store()),
                               ledger=ledger, instance=f"{s.hostname}/console")
    except LedgerRefused as exc:
        raise ConsoleError(503, f"The audit ledger failed: {exc}") from exc
    except InFlightError as exc:  # NotInDoubtError is one
        raise ConsoleError(409, f"Refused: {exc}") from exc
    except StoreError as exc:
        raise ConsoleError(503, f"The store did not answer; nothing was done: {exc}"
                           ) from exc
    if outcome.changed:  # the compare-and-delete or -set lost: it changed meanwhile
        done = "released" if decision.action is LedgerAction.RELEASE else "marked sent"
        raise ConsoleError(409, f"Refused: {changed_meanwhile(done)}")
    if outcome.unrecorded is not None:
        log.error("console action done but its ledger row was not written",
                  extra={"user": session.user, "store_key": decision.key,
                         "error": str(outcome.unrecorded)})
        done = DONE[_done_code(decision.action, outcome)]
        raise ConsoleError(503, f"The record was {done}, but its ledger row was not written: "
                                f"{outcome.unrecorded}")
    return outcome


def _done_code(action: LedgerAction, outcome: Outcome) -> str:
    """What was done, as a :data:`relay.console.pages.DONE` key."""
    if action is LedgerAction.MARK_SENT:
        return "marked_sent"
    return "released" if outcome.done else "settled"
