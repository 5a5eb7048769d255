"""The implicit-TLS listener (RFC 8314 section 3): admission first, then a bounded handshake.

A client of the TLS port is checked like one of the plain port (allowed networks, connection
limits, :meth:`relay.smtp.access.ConnectionGate.enter`) as soon as TCP connects, so a refused
client gets no byte of TLS and costs no handshake. An admitted one is counted toward the
limits while it handshakes, which must end within ``handshake_timeout_s``; then its
:class:`relay.smtp.session.RelaySMTP` session starts over the TLS transport and owns the
count. A failed or timed-out handshake is one INFO line and a count
(:meth:`relay.smtp.session.RelaySMTP.tls_failed`), no traceback.

uvloop starts reading a connection right after its ``connection_made`` (the pause there does
not hold), so the ClientHello may reach this protocol before the handshake starts: it is kept
(reading paused) and handed to the TLS layer (:mod:`relay.smtp.tls_handover`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import cast

from relay.smtp.access import ConnectionGate, Network
from relay.smtp.session import RelaySMTP
from relay.smtp.tls_handover import server_handshake

log = logging.getLogger("relay.smtp.tls")


class ImplicitTlsAcceptor(asyncio.Protocol):
    """The protocol of one TCP connection to the implicit-TLS port until its handshake ends.

    ``make_session`` builds the SMTP session (built with ``implicit_tls=True``); ``gate`` and
    ``proxy_networks`` are the listener's; ``tasks`` holds the running handshakes (so that
    they are not garbage-collected mid-way).
    """

    def __init__(self, *, make_session: Callable[[], RelaySMTP], gate: ConnectionGate,
                 proxy_networks: tuple[Network, ...] | None, context: ssl.SSLContext,
                 handshake_timeout_s: float, tasks: set[asyncio.Task[None]]) -> None:
        self._make_session = make_session
        self._gate = gate
        self._proxy_networks = proxy_networks
        self._context = context
        self._handshake_timeout_s = handshake_timeout_s
        self._tasks = tasks
        self._early = bytearray()  # bytes read before the handshake started (uvloop)

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        """Refuse (close, nothing sent) or count the client, then start the handshake."""
        transport = cast(asyncio.Transport, base)  # uvloop's is no asyncio.Transport subclass
        transport.pause_reading()  # the ClientHello is for the TLS layer, not for us
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else ""
        refusal = self._gate.enter(host, self._proxy_networks)
        if refusal is not None:
            log.info("TLS client %s refused before the handshake: %s", host, refusal)
            transport.abort()
            return
        counted = None if self._proxy_networks is not None else host
        task = asyncio.get_running_loop().create_task(self._handshake(transport, host, counted))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        """Keep bytes read before the handshake started (uvloop reads despite the pause in
        :meth:`connection_made`), and read no more until the TLS layer takes over."""
        self._early += data
        self._transport.pause_reading()

    async def _handshake(self, transport: asyncio.Transport, host: str,
                         counted: str | None) -> None:
        """Run the handshake, then hand the connection and its count to a new session.

        Until the session has it, the count is this task's: every other ending (the client
        closed or reset before or during the handshake, a failed, hung or cancelled one, an
        error of the loop's TLS layer) passes through the ``finally`` and releases it there,
        once. A transport closed before the handshake starts (uvloop read the client's EOF
        or reset already) gets no ``start_tls``: uvloop's would wait forever on it."""
        handed_over = False
        try:
            if transport.is_closing():
                log.info("TLS client %s went before its handshake", host)
                return
            session = self._make_session()
            tls = await self._start_tls(transport, session, host)
            if tls is None or tls.is_closing():
                return
            session.admitted_before(counted)
            handed_over = True
            session.connection_made(tls)
        finally:
            if not handed_over:
                self._gate.release(counted)
                transport.abort()

    async def _start_tls(self, transport: asyncio.Transport, session: RelaySMTP,
                         host: str) -> asyncio.BaseTransport | None:
        """The TLS transport once the handshake ended, or None (an INFO line and a count said
        why) when it failed, or did not end within ``handshake_timeout_s``
        (:func:`relay.smtp.tls_handover.server_handshake`)."""
        try:
            return await server_handshake(transport, session, self._early,
                                          context=self._context,
                                          timeout_s=self._handshake_timeout_s)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError, ConnectionError included
            session.tls_failed("implicit", host, exc)
            return None


class ImplicitTlsFactory:
    """The protocol factory for ``loop.create_server`` (plain TCP, no ``ssl=``) of the
    implicit-TLS port; ``make_session`` is :func:`relay.smtp.handler.smtp_factory` with
    ``implicit_tls=True``. :meth:`cancel_handshakes` ends the handshakes still running (the
    relay is stopping: a client that finishes its handshake then must not get a new session)."""

    def __init__(self, make_session: Callable[[], RelaySMTP], *, gate: ConnectionGate,
                 proxy_networks: tuple[Network, ...] | None, context: ssl.SSLContext,
                 handshake_timeout_s: float) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._args = (make_session, gate, proxy_networks, context, handshake_timeout_s)

    def __call__(self) -> ImplicitTlsAcceptor:
        make_session, gate, proxy_networks, context, handshake_timeout_s = self._args
        return ImplicitTlsAcceptor(
            make_session=make_session, gate=gate, proxy_networks=proxy_networks,
            context=context, handshake_timeout_s=handshake_timeout_s, tasks=self._tasks)

    def cancel_handshakes(self) -> int:
        """Cancel every handshake still running (each closes its connection and releases its
        count); returns how many."""
        for task in self._tasks:
            task.cancel()
        return len(self._tasks)


def implicit_tls_factory(make_session: Callable[[], RelaySMTP], *, gate: ConnectionGate,
                         proxy_networks: tuple[Network, ...] | None, context: ssl.SSLContext,
                         handshake_timeout_s: float) -> ImplicitTlsFactory:
    """See :class:`ImplicitTlsFactory`."""
    return ImplicitTlsFactory(make_session, gate=gate, proxy_networks=proxy_networks,
                              context=context, handshake_timeout_s=handshake_timeout_s)
