"""The web console (design.md §6.9, docs/operating/console.md): server-rendered pages for
support, compliance and the on-call engineer, on ``console_listen``, one per relay (served by
the supervisor with several workers, else by the relay's process).

:class:`Console` assembles a small web app: the shared context
(:mod:`relay.console.context`), the guard every request passes and the sign-in
(:mod:`relay.console.signin`), the lookups (:mod:`relay.console.history`: ``/history``,
``/message/<queue id>``), the pages that read (:mod:`relay.console.pages`: ``/in-doubt``,
``/stats``), the operators' actions (:mod:`relay.console.actions`) and the CSV
export (:mod:`relay.console.export`), each module a ``web.RouteTableDef`` of its handlers;
and serves it. Responses are never cached, framed or sniffed, and load nothing from elsewhere
(Content-Security-Policy). Its connections are capped when TCP accepts them and idle ones
closed (:class:`relay.ops.http.CappedSite`), so a scanner cannot take the process's
descriptors; a full console closes anonymous connections that sent no request to let a new
one in, never one a signed-in request used
(:meth:`relay.ops.connection_cap.ConnectionCap.vouch`). A POST's body must be a urlencoded
form (:mod:`relay.console.forms`) of at most :data:`MAX_BODY` bytes. The ledger is read
through one connection per request, so a long export holds up no other page.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Set as AbstractSet

from aiohttp import web
from prometheus_client import CollectorRegistry

from relay.console import actions, export, history, pages, signin
from relay.console.context import CONTEXT, ConsoleContext
from relay.core.interfaces import FingerprintStore
from relay.ops.http import CappedSite
from relay.settings import Settings
from relay.smtp.tls import rotate_certificate
from relay.smtp.tls_handover import server_handshake

log = logging.getLogger("relay.console")

MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 30.0
HANDSHAKE_TIMEOUT_S = 10.0  # a TLS client's handshake at most (a connection that never starts)
MAX_PER_ADDRESS = 16  # connections from one client address (a browser opens 6 at most)
ANONYMOUS_GRACE_S = 2.0  # at the cap, a connection with no complete request by then may go
LIFETIME_S = 60.0  # a connection's life when no request is being answered on it (a trickle)
SHUTDOWN_S = 2.5  # requests still running at stop get this long, twice (aiohttp's two waits)
MAX_BODY = 64 * 1024  # a form's body at most (bytes)


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
        self._address = address
        self._sock = sock
        self._own_store = store is None
        self.context = ConsoleContext(
            settings, tls=settings.console_tls_context(settings.console_certificate),
            registry=registry)
        self.context.store = store
        self._site: CappedSite | None = None
        self.port = 0

    @property
    def settings(self) -> Settings:
        """The live settings (replaced on reload)."""
        return self.context.settings

    @property
    def tls(self) -> bool:
        """Whether the console serves HTTPS."""
        return self.context.tls is not None

    def app(self) -> web.Application:
        """The console's web app: the guard, then each module's routes."""
        app = web.Application(middlewares=[signin.guard], client_max_size=MAX_BODY)
        app[CONTEXT] = self.context
        for module in (signin, pages, history, actions, export):
            app.router.add_routes(module.routes)
        return app

    async def start(self) -> None:
        """Open the store (when not shared), bind (unless given a socket) and serve; ``port``
        is the bound port afterwards. Raises OSError when the address cannot be bound, the
        store's errors when it cannot be opened."""
        ctx = self.context
        if ctx.store is None:
            s = ctx.settings
            ctx.store = await s.open_store(window_s=s.dedup_window)
        handshake = None if ctx.tls is None else functools.partial(
            server_handshake, context=ctx.tls, timeout_s=HANDSHAKE_TIMEOUT_S)
        self._site = CappedSite(
            self.app(), host=self._address[0], port=self._address[1], sock=self._sock,
            handshake=handshake, shutdown_timeout_s=SHUTDOWN_S,
            max_connections=MAX_CONNECTIONS, idle_timeout_s=IDLE_TIMEOUT_S,
            max_per_address=MAX_PER_ADDRESS, lifetime_s=LIFETIME_S,
            evict_after_s=ANONYMOUS_GRACE_S)
        await self._site.start()
        ctx.cap = self._site.cap
        self.port = self._site.port

    async def stop(self) -> None:
        """Stop serving, end open requests (aiohttp's shutdown), close an own store."""
        if self._site is not None:
            await self._site.stop()
        if self._own_store and self.context.store is not None:
            await self.context.store.close()
            self.context.store = None

    async def reload(self, settings: Settings, applied: AbstractSet[str]) -> None:
        """Apply a reload: the certificate (its own, or the listener's) is read again from the
        next handshake, as the listener's is; with ``console_auth_file`` in ``applied`` the
        users file is read again: the next sign-in is checked against it, and the sessions of
        a user whose line went or changed (another password hash or role) end. Raises
        ConfigError when a file does not load; then nothing was changed."""
        ctx = self.context
        users = None
        if "console_auth_file" in applied:
            users = await asyncio.to_thread(settings.console_users)
        pair = settings.console_certificate
        if ctx.tls is not None and pair is not None:
            await asyncio.to_thread(rotate_certificate, ctx.tls, *pair)
        if users is not None:
            ctx.sign_ins.users.replace_with(users)
            ctx.sessions.keep_only(lambda s: users.stamp(s.user) == s.stamp)
            log.info("console users read again", extra={"users": len(users)})
        ctx.settings = settings  # the live ones: the dedup window of a mark-sent, ...

    def describe(self) -> str:
        """The console for a start-up line: ``console https://HOST:PORT/``."""
        return self.settings.describe_console(self.port, tls=self.tls)
