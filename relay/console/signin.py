"""Who may use the console: the guard every request passes (:func:`guard`: a live session, a
POST's CSRF token, the security headers) and the sign-in and sign-out (``/login``,
``/logout``).

Every request but the sign-in page and the style sheet needs a live session; anonymous ones
get ``302`` to ``/login`` (a page read in a browser) or ``401`` (``/export.csv``, every POST).
Every POST carries its session's CSRF token (the sign-in form a token of its own cookie), else
``403``. Sign-in is checked under SMTP AUTH's rule (:class:`relay.console.sessions.SignIns`);
after it the browser goes back to the page it asked for, on this console only.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from urllib.parse import urlencode

from aiohttp import web

from relay.console.context import CONTEXT, SESSION, ConsoleContext
from relay.console.errors import ConsoleError
from relay.console.forms import form_of
from relay.console.sessions import tokens_match
from relay.credentials import AttemptResult

log = logging.getLogger("relay.console")

SESSION_COOKIE = "dedup_relay_session"
LOGIN_COOKIE = "dedup_relay_login"  # the sign-in form's own CSRF token (no session yet)
_ANONYMOUS_PATHS = frozenset({"/login", "/static/console.css", "/favicon.ico"})

routes = web.RouteTableDef()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request but the sign-in page and the style sheet needs a live session; every
    POST its CSRF token. The security headers go on every answer. Once a request's body is in
    (received under the connection's timers: a body that never comes is closed with its
    connection), its connection is not closed for being idle or old while it is answered; one
    whose time ran out meanwhile closes after its response."""
    cap = request.app[CONTEXT].cap
    assert cap is not None
    if request.method == "POST":
        await request.read()  # at most client_max_size (413 past it), kept for form_of
    with cap.busy(request.transport) as timed_out:
        try:
            response = await _guarded(request, handler)
        except web.HTTPException as exc:  # a redirect
            if timed_out():
                exc.force_close()
            raise
        if timed_out():
            response.force_close()
        return response


async def _guarded(request: web.Request, handler: Handler) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    try:
        if request.path not in _ANONYMOUS_PATHS:
            session, expired = ctx.sessions.find(request.cookies.get(SESSION_COOKIE))
            if session is None:
                ctx.metrics.refused("expired" if expired else "anonymous")
                return ctx.headers(_anonymous(request))
            request[SESSION] = session
            assert ctx.cap is not None
            ctx.cap.vouch(request.transport)  # never closed to make room
            if request.method == "POST":
                form = await form_of(request)
                token = form.get("csrf")
                if not session.csrf_matches(token if isinstance(token, str) else None):
                    ctx.metrics.refused("csrf")
                    log.warning("console request refused: CSRF token missing or wrong",
                                extra={"user": session.user, "path": request.path,
                                       "peer": request.remote})
                    raise ConsoleError(403, "This form has expired or did not come from "
                                            "this console: open the page again.")
        response = await handler(request)
    except ConsoleError as exc:
        response = ctx.page("error.html", request, status=exc.status, message=str(exc))
    except web.HTTPException as exc:  # a redirect
        ctx.headers(exc)
        raise
    return ctx.headers(response)


def _anonymous(request: web.Request) -> web.StreamResponse:
    """302 to the sign-in page for a page read in a browser, else 401."""
    if request.method == "GET" and request.path != "/export.csv":
        target = request.path_qs if request.path != "/" else "/history"
        raise web.HTTPFound(f"/login?{urlencode({'next': target})}")
    return web.Response(status=401, text="sign in first: /login\n",
                        headers={"WWW-Authenticate": 'FormBased realm="dedup-relay"'})


@routes.get("/login")
async def login_page(request: web.Request) -> web.StreamResponse:
    """The sign-in form."""
    return _login_form(request, status=200, message=None)


def _login_form(request: web.Request, *, status: int, message: str | None
                ) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    token = secrets.token_urlsafe(32)
    response = ctx.page("login.html", request, status=status, csrf=token,
                        next=local_path(request.query.get("next", "/history")),
                        message=message)
    ctx.cookie(response, LOGIN_COOKIE, token, max_age=3600)
    return response


@routes.post("/login")
async def login(request: web.Request) -> web.StreamResponse:
    """Check a sign-in; on success open a session and go to the page asked for."""
    ctx = request.app[CONTEXT]
    form = await form_of(request)
    expected = request.cookies.get(LOGIN_COOKIE, "")
    given = form.get("csrf")
    if not expected or not isinstance(given, str) or not tokens_match(given, expected):
        ctx.metrics.refused("csrf")
        raise ConsoleError(403, "The sign-in form expired or did not come from this "
                                "console: open the page again.")
    user, password = str(form.get("user", "")), str(form.get("password", ""))
    peer = request.remote or "unknown"
    result, role, stamp = await ctx.sign_ins.check(peer, user, password)
    ctx.metrics.signed_in(result)
    if result is not AttemptResult.SUCCEEDED or role is None:
        return _refused(ctx, request, result, peer)
    token, _ = ctx.sessions.start(user, role, stamp)
    log.info("console sign-in", extra={"user": user, "role": role, "peer": peer})
    response = web.HTTPSeeOther(local_path(str(form.get("next", "/history"))))
    ctx.cookie(response, SESSION_COOKIE, token, max_age=None)
    response.del_cookie(LOGIN_COOKIE, path="/")
    raise response


def _refused(ctx: ConsoleContext, request: web.Request, result: AttemptResult, peer: str
             ) -> web.StreamResponse:
    """The sign-in form again: 429 when the address's budget is spent, else 401."""
    log.warning("console sign-in %s", result.value, extra={"peer": peer})
    window_min = max(1, round(ctx.settings.auth_failure_window / 60))
    if result is AttemptResult.REFUSED:
        return _login_form(request, status=429, message=(
            f"Too many failed sign-ins from your address: try again in up to {window_min} "
            "min."))
    return _login_form(request, status=401, message="Wrong user name or password.")


@routes.post("/logout")
async def logout(request: web.Request) -> web.StreamResponse:
    """End the request's session."""
    ctx = request.app[CONTEXT]
    session = request[SESSION]
    ctx.sessions.end(request.cookies.get(SESSION_COOKIE))
    log.info("console sign-out", extra={"user": session.user, "peer": request.remote})
    response = web.HTTPSeeOther("/login")
    response.del_cookie(SESSION_COOKIE, path="/")
    raise response


def local_path(target: str) -> str:
    """``target`` when it is a path on this console (``/...``, not ``//host``), else
    ``/history``: a sign-in never sends the browser elsewhere (an open redirect)."""
    if target.startswith("/") and not target.startswith(("//", "/\\")) \
            and not any(ch.isspace() or ord(ch) < 32 for ch in target):
        return target
    return "/history"
