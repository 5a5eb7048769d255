"""The relay's listening sockets: bound for a setting (a port in use is a
:class:`StartupError` naming it), bound once by a supervisor for its workers
(:func:`bind_listeners`, :class:`Listeners`), and served by a worker (:class:`Inherited`);
the SMTP listeners of one relay process (:func:`serve_smtp`); the supervisor's metrics and
console sockets (:func:`bound_socket`)."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from dataclasses import dataclass
from typing import Any

from relay.core.errors import StartupError
from relay.settings import Settings, host_port, setting_names
from relay.smtp.handler import ListenerSecurity
from relay.smtp.implicit_tls import ImplicitTlsFactory, implicit_tls_factory


@dataclass(frozen=True)
class Inherited:
    """What a worker process (``workers`` > 1) gets from its supervisor: the listening sockets
    the supervisor bound (``listen``, and ``tls_listen`` when set; one socket per address the
    host resolved to, shared by every worker) and the worker's ``index`` (0 to N-1, worker 0
    starting first, alone); the metrics HTTP server is the supervisor's, on ``metrics_port``
    (0: off)."""

    listen: tuple[socket.socket, ...]
    tls_listen: tuple[socket.socket, ...]
    index: int
    metrics_port: int = 0


@dataclass
class Listeners:
    """The listening sockets :func:`bind_listeners` bound, not serving (asyncio servers with
    ``start_serving=False`` own them): their file descriptors for the workers to inherit;
    ``close()`` when done."""

    servers: list[asyncio.base_events.Server]
    listen: tuple[int, ...]
    tls_listen: tuple[int, ...]
    port: int  # the bound SMTP port (the one picked for ``listen`` port 0)

    def close(self) -> None:
        """Close the sockets."""
        for server in self.servers:
            server.close()


async def bind_listeners(settings: Settings) -> Listeners:
    """Bind ``listen`` (and ``tls_listen`` when TLS is configured) as a relay in one process
    would, without serving: the supervisor's sockets its workers inherit (they listen once the
    first worker serves them, so a port that accepts has a worker behind it). Raises
    :class:`StartupError` naming the setting (a port in use, an address not on this host)."""
    servers = [await bind(asyncio.Protocol, *settings.listen_address, "listen",
                          start_serving=False)]
    tls_address = settings.tls_listen_address
    if tls_address is not None:
        servers.append(await bind(asyncio.Protocol, *tls_address, "tls_listen",
                                  start_serving=False))
    fds = [tuple(sock.fileno() for sock in server.sockets) for server in servers]
    return Listeners(servers=servers, listen=fds[0], tls_listen=fds[1] if len(fds) > 1 else (),
                     port=int(servers[0].sockets[0].getsockname()[1]))


@dataclass(frozen=True)
class SmtpListeners:
    """The SMTP listeners one relay process serves: their ``servers``, the implicit-TLS
    ``tls_factory`` (None: no ``tls_listen``) and the ports bound (``tls_port`` 0: none)."""

    servers: list[asyncio.Server]
    tls_factory: ImplicitTlsFactory | None
    port: int
    tls_port: int = 0


async def serve_smtp(settings: Settings, inherited: Inherited | None,
                     security: ListenerSecurity, factory: Any, tls_factory: Any
                     ) -> SmtpListeners:
    """Serve ``factory`` on ``listen`` and, with TLS configured, ``tls_factory`` on
    ``tls_listen`` (plain TCP: clients are admitted before their handshake,
    :mod:`relay.smtp.implicit_tls`); bound here, or a worker's ``inherited`` sockets. Raises
    :class:`StartupError` naming the setting; then nothing is left listening."""
    smtp = ([await bind(factory, *settings.listen_address, "listen")] if inherited is None
            else await serve_on(factory, inherited.listen, "listen"))
    port = smtp[0].sockets[0].getsockname()[1]
    tls_address = settings.tls_listen_address
    if tls_address is None or security.tls_context is None:
        return SmtpListeners(smtp, None, port)
    wrapped = implicit_tls_factory(
        tls_factory, gate=security.gate, proxy_networks=security.proxy_networks,
        context=security.tls_context, handshake_timeout_s=settings.tls_handshake_timeout)
    try:
        tls = ([await bind(wrapped, *tls_address, "tls_listen")] if inherited is None
               else await serve_on(wrapped, inherited.tls_listen, "tls_listen"))
    except BaseException:
        for server in smtp:
            server.close()
        raise
    return SmtpListeners([*smtp, *tls], wrapped, port, tls[0].sockets[0].getsockname()[1])


async def bind(factory: Any, host: str, port: int, field: str, *, start_serving: bool = True
               ) -> asyncio.base_events.Server:
    """``loop.create_server`` on host:port; a port in use or an address not on this host is a
    :class:`StartupError` naming the setting ``field`` (flag and env var)."""
    try:
        return await asyncio.get_running_loop().create_server(
            factory, host=host, port=port, start_serving=start_serving)
    except OSError as exc:
        raise bind_error(host, port, field, exc) from exc


LISTEN_BACKLOG = 100
"""The accept queue of a worker's listening socket (asyncio's default for its servers)."""


async def serve_on(factory: Any, socks: tuple[socket.socket, ...], field: str
                   ) -> list[asyncio.base_events.Server]:
    """Serve ``factory`` on already bound sockets (a worker's): one server per socket (a host
    that resolved to several addresses). Each socket is made to listen first: a supervisor's
    socket is bound but not listening until a worker serves it, so another process that bound
    the port meanwhile (two relays started at once) may listen first, and the port in use must
    be a :class:`StartupError` naming the setting ``field`` (uvloop closes a server whose
    listen fails without a word, and the worker died on the closed socket)."""
    loop = asyncio.get_running_loop()
    servers = []
    for sock in socks:
        try:
            sock.listen(LISTEN_BACKLOG)
        except OSError as exc:
            host, port = sock.getsockname()[:2]
            raise bind_error(host, port, field, exc) from exc
        servers.append(await loop.create_server(factory, sock=sock))
    return servers


def bound_socket(host: str, port: int, field: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` (SO_REUSEADDR, not listening yet: its server
    listens on it later). Raises :class:`StartupError` naming the setting ``field``."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        raise bind_error(host, port, field, exc) from exc
    return sock


def bind_error(host: str, port: int, field: str, exc: OSError) -> StartupError:
    """The :class:`StartupError` of a failed bind of ``host:port`` for the setting ``field``:
    the address in use, a host that does not resolve, or the system's words."""
    if exc.errno == errno.EADDRINUSE:
        why = "the address is already in use (another process listens there)"
    elif isinstance(exc, socket.gaierror):
        why = f"cannot resolve the host ({exc.strerror or exc})"
    else:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
    return StartupError(f"cannot listen on {host_port(host, port)} for {field} "
                        f"({setting_names(field)}): {why}")
