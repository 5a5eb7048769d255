"""Idle smarthost connections kept for reuse (design.md §5.3: "a pool of reused connections,
RSET between transactions, reconnect on error").

A connection comes back after its transaction with ``clean`` saying whether every command got
its own reply (no error, no timeout, no 421, no reply a command cannot have) and ``ended``
saying whether its transaction is over (the final dot accepted, or MAIL refused). It is kept
idle when it is clean, still connected, holds no unread reply (a smarthost that answered twice
would shift every later reply by one) and has room. One that ended its transaction and idled
less than ``probe_after_s`` goes back into use as it is: its next MAIL's reply shows whether it
still lives, and the upstream adapter retries a MAIL that finds it dead on a new connection
(:meth:`relay.upstream.smtp.SmtpUpstream.deliver`). Any other must first answer RSET (RFC 5321
section 4.1.1.5) within ``probe_timeout_s``; the first that does not is closed with every other
idle one (they idled as long, through the same network), so one dead path costs one short
probe, not one per pooled connection. Idle connections past ``idle_s`` are closed by a timer,
not left open through a quiet night. QUITs go out in the background: a client's reply never
waits on a goodbye. :func:`default_pool_size` sizes the pool when the setting is unset.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiosmtplib

from relay.upstream.transfer import abort, is_wire, write_backlog

log = logging.getLogger("relay.upstream.smtp")

_QUIT_TIMEOUT_S = 5.0
MAX_DEFAULT_SIZE = 32  # idle connections per worker when upstream_pool_size is unset


def default_pool_size(max_connections: int, workers: int) -> int:
    """Idle connections one worker keeps when ``upstream_pool_size`` is unset: the client
    sessions it serves (``max_connections`` shared by ``workers`` processes, rounded up), each
    of which may be in a transaction at once; at least 1, at most :data:`MAX_DEFAULT_SIZE`."""
    return max(1, min(MAX_DEFAULT_SIZE, -(-max_connections // max(1, workers))))


@dataclass
class _Idle:
    smtp: aiosmtplib.SMTP
    since: float  # loop.time() when it went idle
    uses: int
    ended: bool  # its last transaction is over: MAIL may follow without RSET


def has_unread_reply(smtp: aiosmtplib.SMTP) -> bool:
    """True when bytes of a reply nobody asked for wait in the connection's read buffer.

    aiosmtplib (5.1.3) keeps what follows a parsed reply in ``SMTPProtocol._buffer`` and would
    hand it to the next command; tests/upstream/test_upstream_pool.py pins this behaviour.
    """
    protocol = smtp.protocol
    return protocol is not None and bool(getattr(protocol, "_buffer", b""))


class ConnectionPool:
    """Up to ``size`` idle connections, each reused at most ``max_messages`` times and kept at
    most ``idle_s`` seconds; reused without RSET within ``probe_after_s`` seconds of a
    transaction that ended. ``open_new`` connects, greets (and STARTTLS/AUTH) a new one."""

    def __init__(self, *, size: int, idle_s: float, max_messages: int, probe_timeout_s: float,
                 open_new: Callable[[], Awaitable[aiosmtplib.SMTP]],
                 probe_after_s: float = 1.0) -> None:
        self._size = size
        self._idle_s = idle_s
        self._max_messages = max_messages
        self._probe_timeout_s = probe_timeout_s
        self._probe_after_s = probe_after_s
        self._open_new = open_new
        self._idle: list[_Idle] = []  # most recently used last
        self._quitting: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.TimerHandle | None = None

    @property
    def idle_count(self) -> int:
        """How many connections wait idle now."""
        return len(self._idle)

    async def acquire(self) -> tuple[aiosmtplib.SMTP, int, bool]:
        """A connection ready for MAIL, how many transactions it ran before, and whether it is
        reused untested (no RSET: its MAIL may find it closed, and is then worth a retry).

        Raises what ``open_new`` raises (aiosmtplib errors, OSError, TimeoutError).
        """
        self._reap()
        while self._idle:
            idle = self._idle.pop()
            smtp = idle.smtp
            if (idle.ended and smtp.is_connected and not has_unread_reply(smtp)
                    and asyncio.get_running_loop().time() - idle.since < self._probe_after_s):
                return smtp, idle.uses, True
            if await self._probe(smtp):
                return smtp, idle.uses, False
            self.drop_idle()  # the same path dropped them too, most likely
        return await self._open_new(), 0, False

    def drop_idle(self) -> None:
        """Close every idle connection (one reused found dead: the others idled as long)."""
        for other in self._idle:
            other.smtp.close()
        self._idle.clear()

    def release(self, smtp: aiosmtplib.SMTP, uses: int, clean: bool, *,
                ended: bool = False) -> None:
        """Take ``smtp`` back after a transaction (``uses`` counts it; ``ended``: the
        transaction is over, see the module docstring): keep it idle, QUIT it in the
        background, or close it at once when its session state is unknown."""
        if not clean or not smtp.is_connected or has_unread_reply(smtp):
            discard(smtp)  # QUIT would be read against a reply still due: pointless
            return
        if uses >= self._max_messages or len(self._idle) >= self._size:
            self.retire(smtp)
            return
        loop = asyncio.get_running_loop()
        self._idle.append(_Idle(smtp, loop.time(), uses, ended))
        if self._reaper is None:
            self._reaper = loop.call_later(self._idle_s, self._reap)

    def retire(self, smtp: aiosmtplib.SMTP) -> None:
        """QUIT ``smtp`` in the background (tracked, so :meth:`close` can wait for it)."""
        task = asyncio.ensure_future(quit_politely(smtp))
        self._quitting.add(task)
        task.add_done_callback(self._quitting.discard)

    async def close(self) -> None:
        """QUIT every idle connection and wait (bounded) for the QUITs under way."""
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        idle, self._idle = self._idle, []
        for entry in idle:
            self.retire(entry.smtp)
        if self._quitting:
            await asyncio.wait(set(self._quitting), timeout=_QUIT_TIMEOUT_S + 1)

    async def _probe(self, smtp: aiosmtplib.SMTP) -> bool:
        """RSET on an idle connection: True when it answered 250 in time."""
        if not smtp.is_connected or has_unread_reply(smtp):
            smtp.close()
            return False
        try:
            reply = await smtp.rset(timeout=self._probe_timeout_s)
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            log.info("pooled upstream connection gone (%s): opening a new one",
                     type(exc).__name__)
            smtp.close()
            return False
        except BaseException:  # cancelled (shutdown cut): do not leak the socket
            smtp.close()
            raise
        if reply.code != 250:
            self.retire(smtp)
            return False
        return True

    def _reap(self) -> None:
        """Close (QUIT in the background) the idle connections older than ``idle_s``."""
        self._reaper = None
        if not self._idle:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        keep = [e for e in self._idle if now - e.since < self._idle_s]
        for entry in self._idle:
            if now - entry.since >= self._idle_s:
                self.retire(entry.smtp)
        self._idle = keep
        if keep:
            self._reaper = loop.call_later(self._idle_s - (now - keep[0].since), self._reap)


def discard(smtp: aiosmtplib.SMTP) -> None:
    """Drop a connection whose session state is unknown, at once; never raises.

    While bytes of a message are still buffered it is reset (:func:`relay.upstream.transfer.
    abort`), not closed: a graceful close would go on sending them, final dot included, after
    the relay decided the message did not go (design.md §1). So too when the transport is
    closing already (the peer's FIN: aiosmtplib's EOF closes it gracefully, and the buffer still
    drains to a peer that may still read).
    """
    transport = smtp.transport
    if is_wire(transport) and write_backlog(transport) > 0:
        abort(transport)
    smtp.close()


async def quit_politely(smtp: aiosmtplib.SMTP) -> None:
    """QUIT within a few seconds, else just close; never raises."""
    if not smtp.is_connected:
        return
    try:
        await smtp.quit(timeout=_QUIT_TIMEOUT_S)
    except (aiosmtplib.SMTPException, OSError, TimeoutError):
        smtp.close()
    except asyncio.CancelledError:
        smtp.close()
        raise
    with contextlib.suppress(Exception):
        smtp.close()
