"""Reading what the client sends, with its limits held while it arrives: command lines
(:class:`CommandLineGuard`) and the DATA block (:func:`read_message`, RFC 5321 section 4.1.1.4).

aiosmtpd's own DATA loop keeps every piece of a line that has no CRLF yet, even after it knows
the line is too long: 400 MB without a line end grew the process by 400 MB. Here a line past the
limit, or a message past the size limit, is counted and thrown away as it arrives; only a
message within both limits is kept. The reply comes after the final dot (RFC 5321 section
4.2.5: the client sends the whole block before reading it); a client that never sends the dot
is ended by the session's DATA deadline, not by memory.

With ``bare_newline = "normalize"`` (:data:`NORMALIZE`) a content line may end in a bare LF,
kept as CRLF, while only ``<CRLF>.<CRLF>`` ends the block (as Postfix's
``smtpd_forbid_bare_newline = normalize``): a line ``.`` that does not end in CRLF right after
a CRLF (``<LF>.<LF>``, ``<LF>.<CRLF>``, ``<CRLF>.<LF>``) is no end and is dropped, never kept
as content. A lone CR stays in the content for the handler's check (``550 5.6.0``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from relay.core import replies
from relay.core.interfaces import SmtpReply

MAX_LINE = 998  # octets before CRLF, after dot-unstuffing (RFC 5321 section 4.5.3.1.6)
AUTH_LINE_MAX = 12288  # octets of an AUTH exchange line, CRLF included (RFC 4954 section 4)
NORMALIZE = "normalize"  # bare_newline: a bare LF ends a content line, kept as CRLF
REJECT = "reject"  # bare_newline: a bare LF stays in the content, which the handler refuses
BARE_NEWLINE_MODES = (NORMALIZE, REJECT)
_END = b".\r\n"


def has_bare_cr_or_lf(content: bytes) -> bool:
    """True when ``content`` holds a CR not followed by LF or an LF not preceded by CR (RFC
    5321 section 2.3.8). Every CRLF holds one CR and one LF, so there is one exactly when the
    CRs or the LFs outnumber the CRLFs: three counts in C, no regex over the body."""
    crlf = content.count(b"\r\n")
    return content.count(b"\r") != crlf or content.count(b"\n") != crlf


class ClientGone(Exception):  # an event, not a failure of ours
    """The client's stream ended (EOF) before the final dot."""


async def read_message(reader: asyncio.StreamReader, *, max_size: int | None,
                       bare_newline: str = REJECT) -> bytes | SmtpReply:
    """Read the DATA block up to the final dot and return it unstuffed, or the refusal.

    ``reader`` must have a limit of at least ``MAX_LINE + 3`` (a stuffed line and its CRLF);
    memory held is that limit plus the kept message, never more than ``max_size`` octets
    (unstuffed, CRLFs counted, RFC 1870 section 3). Returns ``replies.LINE_TOO_LONG`` for a
    line over 998 octets, ``replies.MESSAGE_TOO_BIG`` past ``max_size`` (the first limit hit
    wins), after reading on to the dot. Raises :class:`ClientGone` when the stream ends first.
    ``bare_newline``: :data:`REJECT` splits lines at CRLF only (a bare LF stays inside a
    line); :data:`NORMALIZE` also at a bare LF, which the returned content has as CRLF (the
    limits count the line so ended), and drops a ``.`` line that is no ``<CRLF>.<CRLF>``.
    """
    separator = b"\n" if bare_newline == NORMALIZE else b"\r\n"
    kept: list[bytes] = []
    size = 0
    refusal: SmtpReply | None = None
    after_crlf = True  # the DATA command's line ended in CRLF (CommandLineGuard)
    while True:
        line, whole = await _next_line(reader, separator)
        if not whole:  # past the reader's limit: the rest of the line is dropped unread
            after_crlf = await _skip_rest_of_line(reader, separator)
            refusal = refusal or replies.LINE_TOO_LONG
            kept.clear()
            continue
        if line == _END and after_crlf:
            break
        crlf = line.endswith(b"\r\n")
        if not crlf:  # a bare LF (NORMALIZE only): the line ends in CRLF from here on
            line = line[:-1] + b"\r\n"
        dot_line = line == _END  # not after a CRLF, or not in CRLF itself: no end
        after_crlf = crlf
        if dot_line:
            continue  # dropped, as Postfix's normalize does
        if line[:1] == b".":
            line = line[1:]  # transparency (RFC 5321 section 4.5.2)
        size += len(line)
        if refusal is None and len(line) - 2 > MAX_LINE:
            refusal = replies.LINE_TOO_LONG
        elif refusal is None and max_size and size > max_size:
            refusal = replies.MESSAGE_TOO_BIG
        if refusal is None:
            kept.append(line)
        else:
            kept.clear()
    return refusal if refusal is not None else b"".join(kept)


async def _next_line(reader: asyncio.StreamReader, separator: bytes) -> tuple[bytes, bool]:
    """The next line with its ``separator`` and True, or (b"", False) when it is longer than
    the limit."""
    try:
        return await reader.readuntil(separator), True
    except asyncio.LimitOverrunError:
        return b"", False
    except asyncio.IncompleteReadError as exc:
        raise ClientGone from exc


async def _skip_rest_of_line(reader: asyncio.StreamReader, separator: bytes) -> bool:
    """Throw away octets up to and including the next ``separator``, one buffer at a time;
    True when the line ended in CRLF."""
    last = b""  # the last octet thrown away before the final piece
    while True:
        try:
            end = await reader.readuntil(separator)
            return (last + end).endswith(b"\r\n")
        except asyncio.LimitOverrunError as exc:
            # ``consumed`` stops one octet short of the buffer's end: a CR there may be the
            # first half of the CRLF, and stays for the next round
            skipped = await reader.readexactly(exc.consumed)
            last = skipped[-1:] or last
        except asyncio.IncompleteReadError as exc:
            raise ClientGone from exc


class CommandLineGuard:
    """Wraps the session's StreamReader: a command line must end in CRLF, not LF or CR CRLF.

    aiosmtpd reads commands with ``readuntil()`` (up to a bare LF) and strips CRs, so
    ``RCPT TO:<a@x>\nRCPT TO:<b@y>\r\n`` would be two commands: a recipient smuggled past an
    application that only strips CRLF (RFC 5321 section 2.3.8 allows CRLF only). A bad line
    calls ``on_bad`` (the session answers 421 and closes, as sendmail does: nothing after it on
    this connection can be trusted) and ends the session. A line over the reader's limit reaches
    aiosmtpd in pieces (``read(consumed)`` after a ``LimitOverrunError``, then ``readuntil()``):
    the check then looks at the end of the whole line, so a long line ending in CRLF gets
    aiosmtpd's ``500`` and one ending in a bare LF the ``421``. Each good command line is shown
    to ``on_command`` (the bytes, or ``b""`` for an over-long one), which returns False when the
    session must end (it has said why). The end of the client's stream (EOF, a half-close)
    ends the session once every command before it has been answered. The DATA block is read
    from :attr:`stream`, past the check, and AUTH responses (``readline()``) are checked as
    lines of their own; every other attribute is the wrapped reader's (aiosmtpd's STARTTLS
    writes to private ones).
    """

    __slots__ = ("_inner", "_on_bad", "_on_command", "_overrun", "_tail")
    _inner: asyncio.StreamReader
    _on_bad: Callable[[], None]
    _on_command: Callable[[bytes], bool]
    _overrun: bool  # inside an over-long command line
    _tail: bytes  # its last bytes drained so far

    def __init__(self, inner: asyncio.StreamReader, on_bad: Callable[[], None],
                 on_command: Callable[[bytes], bool]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_on_bad", on_bad)
        object.__setattr__(self, "_on_command", on_command)
        object.__setattr__(self, "_overrun", False)
        object.__setattr__(self, "_tail", b"")

    @property
    def stream(self) -> asyncio.StreamReader:
        """The wrapped reader: :func:`read_message` reads the DATA block from it (a content
        line may end in a bare LF, read with ``readuntil(b"\\n")`` as a command line is)."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    async def readline(self) -> bytes:
        """One AUTH response line (aiosmtpd reads those with ``readline``), up to
        ``AUTH_LINE_MAX`` octets (RFC 4954 section 4: 12288, past the reader's 1001-octet
        limit, at which ``StreamReader.readline`` raises). A longer line is read to its end
        and given as ``b"=\r\n"``, which no SASL response decodes from (the client gets
        aiosmtpd's 501 and the session goes on). A line that does not end in CRLF (a bare LF
        would let the rest be read as a command) ends the session like a bad command line."""
        parts: list[bytes] = []
        size, tail = 0, b""
        while True:
            try:
                part = await self._inner.readuntil(b"\n")
            except asyncio.LimitOverrunError as exc:
                part = await self._inner.read(exc.consumed)
            except asyncio.IncompleteReadError:
                raise asyncio.CancelledError from None  # the client is gone mid-exchange
            size, tail = size + len(part), (tail + part)[-3:]
            if size <= AUTH_LINE_MAX:
                parts.append(part)
            if part.endswith(b"\n"):
                break
        line = b"".join(parts)
        if not tail.endswith(b"\r\n") or tail.endswith(b"\r\r\n"):
            self._on_bad()
            raise asyncio.CancelledError
        return line if size <= AUTH_LINE_MAX else b"=\r\n"

    async def read(self, n: int = -1) -> bytes:
        data = await self._inner.read(n)
        if self._overrun and data:
            self._tail = (self._tail + data)[-2:]
        return data

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        try:
            line = await self._inner.readuntil(separator)
        except asyncio.LimitOverrunError:
            if separator == b"\n":
                self._overrun = True
            raise
        except asyncio.IncompleteReadError:
            if separator != b"\n":
                raise
            # the client sent all it will (a half-close): every command before the EOF is
            # answered; aiosmtpd closes the connection on this, its end for a gone client
            raise asyncio.CancelledError from None
        if separator != b"\n":
            return line
        overrun = self._overrun
        end = self._tail + line if overrun else line
        self._overrun, self._tail = False, b""
        # a CR inside the line reaches the path checks (501); one just before the CRLF would be
        # stripped by aiosmtpd unseen
        if not end.endswith(b"\r\n") or end.endswith(b"\r\r\n"):
            self._on_bad()
            raise asyncio.CancelledError  # aiosmtpd's own end for a connection gone mid-command
        if not self._on_command(b"" if overrun else line):
            raise asyncio.CancelledError
        return line
