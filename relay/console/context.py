"""What every handler of the console shares: :class:`ConsoleContext` (the live settings, the
store, the ledger's connections, the sessions and sign-ins, the metrics, the pages' templates),
found on a request as ``request.app[CONTEXT]``, and the signed-in session as
``request[SESSION]``.

A handler is a function of a request in a module with its own ``web.RouteTableDef``
(:mod:`relay.console.pages`, :mod:`~relay.console.actions`, :mod:`~relay.console.signin`,
:mod:`~relay.console.export`): a new page is a new handler there, and it reaches the store
and the ledger through the context (:meth:`ConsoleContext.ledger` bounds the ledger's
connections and turns its failures into a ``503`` page).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jinja2
from aiohttp import web
from prometheus_client import CollectorRegistry

from relay.admin import count_states
from relay.console.errors import ConsoleError
from relay.console.sessions import Session, Sessions, SignIns
from relay.console.times import when
from relay.core.errors import StoreError
from relay.core.interfaces import FingerprintStore, StateCounts
from relay.ops.connection_cap import ConnectionCap
from relay.ops.metrics import ConsoleMetrics
from relay.settings import Settings

if TYPE_CHECKING:  # the postgres extra: imported once a ledger is configured
    from relay.store.postgres.ledger_read import LedgerReader

MAX_LEDGER_CONNECTIONS = 8  # page requests reading the ledger at once (one connection each)
MAX_EXPORTS = 4  # exports at once (each a connection and a read-only transaction)
STATS_TTL_S = 30.0  # a stats page's counts are reused this long (a full count of the store)
STATS_MAX_KEYS = 1_000_000  # Redis: keys one count scans at most (as `dedup-relay stats`)
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; style-src 'self'; img-src 'self'; "
                                "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
"""The headers of every answer: nothing loaded from elsewhere, no framing, no caching."""


@dataclass
class _KeyLock:
    """The lock of one key's actions and how many requests hold or wait for it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


@dataclass
class _Counted:
    counts: StateCounts
    at: float


class ConsoleContext:
    """The console's shared state. ``settings``: the live ones (replaced on reload);
    ``store`` and ``cap`` (its connections): set once the console started; ``tls``: the
    HTTPS context, None for plain HTTP. Raises ConfigError when the users file does not
    load."""

    def __init__(self, settings: Settings, *, tls: ssl.SSLContext | None,
                 registry: CollectorRegistry | None) -> None:
        self.settings = settings
        self.tls = tls
        self.store: FingerprintStore | None = None
        self.cap: ConnectionCap | None = None  # the connections' cap, once serving
        self.metrics = ConsoleMetrics(registry=registry)
        self.sessions = Sessions(idle_s=settings.console_session_timeout)
        self.sign_ins = SignIns(settings.auth_attempts(settings.console_users()))
        self.templates = jinja2.Environment(
            loader=jinja2.PackageLoader("relay.console", "templates"),
            autoescape=True, undefined=jinja2.StrictUndefined)
        self.templates.filters["when"] = when
        assert self.templates.loader is not None
        self.style = self.templates.loader.get_source(self.templates, "console.css")[0]
        # ledger connections: the pages' and the exports' apart, so that long downloads never
        # keep an operator from the in-doubt page
        self.page_slots = asyncio.Semaphore(MAX_LEDGER_CONNECTIONS)
        self.export_slots = asyncio.Semaphore(MAX_EXPORTS)
        self._counted: _Counted | None = None
        self._acting: dict[str, _KeyLock] = {}

    def page(self, name: str, request: web.Request, *, status: int = 200,
             **values: Any) -> web.Response:
        """The template ``name`` rendered for ``request`` (its session, path and whether a
        ledger is configured, with ``values``) as an HTML answer."""
        body = self.templates.get_template(name).render(
            session=request.get(SESSION), path=request.path,
            ledger=self.settings.ledger is not None, **values)
        return web.Response(text=body, status=status, content_type="text/html",
                            charset="utf-8")

    def headers(self, response: web.StreamResponse) -> web.StreamResponse:
        """``response`` with :data:`SECURITY_HEADERS` (and HSTS over HTTPS), unless sent."""
        if not response.prepared:
            response.headers.update(SECURITY_HEADERS)
            if self.tls is not None:
                response.headers["Strict-Transport-Security"] = "max-age=31536000"
        return response

    def cookie(self, response: web.StreamResponse, name: str, value: str, *,
               max_age: int | None) -> None:
        """Set a cookie the page's scripts cannot read, sent back to this site only (and
        over HTTPS only, when served so)."""
        response.set_cookie(name, value, httponly=True, secure=self.tls is not None,
                            samesite="Strict", path="/", max_age=max_age)

    def the_store(self) -> FingerprintStore:
        """The store (the console has started)."""
        assert self.store is not None
        return self.store

    async def counts(self) -> StateCounts:
        """The store's records by state, counted at most every :data:`STATS_TTL_S` (a full
        count reads every record: a page left refreshing must not load the store)."""
        now = time.monotonic()
        if self._counted is not None and now - self._counted.at < STATS_TTL_S:
            return self._counted.counts
        try:
            counts = await count_states(self.the_store(), self.settings, older_than_h=24,
                                        max_keys=STATS_MAX_KEYS)
        except (StoreError, TypeError) as exc:
            raise ConsoleError(503, f"The store could not be counted: {exc}") from exc
        self._counted = _Counted(counts, now)
        return counts

    @contextlib.asynccontextmanager
    async def one_at_a_time(self, key: str) -> AsyncIterator[None]:
        """Hold the turn of ``key`` (an operator's actions on one store key, one at a time
        in this console)."""
        held = self._acting.setdefault(key, _KeyLock())
        held.users += 1
        try:
            async with held.lock:
                yield
        finally:
            held.users -= 1
            if held.users == 0:
                del self._acting[key]

    @contextlib.asynccontextmanager
    async def ledger(self, slots: asyncio.Semaphore | None = None
                     ) -> AsyncIterator[LedgerReader]:
        """A connection to the ledger for this request, taken from ``slots`` (default: the
        pages'); 503 when none is free within the ledger's timeout, or it does not answer."""
        slots = self.page_slots if slots is None else slots
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


async def ledger_call(call: Awaitable[Any]) -> Any:
    """``call``'s result; a :class:`StoreError` becomes a 503 page."""
    try:
        return await call
    except StoreError as exc:
        raise ConsoleError(503, f"The audit ledger failed: {exc}") from exc


CONTEXT = web.AppKey("console", ConsoleContext)
"""Where an application's :class:`ConsoleContext` is: ``request.app[CONTEXT]``."""
SESSION = web.RequestKey("session", Session)
"""The request's signed-in session: ``request[SESSION]`` (set by the sign-in guard)."""
