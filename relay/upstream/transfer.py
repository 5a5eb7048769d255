"""The message transfer into the upstream connection, so that what the relay believes about the
final dot is what happened on the wire (docs/design.md §5.3).

The payload (dot-stuffed content and the final dot, RFC 5321 section 4.5.2) goes to the
transport in chunks of :data:`CHUNK_BYTES`, at most :data:`AHEAD_BYTES` ahead of what the kernel
took. A transfer is *sent* once every byte, the final dot's included, left the process; it
*stalls* when nothing moved for ``stall_timeout_s`` (RFC 5321 section 4.5.3.2.5: the timeout runs
per send, not for the whole message): the kernel took no byte from the process and sent none
of those it holds (:func:`kernel_unsent`; where it cannot tell, only the first counts). The
kernel takes bytes in bursts (a full send buffer is writable again only once about a third of
it is free, seconds apart on a slow link) while the link moves all along, so what it sends is
what shows the link moving. One given up while bytes are still buffered is reset with
:func:`abort`, so the final dot can never follow. A *gate* (the SENDING mark) holds the final dot
(the payload's last :data:`DOT` bytes) back until it resolves True; it is started (``start_gate``)
once at most :data:`MARK_AHEAD_BYTES` of the body are left that the kernel has not taken (at
once for a message that small), so a relay that dies mid-transfer leaves a reservation, never a
SENDING record for a message whose dot did not leave: the window in which a crash makes "in
doubt" is the mark's round trip plus that last stretch, whatever the message's size. The body
goes out meanwhile, and a gate that resolves False (or fails) ends the transfer *withheld*, the
dot never written. :func:`write_backlog` counts the encrypted
bytes under the TLS transport too, on asyncio's loop (``_ssl_protocol._transport``, CPython
3.11+) and on uvloop's (the TCP transport its ``uvloop.sslproto`` holds, uvloop 0.23; both
pinned by tests/upstream/test_upstream_wire.py). Transports are duck-typed
(:class:`WireTransport`): uvloop's are not :class:`asyncio.WriteTransport` subclasses.

*Sent* means the kernel took the dot, not that it left the host: a peer that reads slowly
keeps the last of the message in the kernel's send queue. A wait for the final reply that ends
without one therefore calls :func:`withdraw`: while the kernel still holds unsent bytes
(:func:`kernel_unsent`), the connection is reset and the dot can never arrive. "Without one" is
judged by the wire too (:func:`await_reply`): a reply in the kernel's receive queue at the
deadline is read, not taken for none.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import gc
import socket
import struct
from collections.abc import Callable
from typing import Any, Protocol, TypeGuard, TypeVar

from relay.core.cancellation import stop_if_asked

CHUNK_BYTES = 256 * 1024
AHEAD_BYTES = 1024 * 1024  # bytes handed to asyncio and not yet taken by the kernel, at most
MARK_AHEAD_BYTES = 64 * 1024  # body bytes not yet in the kernel when the SENDING mark starts
POLL_S = 0.005
DOT = b".\r\n"  # the end of the payload: the final dot, RFC 5321 section 4.5.2
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST
SIOCOUTQNSD = 0x894B  # Linux ioctl: a TCP socket's queued bytes not yet sent (linux/sockios.h)
SIOCINQ = 0x541B  # Linux ioctl (FIONREAD): a TCP socket's received bytes not yet read
T = TypeVar("T")


class Outcome(enum.Enum):
    """How a transfer ended."""

    SENT = "sent"  # every byte, the final dot included, left the process
    ANSWERED = "answered"  # the upstream replied before it had the whole message
    STALLED = "stalled"  # nothing moved (left the process or the kernel) for stall_timeout_s
    WITHHELD = "withheld"  # the gate said no: the final dot was never written
    LOST = "lost"  # the connection closed or failed


class WireTransport(Protocol):
    """What the relay uses of a stream transport, on asyncio's loop and on uvloop's."""

    def write(self, data: bytes) -> None: ...
    def get_write_buffer_size(self) -> int: ...
    def is_closing(self) -> bool: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...
    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


_WIRE_METHODS = ("write", "get_write_buffer_size", "is_closing", "abort", "close",
                 "get_extra_info")


def is_wire(transport: object) -> TypeGuard[WireTransport]:
    """Whether ``transport`` has every method of :class:`WireTransport` (asyncio's and
    uvloop's stream transports, plain and TLS, do)."""
    return transport is not None and all(
        callable(getattr(transport, name, None)) for name in _WIRE_METHODS)


def write_backlog(transport: object) -> int:
    """Bytes written to ``transport`` that the kernel has not taken yet (through TLS too:
    the plaintext and encrypted bytes the TLS layer holds plus the TCP transport's)."""
    size = _buffered(transport)
    inner = _tcp_under_tls(transport)
    if inner is not None and inner is not transport:
        size += _buffered(inner)
    return size


def _tcp_under_tls(transport: object) -> object | None:
    """The TCP transport under a TLS one, None for a plain transport. asyncio's keeps it in
    ``_ssl_protocol._transport``; uvloop's SSLProtocol (``get_extra_info('uvloop.sslproto')``)
    is a Cython class with no Python attributes: its TCP transport is the object it refers to
    whose protocol it is."""
    inner: object = getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)
    if inner is not None:
        return inner
    get_extra_info = getattr(transport, "get_extra_info", None)
    proto = get_extra_info("uvloop.sslproto") if get_extra_info is not None else None
    if proto is None:
        return None
    for ref in gc.get_referents(proto):
        if ref is not transport and getattr(ref, "get_protocol", None) is not None \
                and is_wire(ref) and ref.get_protocol() is proto:  # type: ignore[attr-defined]
            return ref
    return None


def _buffered(transport: object) -> int:
    size = getattr(transport, "get_write_buffer_size", None)
    return int(size()) if size is not None else 0


def kernel_unsent(transport: WireTransport) -> int | None:
    """Bytes the kernel holds for ``transport``'s socket and has not sent yet (Linux
    ``SIOCOUTQNSD``: through TLS, encrypted bytes); None when it cannot tell (another
    system, the socket closed). Never raises."""
    return _socket_queue(transport, SIOCOUTQNSD)


def kernel_unread(transport: WireTransport) -> int | None:
    """Bytes the kernel received for ``transport``'s socket that the process has not read
    yet (Linux ``SIOCINQ``: through TLS, encrypted bytes); None when it cannot tell. Never
    raises."""
    return _socket_queue(transport, SIOCINQ)


def _socket_queue(transport: WireTransport, request: int) -> int | None:
    """The byte count the ioctl ``request`` reads from ``transport``'s socket; None when
    there is no open socket or the system has no such request."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    try:
        fd = sock.fileno()
        if fd < 0:
            return None
        raw = fcntl.ioctl(fd, request, b"\0" * 4)
    except (OSError, ValueError):
        return None
    return int(struct.unpack("i", raw)[0])


async def await_reply(reader: asyncio.Future[T], transport: WireTransport, timeout_s: float,
                      more_s: float) -> T:
    """``reader``'s result (its exception raised), awaited ``timeout_s`` seconds. A reply
    that reached the host within them is read even when the loop has not read it yet (the
    kernel's receive queue holds bytes, :func:`kernel_unread`: the process was held up past
    the deadline, or uvloop ran the timeout before polling the socket), for at most ``more_s``
    seconds more: judged by the wire, not by the relay's own timer. Raises TimeoutError when
    no reply came; cancelled, or timed out, ``reader`` is cancelled."""
    try:
        await asyncio.wait((reader,), timeout=timeout_s)
        if not reader.done() and kernel_unread(transport):
            await asyncio.wait((reader,), timeout=more_s)
    finally:
        answered = reader.done()
        if not answered:
            reader.cancel()
    if not answered:
        raise TimeoutError
    return reader.result()


async def withdraw(transport: WireTransport) -> int:
    """Reset the connection (:func:`abort`) when bytes written to it have not all been sent
    yet, in asyncio's buffer or the kernel's: the payload's last bytes, the final dot, can
    then never reach the peer. Returns how many were unsent as the socket closed (0: nothing
    was done, or the kernel sent the rest before the reset: the dot may have left). Never
    raises.

    The loop closes an aborted socket at its next turn, not at ``abort()``; the kernel goes on
    sending meanwhile, and a peer that reads again in that gap (a stall ending, a loaded loop's
    long turn) gets the whole message and the dot before the reset. So when only the kernel
    holds unsent bytes (asyncio's buffer is dropped at once), its queue is read again in a
    callback queued just before the close's, and that count is the answer. The read and the
    close are still two system calls: a window the peer opens in the microseconds between
    them could still let the last bytes out (docs/design.md §7)."""
    buffered = write_backlog(transport)
    unsent = buffered + (kernel_unsent(transport) or 0)
    if unsent == 0:
        return 0
    if buffered > 0:  # the dot is in the process's buffer, which abort() drops at once
        abort(transport)
        return unsent
    at_close: list[int | None] = []
    asyncio.get_running_loop().call_soon(lambda: at_close.append(kernel_unsent(transport)))
    abort(transport)  # queues the close right behind that look
    for _ in range(CLOSE_TURNS):
        if at_close:
            break
        await asyncio.sleep(0)
    return (at_close[0] or 0) if at_close else 0


CLOSE_TURNS = 100
"""Loop turns :func:`withdraw` waits for its last look at the kernel's queue (it runs at the
next turn); none by then: it cannot tell, so the dot may have left."""


def abort(transport: WireTransport) -> None:
    """Reset the connection (SO_LINGER 0, then ``abort()``): asyncio drops what it buffered
    and the kernel what it had not sent, so none of it can reach the peer. Never raises."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    transport.abort()


class _Progress:
    """What a transfer has seen move: the bytes the kernel took from the process, and the
    bytes its send queue still held unsent (:func:`kernel_unsent`)."""

    def __init__(self) -> None:
        self._taken = -1
        self._unsent: int | None = None

    def moved(self, taken: int, unsent: int | None) -> bool:
        """Record this look (``taken``: payload bytes out of the process; ``unsent``: the
        kernel's unsent bytes, None when it cannot tell); whether anything moved since the
        last: the kernel took bytes, or sent some of those it held (see the module doc)."""
        took = taken > self._taken
        sent = unsent is not None and self._unsent is not None and unsent < self._unsent
        self._taken, self._unsent = max(taken, self._taken), unsent
        return took or sent


class Transfer:
    """One payload written into ``transport`` with progress tracking; see the module doc."""

    def __init__(self, transport: WireTransport, payload: bytes, *,
                 stall_timeout_s: float, on_dot: Callable[[], None] | None = None) -> None:
        """``on_dot`` is called once, as the final dot is handed to the transport (before
        the transport or the kernel may have taken it: from then on the dot can leave)."""
        self._transport = transport
        self._payload = payload
        self._offset = 0
        self._stall_timeout_s = stall_timeout_s
        self._on_dot = on_dot

    @property
    def complete(self) -> bool:
        """Whether the whole payload, final dot included, is out of the process's hands (or
        was dropped by a transport that closed: either way the dot may be on the wire)."""
        return self._offset == len(self._payload) and write_backlog(self._transport) == 0

    async def run(self, reply: asyncio.Future[Any],
                  start_gate: Callable[[], asyncio.Future[bool]] | None = None) -> Outcome:
        """Write the payload until it is sent, answered early (``reply`` resolved), stalled,
        lost or withheld (the gate ``start_gate()`` returns, started once at most
        :data:`MARK_AHEAD_BYTES` of the body are not yet in the kernel, resolved to anything
        but True; the payload must end with :data:`DOT`). Bytes still buffered on any outcome
        but SENT are the caller's to :func:`abort`. While only the gate is awaited (the body
        all taken by the kernel) the stall clock does not run: the wait is the store's,
        bounded by its own timeout. Raises ``asyncio.CancelledError`` when the task is asked
        to stop, also when a read's ``wait_for`` swallowed the request (:func:`stop_if_asked`):
        no byte is handed over after it."""
        loop = asyncio.get_running_loop()
        progress, progress_at = _Progress(), loop.time()
        body = len(self._payload) - len(DOT)
        gate: asyncio.Future[bool] | None = None
        held = start_gate is not None  # the final dot waits for the gate
        while True:
            stop_if_asked()  # a cut swallowed by a read's wait_for must not send the dot
            gate = self._gate_due(start_gate, gate, body)
            if gate is not None and held and gate.done():
                if gate.cancelled() or gate.exception() is not None or gate.result() is not True:
                    return Outcome.WITHHELD
                held = False
            self._fill(body if held else len(self._payload))
            if self.complete:
                return Outcome.SENT
            if reply.done() and not reply.cancelled() and reply.exception() is None:
                return Outcome.ANSWERED
            if self._transport.is_closing() or reply.done():
                return Outcome.LOST
            backlog = write_backlog(self._transport)
            moved = progress.moved(self._offset - backlog, kernel_unsent(self._transport))
            if moved or (held and backlog == 0):
                progress_at = loop.time()
            elif loop.time() - progress_at > self._stall_timeout_s:
                return Outcome.STALLED
            if held and gate is not None and backlog == 0:  # wake when the gate or a reply does
                await asyncio.wait((gate, reply), timeout=POLL_S * 20,
                                   return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(POLL_S)

    def _gate_due(self, start_gate: Callable[[], asyncio.Future[bool]] | None,
                  gate: asyncio.Future[bool] | None, body: int) -> asyncio.Future[bool] | None:
        """``gate`` once started; else the gate, started now when at most
        :data:`MARK_AHEAD_BYTES` of the ``body`` bytes are left that the kernel has not taken;
        None while it is not due (or there is none)."""
        if gate is not None or start_gate is None:
            return gate
        if body - (self._offset - write_backlog(self._transport)) > MARK_AHEAD_BYTES:
            return None
        return start_gate()

    def _fill(self, end: int) -> None:
        """Hand the transport the next chunks, up to offset ``end``, while it holds less than
        AHEAD_BYTES."""
        while (self._offset < end and not self._transport.is_closing()
               and write_backlog(self._transport) < AHEAD_BYTES):
            stop = min(self._offset + CHUNK_BYTES, end)
            self._transport.write(self._payload[self._offset:stop])
            self._offset = stop
        if self._offset == len(self._payload) and self._on_dot is not None:
            on_dot, self._on_dot = self._on_dot, None
            on_dot()
