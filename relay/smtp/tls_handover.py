"""A server-side TLS handshake on a TCP connection that was already accepted and counted.

The implicit-TLS listener (:mod:`relay.smtp.implicit_tls`) and the console's HTTPS (through
:class:`relay.ops.connection_cap.ConnectionCap`) accept plain TCP, count the client against
their limits, and only then start TLS with :func:`server_handshake`: a client over a limit
costs no handshake, and one that never starts its handshake holds its slot, counted, for at
most ``timeout_s``.

uvloop starts reading a connection right after its ``connection_made`` (a pause there does
not hold), so the ClientHello may reach the accepting protocol before the handshake starts:
that protocol keeps those bytes (``early``, reading paused) and :func:`server_handshake`
hands them to the TLS layer once ``start_tls`` has set it up, before the loop reads anything
else.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any


async def server_handshake(transport: asyncio.Transport, protocol: asyncio.BaseProtocol,
                           early: bytearray, *, context: ssl.SSLContext,
                           timeout_s: float) -> asyncio.BaseTransport:
    """Run the server side of a TLS handshake on ``transport`` (RFC 8446 / 5246) with
    ``context``, ``early`` being the bytes the accepting protocol read before it; the TLS
    transport, whose protocol is ``protocol``, once it ended (``protocol.connection_made`` is
    not called: the caller does that).

    Raises OSError (``ssl.SSLError``, ``ConnectionError``: the handshake failed, or the
    client went) or TimeoutError (it did not end within ``timeout_s`` seconds: bounded here
    too, since the loop's own bound does not run on a connection its TLS layer never
    started on)."""
    loop = asyncio.get_running_loop()
    starting = asyncio.ensure_future(loop.start_tls(
        transport, protocol, context, server_side=True, ssl_handshake_timeout=timeout_s))
    try:
        await _replay(transport, starting, early)
        tls = await asyncio.wait_for(starting, timeout_s)
    finally:
        starting.cancel()
    if tls is None:  # typeshed allows it; neither loop returns None from a finished handshake
        raise ConnectionError("the connection closed during the TLS handshake")
    return tls


async def _replay(transport: asyncio.Transport, starting: asyncio.Future[Any],
                  early: bytearray) -> None:
    """Hand ``early`` (bytes read before the TLS protocol took over; none on asyncio's loop)
    to the TLS protocol ``start_tls`` sets on ``transport``. ``start_tls`` pauses reading,
    switches the protocol and schedules its ``connection_made`` and ``resume_reading`` in its
    first step (asyncio's and uvloop's alike): two yields later both ran, in the same loop
    pass, so no other read came in between."""
    await asyncio.sleep(0)  # start_tls's first step runs: nothing reaches us any more
    await asyncio.sleep(0)  # its connection_made and resume_reading run
    if starting.done() or not early:
        return
    data = bytes(early)
    early.clear()
    protocol: Any = transport.get_protocol()  # uvloop's SSLProtocol: no asyncio class
    if not hasattr(protocol, "get_buffer"):
        protocol.data_received(data)
        return
    view = memoryview(data)
    while view:
        buffer = memoryview(protocol.get_buffer(len(view)))
        size = min(len(buffer), len(view))
        buffer[:size] = view[:size]
        protocol.buffer_updated(size)
        view = view[size:]
