"""relay.smtp.data.read_message under both ``bare_newline`` values: only ``<CRLF>.<CRLF>`` ends
the DATA block (RFC 5321 section 4.1.1.4); ``normalize`` takes a line ending in a bare LF as
ending in CRLF and drops a ``.`` line that is no end, as Postfix's ``normalize`` does;
``reject`` leaves the bare LF inside its line (the handler answers ``550 5.6.0``)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from relay.core import replies
from relay.core.interfaces import SmtpReply
from relay.smtp.data import BARE_NEWLINE_MODES, MAX_LINE, NORMALIZE, REJECT, read_message

_LIMIT = MAX_LINE + 3  # the session's reader limit (RelaySMTP.line_length_limit)


async def _read(wire: bytes, mode: str, max_size: int | None = None
                ) -> tuple[bytes | SmtpReply, bytes]:
    """What read_message makes of ``wire`` (the bytes after DATA's 354), and what it left
    unread in the stream (the next commands)."""
    reader = asyncio.StreamReader(limit=_LIMIT)
    reader.feed_data(wire)
    reader.feed_eof()
    got = await read_message(reader, max_size=max_size, bare_newline=mode)
    return got, await reader.read()


@pytest.mark.parametrize(("wire", "content"), [
    (b"a\nb\r\n.\r\n", b"a\r\nb\r\n"),
    (b"Subject: x\n\nbody\n\r\n.\r\n", b"Subject: x\r\n\r\nbody\r\n\r\n"),  # smtplib's bytes
    (b"..x\n..\n\r\n.\r\n", b".x\r\n.\r\n\r\n"),  # transparency of lines ending in a bare LF
    (b"a\n.\nb\r\n.\r\n", b"a\r\nb\r\n"),  # <LF>.<LF>: no end, dropped
    (b"a\n.\r\nb\r\n.\r\n", b"a\r\nb\r\n"),  # <LF>.<CRLF>
    (b"a\r\n.\nb\r\n.\r\n", b"a\r\nb\r\n"),  # <CRLF>.<LF>
    (b".\n\r\n.\r\n", b"\r\n"),  # the first line: ".<LF>" is no end either
    (b"a\n.\r\n.\r\n", b"a\r\n"),  # then <CRLF>.<CRLF> on the wire: the end
    (b"a\rb\r\n.\r\n", b"a\rb\r\n"),  # a lone CR stays, for the handler's 550 5.6.0
], ids=["LF", "smtplib", "stuffed", "LF.LF", "LF.CRLF", "CRLF.LF", "first-line", "then-end",
        "lone-CR"])
async def test_normalize_makes_bare_lf_line_ends_crlf(wire: bytes, content: bytes) -> None:
    got, rest = await _read(wire + b"QUIT\r\n", NORMALIZE)
    assert (got, rest) == (content, b"QUIT\r\n")


async def test_reject_keeps_a_bare_lf_inside_its_line() -> None:
    got, rest = await _read(b"a\nb\r\na\n.\nb\r\n.\r\nQUIT\r\n", REJECT)
    assert (got, rest) == (b"a\nb\r\na\n.\nb\r\n", b"QUIT\r\n")


@pytest.mark.parametrize(("mode", "end"), [(NORMALIZE, b"\n"), (NORMALIZE, b"\r\n"),
                                         (REJECT, b"\r\n")])
async def test_line_limit_counts_the_line_as_ended_in_crlf(mode: str, end: bytes) -> None:
    """998 octets and a line end pass, 999 are too long (RFC 5321 section 4.5.3.1.6)."""
    fits, _ = await _read(b"x" * MAX_LINE + end + b"\r\n.\r\n", mode)
    longer, _ = await _read(b"x" * (MAX_LINE + 1) + end + b"\r\n.\r\n", mode)
    assert fits == b"x" * MAX_LINE + b"\r\n\r\n"
    assert longer == replies.LINE_TOO_LONG


@pytest.mark.parametrize("mode", BARE_NEWLINE_MODES)
async def test_an_over_long_line_ending_in_a_bare_lf_is_no_crlf_before_a_dot(mode: str
                                                                             ) -> None:
    """Past the reader's limit the line is skipped to its end: after a bare LF the ``.`` line
    is no end (``normalize``), or still inside the line (``reject``); the real end follows."""
    got, rest = await _read(b"x" * 3000 + b"\n.\r\n.\r\nQUIT\r\n", mode)
    assert (got, rest) == (replies.LINE_TOO_LONG, b"QUIT\r\n")
    got, rest = await _read(b"x" * 3000 + b"\r\n.\r\nQUIT\r\n", mode)
    assert (got, rest) == (replies.LINE_TOO_LONG, b"QUIT\r\n")


async def test_size_counts_the_message_as_normalized() -> None:
    """800 octets on the wire are 1000 with their line ends made CRLF: past a 1000 limit."""
    got, rest = await _read(b"abc\n" * 200 + b"\r\n.\r\nQUIT\r\n", NORMALIZE, max_size=1000)
    assert (got, rest) == (replies.MESSAGE_TOO_BIG, b"QUIT\r\n")


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([b"\r", b"\n", b".", b"a", b"\r\n", b".\r\n", b"\n.\n",
                                 b"\r\n.", b"..", b"\n."]), max_size=16).map(b"".join),
       st.sampled_from(BARE_NEWLINE_MODES))
@example(b"a\n.\r\n", NORMALIZE)
@example(b"a\r\n.\n", NORMALIZE)
@example(b".\r\n", NORMALIZE)
def test_the_block_ends_at_the_first_crlf_dot_crlf_in_both_modes(body: bytes, mode: str) -> None:
    """Whatever the line ends, the block ends where ``<CRLF>.<CRLF>`` first stands on the wire
    (the DATA command's CRLF counted): the same place under both values, so no bare LF or CR
    can end it early, and the rest is read as commands only from there. Under ``normalize``
    the content has no bare LF."""
    wire = body + b"\r\n.\r\nNOOP\r\n"
    end = (b"\r\n" + wire).index(b"\r\n.\r\n")  # where the block's end stands
    got, rest = asyncio.run(_read(wire, mode))
    assert rest == wire[end + 3:]
    assert isinstance(got, bytes)
    if mode == NORMALIZE:
        assert got.count(b"\n") == got.count(b"\r\n")
