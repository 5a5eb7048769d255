"""The web console (design.md §6.9, docs/console.md): server-rendered pages for support,
compliance and the on-call engineer, on ``console_listen``, one per relay (served by the
supervisor with several workers, else by the relay's process).

Pages (each answers an anonymous request 302 to ``/login``, or 401 for ``/export.csv`` and
every POST): ``/history`` (one fingerprint's ledger rows oldest first and the store's state),
``/in-doubt`` (the unresolved in-doubt decisions; an operator releases or marks one sent, with
a reason), ``/stats`` (records by state, duplicates suppressed per template in the last 24 h,
in-doubt counts) and ``/export.csv?from=...&to=...`` (a period's ledger rows, streamed:
:mod:`relay.console.export`).

Every POST carries its session's CSRF token (the sign-in form a token of its own cookie),
else 403. Responses are never cached, framed or sniffed, and load nothing from elsewhere
(Content-Security-Policy). Its connections are capped when TCP accepts them and idle ones
closed (:class:`relay.ops.http.CappedSite`), so a scanner cannot take the process's
descriptors; a full console closes anonymous connections that sent no request to let a new one
in, never one a signed-in request used (:meth:`relay.ops.connection_cap.ConnectionCap.vouch`).
A POST's body must be a urlencoded form (:mod:`relay.console.forms`). The
ledger is read through one connection per request (:class:`LedgerReader`), so a long export
holds up no other page.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import jinja2
from aiohttp import web
from prometheus_client import CollectorRegistry

from relay.admin import (
    FingerprintInput,
    InFlightError,
    OperatorRow,
    changed_meanwhile,
    count_states,
    describe,
    key_for,
    mark_sent,
    release,
    stats_report,
)
from relay.console.errors import ConsoleError
from relay.console.export import READ_TIMEOUT_S, Sent, file_name, iso, period_of, stream_csv
from relay.console.forms import form_of
from relay.console.sessions import Session, Sessions, SignIns, tokens_match
from relay.core.address import mask_address
from relay.core.errors import InvalidAddressError, InvalidDedupKeyError, StoreError
from relay.core.interfaces import (
    FingerprintStore,
    LedgerAction,
    LedgerEntry,
    Record,
    State,
    StateCounts,
)
from relay.core.rules import reads_as
from relay.credentials import AttemptResult
from relay.ops.connection_cap import ConnectionCap
from relay.ops.http import CappedSite
from relay.ops.metrics import ConsoleMetrics
from relay.settings import Settings, redact_url
from relay.smtp.tls import rotate_certificate
from relay.smtp.tls_handover import server_handshake

if TYPE_CHECKING:  # the postgres extra: imported once a ledger is configured
    from relay.store.postgres.ledger_read import HistoryRow, LedgerReader

log = logging.getLogger("relay.console")

SESSION_COOKIE = "dedup_relay_session"
LOGIN_COOKIE = "dedup_relay_login"  # the sign-in form's own CSRF token (no session yet)
MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 30.0
HANDSHAKE_TIMEOUT_S = 10.0  # a TLS client's handshake at most (a connection that never starts)
MAX_PER_ADDRESS = 16  # connections from one client address (a browser opens 6 at most)
ANONYMOUS_GRACE_S = 2.0  # at the cap, a connection with no complete request by then may go
LIFETIME_S = 60.0  # a connection's life when no request is being answered on it (a trickle)
SHUTDOWN_S = 2.5  # requests still running at stop get this long, twice (aiohttp's two waits)
MAX_LEDGER_CONNECTIONS = 8  # page requests reading the ledger at once (one connection each)
MAX_EXPORTS = 4  # exports at once (each a connection and a read-only transaction)
MAX_BODY = 64 * 1024  # a form's body at most (bytes)
MAX_ROWS = 1000  # rows a page shows at most (the oldest); the CSV export has no cap
STATS_TTL_S = 30.0  # a stats page's counts are reused this long (a full count of the store)
STATS_MAX_KEYS = 1_000_000  # Redis: keys one count scans at most (as `dedup-relay stats`)
STATS_TEMPLATES = 50  # templates the stats page lists at most
_ANONYMOUS_PATHS = frozenset({"/login", "/static/console.css", "/favicon.ico"})
_SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; style-src 'self'; img-src 'self'; "
                                "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
DONE = {"released": "released", "marked_sent": "marked sent",
        "settled": "no longer in the store (its window passed): its in-doubt row is settled"}
"""What an operator's action did, by the ``done`` code of the page it leads to."""
_SESSION = web.RequestKey("session", Session)  # the request's signed-in session


@dataclass
class _KeyLock:
    """The lock of one store key's actions and how many requests hold or wait for it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


@dataclass
class _Stats:
    counts: StateCounts
    at: float


class Console:
    """The console's web server: ``await start()``, then ``await stop()``.

    ``store``: the relay's store client when the console shares its process, else None (the
    console opens its own at start and closes it at stop). ``registry``: where its metrics go
    (None: not exported). ``sock``: a socket already bound to ``console_listen``.
    Raises ConfigError from the constructor when the users file or the certificate does not
    load."""

    def __init__(self, settings: Settings, *, store: FingerprintStore | None,
                 registry: CollectorRegistry | None, sock: socket.socket | None = None) -> None:
        address = settings.console_address
        assert address is not None  # built only with a console_listen
        self.settings = settings
        self._address = address
        self._sock = sock
        self._store = store
        self._own_store = store is None
        self._tls: ssl.SSLContext | None = settings.console_tls_context(
            settings.console_certificate)
        self.metrics = ConsoleMetrics(registry=registry)
        self.sessions = Sessions(idle_s=settings.console_session_timeout)
        self.sign_ins = SignIns(settings.auth_attempts(settings.console_users()))
        self._pages = jinja2.Environment(
            loader=jinja2.PackageLoader("relay.console", "templates"),
            autoescape=True, undefined=jinja2.StrictUndefined)
        assert self._pages.loader is not None
        self._style = self._pages.loader.get_source(self._pages, "console.css")[0]  # read once
        self._stats: _Stats | None = None
        # ledger connections: the pages' and the exports' apart, so that long downloads never
        # keep an operator from the in-doubt page
        self._page_slots = asyncio.Semaphore(MAX_LEDGER_CONNECTIONS)
        self._export_slots = asyncio.Semaphore(MAX_EXPORTS)
        self._acting: dict[str, _KeyLock] = {}  # operators' actions, by store key
        self._cap: ConnectionCap | None = None
        self._site: CappedSite | None = None
        self.port = 0

    @property
    def tls(self) -> bool:
        """Whether the console serves HTTPS."""
        return self._tls is not None

    # -- life ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the store (when not shared), bind (unless given a socket) and serve; ``port``
        is the bound port afterwards. Raises OSError when the address cannot be bound, the
        store's errors when it cannot be opened."""
        if self._store is None:
            s = self.settings
            self._store = await s.open_store(window_s=s.dedup_window)
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY)
        app.router.add_get("/", self._home)
        app.router.add_get("/login", self._login_page)
        app.router.add_post("/login", self._login)
        app.router.add_post("/logout", self._logout)
        app.router.add_get("/history", self._history)
        app.router.add_get("/in-doubt", self._in_doubt)
        app.router.add_post("/in-doubt/resolve", self._resolve)
        app.router.add_get("/stats", self._stats_page)
        app.router.add_get("/export.csv", self._export)
        app.router.add_get("/static/console.css", self._css)
        handshake = None if self._tls is None else functools.partial(
            server_handshake, context=self._tls, timeout_s=HANDSHAKE_TIMEOUT_S)
        self._site = CappedSite(
            app, host=self._address[0], port=self._address[1], sock=self._sock,
            handshake=handshake, shutdown_timeout_s=SHUTDOWN_S,
            max_connections=MAX_CONNECTIONS, idle_timeout_s=IDLE_TIMEOUT_S,
            max_per_address=MAX_PER_ADDRESS, lifetime_s=LIFETIME_S,
            evict_after_s=ANONYMOUS_GRACE_S)
        await self._site.start()
        self._cap = self._site.cap
        self.port = self._site.port

    async def stop(self) -> None:
        """Stop serving, end open requests (aiohttp's shutdown), close an own store."""
        if self._site is not None:
            await self._site.stop()
        if self._own_store and self._store is not None:
            await self._store.close()
            self._store = None

    async def reload(self, settings: Settings, applied: AbstractSet[str]) -> None:
        """Apply a reload: the certificate (its own, or the listener's) is read again from the
        next handshake, as the listener's is; with ``console_auth_file`` in ``applied`` the
        users file is read again: the next sign-in is checked against it, and the sessions of
        a user whose line went or changed (another password hash or role) end. Raises
        ConfigError when a file does not load; then nothing was changed."""
        users = None
        if "console_auth_file" in applied:
            users = await asyncio.to_thread(settings.console_users)
        pair = settings.console_certificate
        if self._tls is not None and pair is not None:
            await asyncio.to_thread(rotate_certificate, self._tls, *pair)
        if users is not None:
            self.sign_ins.users.replace_with(users)
            self.sessions.keep_only(lambda s: users.stamp(s.user) == s.stamp)
            log.info("console users read again", extra={"users": len(users)})
        self.settings = settings  # the live ones: the dedup window of a mark-sent, ...

    def describe(self) -> str:
        """The console for a start-up line: ``console https://HOST:PORT/``."""
        return self.settings.describe_console(self.port, tls=self.tls)

    # -- the guard: sessions, CSRF, headers -----------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
        """Every request but the sign-in page and the style sheet needs a live session; every
        POST its CSRF token. The security headers go on every answer. Once a request's body
        is in (received under the connection's timers: a body that never comes is closed
        with its connection), its connection is not closed for being idle or old while it is
        answered; one whose time ran out meanwhile closes after its response."""
        assert self._cap is not None
        if request.method == "POST":
            await request.read()  # at most MAX_BODY (413 past it), kept for request.post()
        with self._cap.busy(request.transport) as timed_out:
            try:
                response = await self._guarded(request, handler)
            except web.HTTPException as exc:  # a redirect
                if timed_out():
                    exc.force_close()
                raise
            if timed_out():
                response.force_close()
            return response

    async def _guarded(self, request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
        try:
            if request.path not in _ANONYMOUS_PATHS:
                session, expired = self.sessions.find(request.cookies.get(SESSION_COOKIE))
                if session is None:
                    self.metrics.refused("expired" if expired else "anonymous")
                    return self._headers(self._anonymous(request))
                request[_SESSION] = session
                assert self._cap is not None
                self._cap.vouch(request.transport)  # never closed to make room
                if request.method == "POST":
                    form = await form_of(request)
                    token = form.get("csrf")
                    if not session.csrf_matches(token if isinstance(token, str) else None):
                        self.metrics.refused("csrf")
                        log.warning("console request refused: CSRF token missing or wrong",
                                    extra={"user": session.user, "path": request.path,
                                           "peer": request.remote})
                        raise ConsoleError(403, "This form has expired or did not come from "
                                                "this console: open the page again.")
            response = await handler(request)
        except ConsoleError as exc:
            response = self._page("error.html", request, status=exc.status,
                                  message=str(exc))
        except web.HTTPException as exc:  # a redirect
            self._headers(exc)
            raise
        return self._headers(response)

    def _headers(self, response: web.StreamResponse) -> web.StreamResponse:
        if not response.prepared:
            response.headers.update(_SECURITY_HEADERS)
            if self._tls is not None:
                response.headers["Strict-Transport-Security"] = "max-age=31536000"
        return response

    def _anonymous(self, request: web.Request) -> web.StreamResponse:
        """302 to the sign-in page for a page read in a browser, else 401."""
        if request.method == "GET" and request.path != "/export.csv":
            target = request.path_qs if request.path != "/" else "/history"
            raise web.HTTPFound(f"/login?{urlencode({'next': target})}")
        return web.Response(status=401, text="sign in first: /login\n",
                            headers={"WWW-Authenticate": 'FormBased realm="dedup-relay"'})

    def _cookie(self, response: web.StreamResponse, name: str, value: str, *,
                max_age: int | None) -> None:
        response.set_cookie(name, value, httponly=True, secure=self._tls is not None,
                            samesite="Strict", path="/", max_age=max_age)

    # -- pages ------------------------------------------------------------------------------

    def _page(self, name: str, request: web.Request, *, status: int = 200,
              **values: Any) -> web.Response:
        session = request.get(_SESSION)
        body = self._pages.get_template(name).render(
            session=session, path=request.path, ledger=self.settings.ledger is not None,
            **values)
        return web.Response(text=body, status=status, content_type="text/html",
                            charset="utf-8")

    async def _home(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/history")

    async def _css(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text=self._style, content_type="text/css", charset="utf-8")

    async def _login_page(self, request: web.Request) -> web.StreamResponse:
        return self._login_form(request, status=200, message=None)

    def _login_form(self, request: web.Request, *, status: int, message: str | None
                    ) -> web.StreamResponse:
        token = secrets.token_urlsafe(32)
        response = self._page("login.html", request, status=status, csrf=token,
                              next=local_path(request.query.get("next", "/history")),
                              message=message)
        self._cookie(response, LOGIN_COOKIE, token, max_age=3600)
        return response

    async def _login(self, request: web.Request) -> web.StreamResponse:
        form = await form_of(request)
        expected = request.cookies.get(LOGIN_COOKIE, "")
        given = form.get("csrf")
        if not expected or not isinstance(given, str) or not tokens_match(given, expected):
            self.metrics.refused("csrf")
            raise ConsoleError(403, "The sign-in form expired or did not come from this "
                                    "console: open the page again.")
        user, password = str(form.get("user", "")), str(form.get("password", ""))
        peer = request.remote or "unknown"
        result, role, stamp = await self.sign_ins.check(peer, user, password)
        self.metrics.signed_in(result)
        if result is not AttemptResult.SUCCEEDED or role is None:
            log.warning("console sign-in %s", result.value, extra={"peer": peer})
            window_min = max(1, round(self.settings.auth_failure_window / 60))
            message = (f"Too many failed sign-ins from your address: try again in up to "
                       f"{window_min} min." if result is AttemptResult.REFUSED
                       else "Wrong user name or password.")
            return self._login_form(request, status=429 if result is AttemptResult.REFUSED
                                    else 401, message=message)
        token, _ = self.sessions.start(user, role, stamp)
        log.info("console sign-in", extra={"user": user, "role": role, "peer": peer})
        response = web.HTTPSeeOther(local_path(str(form.get("next", "/history"))))
        self._cookie(response, SESSION_COOKIE, token, max_age=None)
        response.del_cookie(LOGIN_COOKIE, path="/")
        raise response

    async def _logout(self, request: web.Request) -> web.StreamResponse:
        session = request[_SESSION]
        self.sessions.end(request.cookies.get(SESSION_COOKIE))
        log.info("console sign-out", extra={"user": session.user, "peer": request.remote})
        response = web.HTTPSeeOther("/login")
        response.del_cookie(SESSION_COOKIE, path="/")
        raise response

    async def _history(self, request: web.Request) -> web.StreamResponse:
        """One fingerprint: by recipient + template + key, or by its store key."""
        query = request.query
        fields = {name: query.get(name, "").strip() for name in
                  ("rcpt", "template", "key", "store_key")}
        if not any(fields.values()):
            return self._page("history.html", request, fields=fields, key=None)
        key = self._selected_key(fields)
        assert self._store is not None
        try:
            record = await self._store.inspect(key)
        except StoreError as exc:
            raise ConsoleError(503, f"The store did not answer: {exc}") from exc
        rows: list[HistoryRow] | None = None
        if self.settings.ledger is not None:
            async with self._ledger() as reader:
                rows = await _ledger_call(reader.history(key, limit=MAX_ROWS))
        return self._page("history.html", request, fields=fields, key=key,
                          shown_rcpt=self._shown(fields["rcpt"]),
                          state=describe(key, record, self.settings.lease), rows=rows,
                          cut=rows is not None and len(rows) >= MAX_ROWS,
                          done=DONE.get(query.get("done", "")))

    def _selected_key(self, fields: dict[str, str]) -> str:
        s = self.settings
        if fields["store_key"]:
            if fields["rcpt"] or fields["key"] or fields["template"]:
                raise ConsoleError(400, "Give a recipient and key, or a store key, not both.")
            if not fields["store_key"].startswith(s.store_prefix):
                raise ConsoleError(400, f"That is no fingerprint of this relay: its store keys "
                                        f"start with {s.store_prefix!r}.")
            return fields["store_key"]
        if not fields["rcpt"] or not fields["key"]:
            raise ConsoleError(400, "Give the recipient and the X-Dedupe-Key (and the "
                                    "X-Template when the message had one), or a store key.")
        given = FingerprintInput(rcpt=fields["rcpt"], keys=[fields["key"]],
                                 templates=[fields["template"]] if fields["template"] else [])
        try:
            return key_for(s, given)[1]
        except (InvalidAddressError, InvalidDedupKeyError, ValueError) as exc:
            raise ConsoleError(400, str(exc)) from exc

    def _shown(self, address: str) -> str:
        """An address as far as the ledger (or, without one, the log) shows it."""
        s = self.settings
        full = s.ledger_recipients == "full" if s.ledger is not None else s.log_recipients
        return address if full or not address else mask_address(address)

    async def _in_doubt(self, request: web.Request) -> web.StreamResponse:
        if self.settings.ledger is None:
            return self._page("in_doubt.html", request, rows=None, cut=False)
        async with self._ledger() as reader:
            rows = await _ledger_call(reader.in_doubt(older_than_s=0, limit=MAX_ROWS))
        return self._page("in_doubt.html", request, rows=rows, cut=len(rows) >= MAX_ROWS)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        """An operator's release or mark-sent of one in-doubt fingerprint, with a reason: the
        ledger must answer before the store is touched (an action is never left unrecorded),
        then the store acts, then the row is written, as ``dedup-relay release`` /
        ``mark-sent --store-key`` do."""
        session = request[_SESSION]
        form = await form_of(request)
        action, key = str(form.get("action", "")), str(form.get("store_key", "")).strip()
        reason = str(form.get("reason", "")).strip()
        if session.role != "operator":
            self.metrics.refused("role")
            log.warning("console action refused: not an operator", extra={
                "user": session.user, "role": session.role, "action": action,
                "store_key": key, "peer": request.remote})
            raise ConsoleError(403, "Only an operator can release or mark sent; you are "
                                    f"signed in as a {session.role}.")
        if action not in ("release", "mark_sent"):
            raise ConsoleError(400, "Choose release or mark sent.")
        if not reason:
            raise ConsoleError(400, "Say why (the reason goes into the audit ledger and log).")
        if not key.startswith(self.settings.store_prefix):
            raise ConsoleError(400, "That is no fingerprint of this relay.")
        # one action per key at a time in this console: the second of two sent together then
        # reads what the first left (the store's compare refuses it too, across processes)
        held = self._acting.setdefault(key, _KeyLock())
        held.users += 1
        try:
            async with held.lock:
                entry, done = await self._act(session, action, key, reason)
        finally:
            held.users -= 1
            if held.users == 0:
                del self._acting[key]
        self.metrics.acted(action)
        log.info("console %s", action.replace("_", " "), extra={
            "user": session.user, "role": session.role, "store_key": key, "done": done,
            "reason": reason, "recorded": entry is not None, "peer": request.remote})
        raise web.HTTPSeeOther("/history?" + urlencode({"store_key": key, "done": done}))

    async def _act(self, session: Session, action: str, key: str, reason: str
                   ) -> tuple[LedgerEntry | None, str]:
        """Do ``action`` on ``key``, which must still be in doubt (the store's record reads
        as unknown, or it left the store and the ledger still lists it unresolved), and
        write its ledger row (when there is a ledger); (the row written or None, what was
        done: a :data:`DONE` key). Raises :class:`ConsoleError`."""
        s = self.settings
        if s.ledger is None:
            return await self._act_on_store(session, action, key, reason, listed=False)
        async with self._ledger() as reader:
            listed = await _ledger_call(reader.unresolved(key))
            entry, done = await self._act_on_store(session, action, key, reason,
                                                   listed=listed)
            if entry is None:
                return None, done
            options = s.ledger_options(instance=f"{s.hostname}/console",
                                       secret=s.fingerprint_secret_bytes)
            try:
                await reader.write([entry], options)
            except StoreError as exc:
                log.error("console action done but its ledger row was not written",
                          extra={"user": session.user, "store_key": key, "error": str(exc)})
                raise ConsoleError(503, f"The record was {DONE[done]}, but its ledger row "
                                        f"was not written: {exc}") from exc
            return entry, done

    async def _act_on_store(self, session: Session, action: str, key: str, reason: str, *,
                            listed: bool) -> tuple[LedgerEntry | None, str]:
        """The store's half of :meth:`_act` (``listed``: the ledger lists ``key`` in doubt):
        the ledger row it calls for (None: none) and what was done."""
        s, store = self.settings, self._store
        assert store is not None
        who = f"{session.user} ({session.role}, console)"
        operator = f"console:{session.user}"
        row = OperatorRow(s, LedgerAction.RELEASE if action == "release"
                          else LedgerAction.MARK_SENT, key)

        def in_doubt(record: Record) -> bool:
            return reads_as(record, s.lease) is State.UNKNOWN or (
                listed and record.state is State.ABSENT)

        try:
            if action == "release":
                before, deleted = await release(store, key, reason=reason, lease_s=s.lease,
                                                operator=operator, role=session.role,
                                                only_if=in_doubt)
                entry = row.released(before, deleted, who=who, reason=reason)
                if entry is None:  # the compare-and-delete lost: it changed meanwhile
                    raise ConsoleError(409, f"Refused: {changed_meanwhile('released')}")
                return entry, "released" if deleted else "settled"
            _, marked = await mark_sent(store, key, reason=reason, lease_s=s.lease,
                                        window_s=s.dedup_window, operator=operator,
                                        role=session.role, keep_expiry=True, only_if=in_doubt)
            if not marked:  # the compare-and-set lost: it changed meanwhile
                raise ConsoleError(409, f"Refused: {changed_meanwhile('marked sent')}")
            return row.marked_sent(who=who, reason=reason), "marked_sent"
        except InFlightError as exc:  # NotInDoubtError is one
            raise ConsoleError(409, f"Refused: {exc}") from exc
        except StoreError as exc:
            raise ConsoleError(503, f"The store did not answer; nothing was done: {exc}"
                               ) from exc

    async def _stats_page(self, request: web.Request) -> web.StreamResponse:
        counts = await self._counts()
        report = stats_report(self.settings, counts, 24)
        templates: list[tuple[str, int]] | None = None
        unresolved: int | None = None
        if self.settings.ledger is not None:
            async with self._ledger() as reader:
                templates = await _ledger_call(reader.suppressed_by_template(
                    since_s=86400, limit=STATS_TEMPLATES))
                unresolved = await _ledger_call(reader.count_unresolved())
        return self._page("stats.html", request, report=report, templates=templates,
                          unresolved=unresolved,
                          store=redact_url(self.settings.store))

    async def _counts(self) -> StateCounts:
        """The store's records by state, counted at most every :data:`STATS_TTL_S` (a full
        count reads every record: a page left refreshing must not load the store)."""
        now = time.monotonic()
        if self._stats is not None and now - self._stats.at < STATS_TTL_S:
            return self._stats.counts
        assert self._store is not None
        try:
            counts = await count_states(self._store, self.settings, older_than_h=24,
                                        max_keys=STATS_MAX_KEYS)
        except (StoreError, TypeError) as exc:
            raise ConsoleError(503, f"The store could not be counted: {exc}") from exc
        self._stats = _Stats(counts, now)
        return counts

    async def _export(self, request: web.Request) -> web.StreamResponse:
        """The ledger rows decided in [from, to) as CSV (:mod:`relay.console.export`)."""
        session = request[_SESSION]
        if self.settings.ledger is None:
            raise ConsoleError(404, "No audit ledger is configured: there is nothing to "
                                    "export.")
        start, end = period_of(request.query.get("from", ""), request.query.get("to", ""),
                               now=datetime.now(tz=UTC))
        sent = Sent()
        try:
            async with self._ledger(self._export_slots) as reader, \
                    contextlib.aclosing(reader.period(
                        start, end, read_timeout_s=READ_TIMEOUT_S)) as batches:
                # closed here, also when the client leaves mid-download: its transaction
                # ends before the connection does
                first = await _ledger_call(anext(batches, []))
                response = web.StreamResponse(headers={
                    "Content-Type": "text/csv; charset=utf-8",
                    "Content-Disposition": f"attachment; filename=\"{file_name(start, end)}\""})
                self._headers(response)
                await response.prepare(request)
                await stream_csv(request, response, first, batches, sent)
        finally:
            if sent.started:
                log.log(logging.INFO if sent.whole else logging.WARNING,
                        "console export" if sent.whole else "console export cut short",
                        extra={"user": session.user, "role": session.role,
                               "from": iso(start), "to": iso(end), "rows": sent.rows,
                               "why": sent.why, "peer": request.remote})
        return response

    @contextlib.asynccontextmanager
    async def _ledger(self, slots: asyncio.Semaphore | None = None
                      ) -> AsyncIterator[LedgerReader]:
        """A connection to the ledger for this request, taken from ``slots`` (default: the
        pages'); 503 when none is free within the ledger's timeout, or it does not answer."""
        slots = self._page_slots if slots is None else slots
        from relay.store.postgres.ledger_read import LedgerReader  # the postgres extra
        from relay.store.postgres.migrations import SchemaError

        url, timeout_s = self.settings.ledger, self.settings.ledger_timeout
        assert url is not None
        try:
            async with asyncio.timeout(timeout_s):
                await slots.acquire()
        except TimeoutError:
            raise ConsoleError(503, "The audit ledger is busy (other requests read it "
                                    "already): try again.") from None
        try:
            try:
                reader = await LedgerReader.open(url, timeout_s=timeout_s)
            except (StoreError, SchemaError) as exc:
                raise ConsoleError(503, f"The audit ledger did not answer: {exc}") from exc
            try:
                yield reader
            finally:
                await reader.close()
        finally:
            slots.release()


async def _ledger_call(call: Awaitable[Any]) -> Any:
    """``call``'s result; a :class:`StoreError` becomes a 503 page."""
    try:
        return await call
    except StoreError as exc:
        raise ConsoleError(503, f"The audit ledger failed: {exc}") from exc


def local_path(target: str) -> str:
    """``target`` when it is a path on this console (``/...``, not ``//host``), else
    ``/history``: a sign-in never sends the browser elsewhere (an open redirect)."""
    if target.startswith("/") and not target.startswith(("//", "/\\")) \
            and not any(ch.isspace() or ord(ch) < 32 for ch in target):
        return target
    return "/history"
