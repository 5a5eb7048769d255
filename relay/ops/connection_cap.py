"""The connections of an aiohttp server within bounds: :class:`ConnectionCap`.

A connection is counted when TCP accepts it, before anything is read: at most
``max_connections`` at once and ``max_per_address`` from one client address; one more is
closed at once, nothing read or sent. Over HTTPS the cap then hands the counted connection to
TLS (``handshake``: :func:`relay.smtp.tls_handover.server_handshake`), so a client that
connects and never starts its handshake holds one counted slot, for at most the handshake's
bound, and a flood of them is refused like any other.

Timers: a connection from which no byte came for ``idle_timeout_s`` is closed (a client that
connects and sends nothing, stalls mid-request, or keeps an idle keep-alive open), and one
that has lived ``lifetime_s`` (a client trickling a byte at a time), unless a request is
being answered on it (:meth:`ConnectionCap.busy`): then its answer closes it.

With ``evict_after_s``, a full cap makes room instead of refusing: a connection that has not
sent a complete request within ``evict_after_s`` of its accept goes first (the oldest), then
one idle that long between requests none of which was signed in (the least recently used).
A connection a request is being answered on, or one :meth:`ConnectionCap.vouch` marked
(a request on it carried a live session), is never closed to make room: so a signed-in
operator still gets in while anonymous clients hold every slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import cast

log = logging.getLogger("relay.ops.http")

Handshake = Callable[[asyncio.Transport, asyncio.Protocol, bytearray],
                     Awaitable[asyncio.BaseTransport]]
"""Starts TLS on a counted connection: (its TCP transport, the protocol the TLS transport is
for, the bytes read before) -> the TLS transport; raises OSError or TimeoutError."""


class _CappedConnection(asyncio.Protocol):
    """One connection under a :class:`ConnectionCap`: aiohttp's protocol (``inner``) behind
    the cap's counts, its two timers and, over HTTPS, the TLS handshake; every call is passed
    on to ``inner`` once it serves (see the module docstring)."""

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self._inner = inner
        self._cap = cap
        self._timer: asyncio.TimerHandle | None = None
        self._end: asyncio.TimerHandle | None = None
        self._tcp: asyncio.Transport | None = None
        self._transport: asyncio.Transport | None = None
        self._serving = False
        self._early = bytearray()  # TCP bytes read before TLS took over (uvloop)
        self._held = bytearray()  # bytes TLS decrypted before aiohttp's protocol started
        self.host = ""
        self.busy = 0
        self._expired = False
        self.accepted_at = 0.0  # loop time
        self.last_active = 0.0  # loop time a request was last answered on it
        self.requests = 0  # requests answered (or being answered) on it
        self.vouched = False  # a request on it carried a live session

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport subclass
        peer = tcp.get_extra_info("peername")
        self.host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        loop = asyncio.get_running_loop()
        self.accepted_at = self.last_active = loop.time()
        if not self._cap.admit(self):
            tcp.abort()
            return
        self._tcp = self._transport = tcp
        self._restart_timer()
        if self._cap.lifetime_s is not None:
            self._end = loop.call_later(self._cap.lifetime_s, self._idle)
        if self._cap.handshake is None:
            self._serve(tcp)
            return
        tcp.pause_reading()  # the ClientHello is for the TLS layer
        self._cap.track(loop.create_task(self._start_tls(tcp)))

    async def _start_tls(self, tcp: asyncio.Transport) -> None:
        """Run the handshake, then serve over TLS; a failed, hung or cancelled handshake, or
        a client gone before it started, closes the connection and gives its count back."""
        assert self._cap.handshake is not None
        served = False
        try:
            if tcp.is_closing():  # uvloop read its EOF or reset already: no start_tls on it
                return
            tls = await self._cap.handshake(tcp, self, self._early)
            if not tls.is_closing():
                self._serve(cast(asyncio.Transport, tls))
                served = True
        except (OSError, TimeoutError) as exc:  # ssl.SSLError, ConnectionError included
            log.info("TLS handshake failed with %s: %s", self.host, exc or type(exc).__name__)
        finally:
            if not served:
                self._drop()
                tcp.abort()

    def _serve(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._serving = True
        self._inner.connection_made(transport)
        if self._held:
            data = bytes(self._held)
            self._held.clear()
            self._inner.data_received(data)

    def _restart_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self._cap.idle_timeout_s,
                                                            self._idle)

    def _idle(self) -> None:
        if self.busy:
            self._expired = True  # closed once the response is done
        elif self._transport is not None:
            self._transport.abort()

    def _drop(self) -> None:
        """Give the count back and stop the timers (once; later calls do nothing)."""
        self._cap.forget(self)
        for timer in (self._timer, self._end):
            if timer is not None:
                timer.cancel()

    def evict(self) -> None:
        """Close the connection to make room for another (nothing more is sent)."""
        self._drop()
        if self._transport is not None:
            self._transport.abort()

    @property
    def expired(self) -> bool:
        """Whether a timer ran out while a request was answered (its response should close
        the connection once it is sent: ``Connection: close``)."""
        return self._expired

    def released(self) -> None:
        """A request was answered: the idle timer counts again (a connection whose timer ran
        out meanwhile was told to close after its response; if it is still open when the idle
        time passes again, it is aborted then)."""
        if self.busy == 0:
            self.last_active = asyncio.get_running_loop().time()
            self._restart_timer()

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._transport

    def data_received(self, data: bytes) -> None:
        self._restart_timer()
        if self._serving:
            self._inner.data_received(data)
        elif self._tcp is not None and self._tcp.get_protocol() is self:
            self._early += data  # read before start_tls took the connection (uvloop)
            self._tcp.pause_reading()
        else:
            self._held += data  # decrypted before the handshake's caller served it

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._serving else None

    def pause_writing(self) -> None:
        if self._serving:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._serving:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop()
        if self._serving:
            self._serving = False
            self._inner.connection_lost(exc)


class ConnectionCap:
    """A protocol factory for ``loop.create_server`` (plain TCP) serving ``factory``'s
    protocols (aiohttp's request handler) with at most ``max_connections`` open at once, at
    most ``max_per_address`` from one client address (None: no such limit), each closed after
    ``idle_timeout_s`` seconds with no byte received and, when ``lifetime_s`` is given, after
    that many seconds in all. ``handshake``: serve HTTPS, TLS started on each connection once
    it is counted. ``evict_after_s``: make room at the cap (see the module docstring)."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], *, max_connections: int,
                 idle_timeout_s: float, max_per_address: int | None = None,
                 lifetime_s: float | None = None, handshake: Handshake | None = None,
                 evict_after_s: float | None = None) -> None:
        self._factory = factory
        self._max = max_connections
        self._max_per_address = max_per_address
        self.idle_timeout_s = idle_timeout_s
        self.lifetime_s = lifetime_s
        self.handshake = handshake
        self._evict_after_s = evict_after_s
        self._open: set[_CappedConnection] = set()
        self._per_address: dict[str, int] = {}
        self._handshakes: set[asyncio.Task[None]] = set()

    def __call__(self) -> asyncio.Protocol:
        return _CappedConnection(self._factory(), self)

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, connection: _CappedConnection) -> bool:
        """Count ``connection`` in, making room when allowed; False when it is over a limit
        and no connection may be closed for it."""
        while len(self._open) >= self._max:
            if not self._make_room(None):
                return False
        while self._max_per_address is not None and \
                self._per_address.get(connection.host, 0) >= self._max_per_address:
            if not self._make_room(connection.host):
                return False
        self._open.add(connection)
        self._per_address[connection.host] = self._per_address.get(connection.host, 0) + 1
        return True

    def _make_room(self, host: str | None) -> bool:
        """Close the connection (of ``host``, or any) that goes first; False when none may."""
        if self._evict_after_s is None:
            return False
        horizon = asyncio.get_running_loop().time() - self._evict_after_s
        mine = [c for c in self._open if (host is None or c.host == host)
                and not c.busy and not c.vouched]
        silent = [c for c in mine if c.requests == 0 and c.accepted_at <= horizon]
        idle = [c for c in mine if c.requests > 0 and c.last_active <= horizon]
        if silent:
            min(silent, key=lambda c: c.accepted_at).evict()
        elif idle:
            min(idle, key=lambda c: c.last_active).evict()
        else:
            return False
        return True

    def forget(self, connection: _CappedConnection) -> bool:
        """Count ``connection`` out; False when it was not counted in."""
        if connection not in self._open:
            return False
        self._open.discard(connection)
        left = self._per_address.get(connection.host, 1) - 1
        if left > 0:
            self._per_address[connection.host] = left
        else:
            self._per_address.pop(connection.host, None)
        return True

    def track(self, handshake: asyncio.Task[None]) -> None:
        """Keep a running handshake (so that it is not garbage-collected mid-way)."""
        self._handshakes.add(handshake)
        handshake.add_done_callback(self._handshakes.discard)

    def cancel_handshakes(self) -> None:
        """End every handshake still running (the server stops): each closes its
        connection and gives its count back."""
        for task in self._handshakes:
            task.cancel()

    def _connection_of(self, transport: asyncio.BaseTransport | None
                       ) -> _CappedConnection | None:
        return next((c for c in self._open if c.transport is transport), None)

    def vouch(self, transport: asyncio.BaseTransport | None) -> None:
        """A request on the connection of ``transport`` carried a live session: it is never
        closed to make room."""
        connection = self._connection_of(transport)
        if connection is not None:
            connection.vouched = True

    @contextlib.contextmanager
    def busy(self, transport: asyncio.BaseTransport | None
             ) -> Iterator[Callable[[], bool]]:
        """While the block runs (a request being answered, a response streamed for longer
        than a timer), the connection of ``transport`` is not closed for being idle or old,
        nor to make room. Yields a function that says whether a timer ran out meanwhile: the
        block's response should then close the connection when sent (aiohttp's
        ``force_close()``), instead of the connection being cut under it."""
        connection = self._connection_of(transport)
        if connection is None:
            yield lambda: False
            return
        connection.busy += 1
        connection.requests += 1
        try:
            yield lambda: connection.expired
        finally:
            connection.busy -= 1
            connection.released()
