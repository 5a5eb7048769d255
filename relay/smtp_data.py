"""Reading the DATA block (RFC 5321 section 4.1.1.4) with its limits held while it arrives.

aiosmtpd's own DATA loop keeps every piece of a line that has no CRLF yet, even after it knows
the line is too long: 400 MB without a line end grew the process by 400 MB. Here a line past the
limit, or a message past the size limit, is counted and thrown away as it arrives; only a
message within both limits is kept. The reply comes after the final dot (RFC 5321 section
4.2.5: the client sends the whole block before reading it); a client that never sends the dot
is ended by the session's DATA deadline, not by memory.
"""

from __future__ import annotations

import asyncio

from relay import replies
from relay.interfaces import SmtpReply

MAX_LINE = 998  # octets before CRLF, after dot-unstuffing (RFC 5321 section 4.5.3.1.6)
_END = b".\r\n"


class ClientGone(Exception):  # an event, not a failure of ours
    """The client's stream ended (EOF) before the final dot."""


async def read_message(reader: asyncio.StreamReader, *, max_size: int | None
                       ) -> bytes | SmtpReply:
    """Read the DATA block up to the final dot and return it unstuffed, or the refusal.

    ``reader`` must have a limit of at least ``MAX_LINE + 3`` (a stuffed line and its CRLF);
    memory held is that limit plus the kept message, never more than ``max_size`` octets
    (unstuffed, CRLFs counted, RFC 1870 section 3). Returns ``replies.LINE_TOO_LONG`` for a
    line over 998 octets, ``replies.MESSAGE_TOO_BIG`` past ``max_size`` (the first limit hit
    wins), after reading on to the dot. Raises :class:`ClientGone` when the stream ends first.
    """
    kept: list[bytes] = []
    size = 0
    refusal: SmtpReply | None = None
    while True:
        line, whole = await _next_line(reader)
        if whole and line == _END:
            break
        if not whole:  # past the reader's limit: the rest of the line is dropped unread
            await _skip_rest_of_line(reader)
            refusal = refusal or replies.LINE_TOO_LONG
            kept.clear()
            continue
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


async def _next_line(reader: asyncio.StreamReader) -> tuple[bytes, bool]:
    """The next line with its CRLF and True, or (b"", False) when it is longer than the limit."""
    try:
        return await reader.readuntil(b"\r\n"), True
    except asyncio.LimitOverrunError:
        return b"", False
    except asyncio.IncompleteReadError as exc:
        raise ClientGone from exc


async def _skip_rest_of_line(reader: asyncio.StreamReader) -> None:
    """Throw away octets up to and including the next CRLF, one buffer at a time."""
    while True:
        try:
            await reader.readuntil(b"\r\n")
            return
        except asyncio.LimitOverrunError as exc:
            # ``consumed`` stops one octet short of the buffer's end: a CR there may be the
            # first half of the CRLF, and stays for the next round
            await reader.readexactly(exc.consumed)
        except asyncio.IncompleteReadError as exc:
            raise ClientGone from exc
