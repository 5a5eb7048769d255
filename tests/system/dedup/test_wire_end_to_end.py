"""Wire-level behaviour: byte-exact client input, SMTP replies, upstream bytes.

Each test drives a real relay (real Redis, real aiosmtpd sink upstream) and asserts the reply
(code and RFC 3463 code), what reached upstream and what the store holds. Each block is headed
by the behaviour and the RFC section it checks. The helpers are in tests/support/wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from relay.app import Relay
from relay.core import replies
from relay.core.interfaces import State
from relay.smtp.data import BARE_NEWLINE_MODES
from tests.support.clients import RawClient, send
from tests.support.relays import MakeRelay
from tests.support.sink import Sink, start_sink
from tests.support.waiting import until
from tests.support.wire import (
    RCPT,
    assert_relayed_unchanged,
    assert_reply,
    closed_by_server,
    codes,
    ehlo,
    msg,
    state_of,
    stored_keys,
    transaction,
)


@dataclass
class WireSink:
    """A minimal smarthost that records the raw command lines and DATA bytes it reads."""

    port: int = 0
    commands: list[bytes] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 wire.test ESMTP\r\n")
        while line := await reader.readline():
            self.commands.append(line)
            verb = line[:4].upper()
            if verb == b"EHLO":
                writer.write(b"250-wire.test\r\n250-8BITMIME\r\n250-SMTPUTF8\r\n"
                             b"250-SIZE 52428800\r\n250 PIPELINING\r\n")
            elif verb == b"DATA":
                writer.write(b"354 go ahead\r\n")
                self.data.append(await reader.readuntil(b"\r\n.\r\n"))
                writer.write(b"250 2.0.0 queued\r\n")
            elif verb == b"QUIT":
                writer.write(b"221 2.0.0 bye\r\n")
                break
            else:
                writer.write(b"250 2.0.0 OK\r\n")
            await writer.drain()
        writer.close()


@pytest.fixture(params=BARE_NEWLINE_MODES)
def bare_newline(request: pytest.FixtureRequest) -> str:
    """Each value of the ``bare_newline`` setting."""
    return str(request.param)


@pytest.fixture
async def wire_sink() -> AsyncIterator[WireSink]:
    """A running WireSink on a loopback port."""
    sink = WireSink()
    server = await asyncio.start_server(sink.serve, "127.0.0.1", 0, limit=1 << 22)
    sink.port = server.sockets[0].getsockname()[1]
    yield sink
    server.close()


# ------------------------------------------------------------------------------------------
# non-ASCII (SMTPUTF8) local part (RFC 6531)
# ------------------------------------------------------------------------------------------

INVOICE = (b"To: j\xc3\xb6rg@example.com", b"X-Template: invoice", b"X-Dedupe-Key: INV-1001")


async def test_utf8_local_part_is_relayed_with_smtputf8(relay: Relay, sink: Sink) -> None:
    """A UTF-8 local part with MAIL ... SMTPUTF8 is relayed with SMTPUTF8 and BODY=8BITMIME."""
    data = msg(*INVOICE, body=b"Hallo J\xc3\xb6rg")
    client, _ = await ehlo(relay.port)
    got = await transaction(client, ["jörg@example.com"], data,
                            mail=b"MAIL FROM:<app@example.com> SMTPUTF8")
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    assert got[-1].startswith("250 2.0.0 ")
    [(sender, options)] = sink.handler.mail_commands
    assert sender == "app@example.com"
    assert "SMTPUTF8" in options and "BODY=8BITMIME" in options
    assert sink.handler.rcpt_commands == ["jörg@example.com"]
    assert_relayed_unchanged(sink.handler.delivered[0], data)
    assert await state_of(relay, "jörg@example.com", "invoice", "INV-1001") is State.SENT


async def test_utf8_address_reaches_upstream_as_identical_bytes(
    make_relay: MakeRelay, wire_sink: WireSink
) -> None:
    """Upstream reads RCPT TO:<j\\xc3\\xb6rg@example.com> and MAIL ... SMTPUTF8 byte for byte."""
    relay = await make_relay(upstream=f"127.0.0.1:{wire_sink.port}")
    data = msg(*INVOICE, body=b"Hallo J\xc3\xb6rg")
    client, _ = await ehlo(relay.port)
    got = await transaction(client, ["jörg@example.com"], data,
                            mail=b"MAIL FROM:<app@example.com> SMTPUTF8")
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    mail = [c for c in wire_sink.commands if c.upper().startswith(b"MAIL")]
    rcpt = [c for c in wire_sink.commands if c.upper().startswith(b"RCPT")]
    assert len(mail) == 1 and mail[0].startswith(b"MAIL FROM:<app@example.com> ")
    assert b" SMTPUTF8" in mail[0]
    assert rcpt == [b"RCPT TO:<j\xc3\xb6rg@example.com>\r\n"]
    assert wire_sink.data[0].endswith(data + b".\r\n")


async def test_non_ascii_rcpt_without_smtputf8_is_553(relay: Relay, sink: Sink) -> None:
    """A UTF-8 MAIL or RCPT path without the SMTPUTF8 parameter gets 553 5.6.7; session goes on."""
    client, _ = await ehlo(relay.port)
    sender = await client.cmd("MAIL FROM:<jörg@example.com>".encode())
    assert sender == str(replies.NON_ASCII_WITHOUT_SMTPUTF8)
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250 ")
    reply = await client.cmd("RCPT TO:<jörg@example.com>".encode())
    assert reply == str(replies.NON_ASCII_WITHOUT_SMTPUTF8)
    assert (await client.cmd("DATA")).startswith("503 5.5.1 ")  # nothing was accepted
    assert (await client.cmd("NOOP")).startswith("250 ")
    await client.close()
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []


@pytest.mark.parametrize("mail", [b"MAIL FROM:<app@example.com>",
                                  b"MAIL FROM:<app@example.com> SMTPUTF8"])
async def test_invalid_utf8_local_part_is_refused(
    relay: Relay, sink: Sink, mail: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """A lone Latin-1 byte F6 in RCPT gets 501 5.5.2 (or 553 5.6.7), no traceback, no relay."""
    client, _ = await ehlo(relay.port)
    assert (await client.cmd(mail)).startswith("250 ")
    reply = await client.cmd(b"RCPT TO:<j\xf6rg@example.com>")
    assert reply in (str(replies.INVALID_UTF8), str(replies.NON_ASCII_WITHOUT_SMTPUTF8))
    assert (await client.cmd("NOOP")).startswith("250 ")
    await client.close()
    assert not [r for r in caplog.records if r.exc_info]  # no traceback logged
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []


async def test_eight_bit_byte_in_mail_from_gets_a_reply(
    relay: Relay, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    """A raw 0xC0 byte in MAIL FROM gets 501 5.5.2 (or 553 5.6.7) and the session survives."""
    client, _ = await ehlo(relay.port)
    reply = await client.cmd(b"MAIL FROM:<\xc0@example.com>")
    assert reply in (str(replies.INVALID_UTF8), str(replies.NON_ASCII_WITHOUT_SMTPUTF8))
    assert re.match(r"50[02] 5\.5\.\d ", await client.cmd(b"M\xc0IL FROM:<app@example.com>"))
    assert (await client.cmd(b"EHLO \xc0legacy.example.com")).startswith("250")
    got = await transaction(client, [RCPT], msg("X-Template: t", "X-Dedupe-Key: C0-1"))
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    assert [m[0] for m in sink.handler.mail_commands] == ["app@example.com"]
    assert not [r for r in caplog.records if r.exc_info]  # no traceback logged


async def test_upstream_without_smtputf8_is_550_and_nothing_sent(
    make_relay: MakeRelay,
) -> None:
    """Upstream without SMTPUTF8: 550 5.6.7 after the dot, nothing upstream, no key."""
    sink = await start_sink(smtputf8=False)
    try:
        relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
        result = await send(relay.port, ["jörg@example.com"], msg(*INVOICE),
                            mail_options=["SMTPUTF8"])
        assert (result.code, result.text) == (550, replies.UPSTREAM_NO_SMTPUTF8.text)
        assert sink.handler.transactions == 0
        assert sink.handler.delivered == []
        assert await state_of(relay, "jörg@example.com", "invoice", "INV-1001") is State.ABSENT
    finally:
        sink.server.close()


async def test_nfc_and_case_variants_are_suppressed(relay: Relay, sink: Sink) -> None:
    """jörg, the decomposed jo\\u0308rg and JÖRG share a fingerprint: one upstream copy."""
    results = [await send(relay.port, [rcpt], msg(*INVOICE), mail_options=["SMTPUTF8"])
               for rcpt in ("jörg@example.com", "jo\u0308rg@example.com", "JÖRG@example.com")]
    assert [r.code for r in results] == [250, 250, 250]
    assert all("suppressed" in r.text for r in results[1:])
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["jörg@example.com"]]
    assert await state_of(relay, "jo\u0308rg@example.com", "invoice", "INV-1001") is State.SENT


# ------------------------------------------------------------------------------------------
# bare LF and SMTP smuggling (RFC 5321 sections 2.3.8, 4.1.1.4)
# ------------------------------------------------------------------------------------------

@pytest.fixture(params=BARE_NEWLINE_MODES)
async def each_newline_relay(request: pytest.FixtureRequest, make_relay: MakeRelay,
                             sink: Sink) -> Relay:
    """A relay in front of ``sink`` under each ``bare_newline`` value (``relay.settings``
    says which)."""
    return await make_relay(upstream=f"127.0.0.1:{sink.port}", bare_newline=request.param)


def smuggled(fake_end: bytes) -> bytes:
    """Case 03's DATA: W-1, a fake end marker, then a spoofed W-2 transaction as text."""
    return (b"From: app@example.com\r\nX-Template: welcome\r\nX-Dedupe-Key: W-1\r\n\r\nhello"
            + fake_end + SPOOFED + b"\r\n.\r\n")


SPOOFED = (b"MAIL FROM:<ceo@example.com>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n"
           b"X-Template: welcome\r\nX-Dedupe-Key: W-2\r\n\r\nspoofed")


@pytest.mark.parametrize("fake_end", [b"\n.\r\n", b"\n.\n", b"\r.\r", b"\r\n.\n", b"\r.\r\n"],
                         ids=["LF.CRLF", "LF.LF", "CR.CR", "CRLF.LF", "CR.CRLF"])
async def test_smuggled_terminator_does_not_end_data(
    each_newline_relay: Relay, sink: Sink, fake_end: bytes
) -> None:
    """A fake end marker does not end DATA: the smuggled MAIL/RCPT/DATA stay text. Under
    ``reject`` (or with a bare CR under either value) the message gets one 550 5.6.0 (or
    421) after the real end and nothing is relayed; under ``normalize`` a fake end made of
    bare LFs is dropped and W-1 goes upstream once, the smuggled lines as its body."""
    relay = each_newline_relay
    client, _ = await ehlo(relay.port)
    got = [await client.cmd("MAIL FROM:<app@example.com>"),
           await client.cmd("RCPT TO:<a@example.net>"), await client.cmd("DATA")]
    await client.write(smuggled(fake_end))
    final = await client.reply()
    assert codes(got) == [250, 250, 354]
    lone_cr = b"\r" in fake_end.replace(b"\r\n", b"")
    relayed = relay.settings.bare_newline == "normalize" and not lone_cr
    if final.startswith("421"):
        assert not relayed
        assert await closed_by_server(client)
    else:
        assert final.startswith("250 2.0.0 ") if relayed else final == str(replies.BARE_CR_OR_LF)
        # in sync: the smuggled MAIL/RCPT/DATA were body text, not commands
        assert (await client.cmd("NOOP")).startswith("250 ")
    await client.close()
    assert [m[0] for m in sink.handler.mail_commands] == (
        ["app@example.com"] if relayed else [])
    if relayed:
        [delivered] = sink.handler.delivered
        assert delivered.rcpt_tos == ["a@example.net"]
        assert delivered.content.endswith(b"\r\n\r\nhello\r\n" + SPOOFED + b"\r\n")
    assert await state_of(relay, "a@example.net", "welcome", "W-1") is (
        State.SENT if relayed else State.ABSENT)
    assert await state_of(relay, "b@example.net", "welcome", "W-2") is State.ABSENT
    assert len(await stored_keys(relay)) == (1 if relayed else 0)


@pytest.mark.parametrize("body", [b"hello\rworld", b"hello\r", b"hello\r\rworld"],
                         ids=["bare-CR", "trailing-CR", "two-CRs"])
async def test_bare_cr_in_data_is_refused(
    each_newline_relay: Relay, sink: Sink, body: bytes
) -> None:
    """A lone CR inside DATA gets 550 5.6.0 under either value, and nothing reaches
    upstream."""
    relay = each_newline_relay
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], msg("X-Template: welcome", "X-Dedupe-Key: W-1",
                                                body=body))
    await client.close()
    assert codes(got)[:3] == [250, 250, 354]
    assert got[-1] == str(replies.BARE_CR_OR_LF)
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []


@pytest.mark.parametrize("body", [b"hello\nworld", b"hello\n", b"hello\n\nworld\n"],
                         ids=["bare-LF", "trailing-LF", "blank-line"])
async def test_bare_lf_in_data_is_a_line_end_or_refused(
    each_newline_relay: Relay, sink: Sink, body: bytes
) -> None:
    """A bare LF inside DATA: under ``normalize`` a line end, relayed as CRLF; under ``reject``
    550 5.6.0 and nothing reaches upstream."""
    relay = each_newline_relay
    client, _ = await ehlo(relay.port)
    data = msg("X-Template: welcome", "X-Dedupe-Key: W-1", body=body)
    got = await transaction(client, [RCPT], data)
    await client.close()
    assert codes(got)[:3] == [250, 250, 354]
    if relay.settings.bare_newline == "reject":
        assert got[-1] == str(replies.BARE_CR_OR_LF)
        assert sink.handler.transactions == 0
        assert await stored_keys(relay) == []
        return
    assert got[-1].startswith("250 2.0.0 ")
    [delivered] = sink.handler.delivered
    assert_relayed_unchanged(delivered, data.replace(b"\n", b"\r\n").replace(b"\r\r", b"\r"))
    assert await state_of(relay, RCPT, "welcome", "W-1") is State.SENT


async def test_lf_only_client_gets_data_timeout(make_relay: MakeRelay, sink: Sink,
                                                bare_newline: str) -> None:
    """A DATA section in LF only, ended by <LF>.<LF>, ends with 421 4.4.2 and a close: only
    <CRLF>.<CRLF> ends DATA under either value."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", client_timeout=1.0,
                             bare_newline=bare_newline)
    client, _ = await ehlo(relay.port)
    got = [await client.cmd("MAIL FROM:<app@example.com>"), await client.cmd(f"RCPT TO:<{RCPT}>"),
           await client.cmd("DATA")]
    await client.write(b"From: app@example.com\nX-Template: welcome\nX-Dedupe-Key: W-1\n\n"
                       b"hello\n.\n")
    assert codes(got) == [250, 250, 354]
    assert await client.reply(wait_s=3.0) == str(replies.CLIENT_TIMEOUT)
    assert await closed_by_server(client)
    await client.close()
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []


# ------------------------------------------------------------------------------------------
# dot-stuffing (RFC 5321 section 4.5.2)
# ------------------------------------------------------------------------------------------

STUFFED = msg("X-Template: report", "X-Dedupe-Key: R-7",
              body=b"..hidden-file.txt\r\n..\r\n...\r\nend")
UNSTUFFED_BODY = b"\r\n\r\n.hidden-file.txt\r\n.\r\n..\r\nend\r\n"


async def test_stuffed_lines_reach_upstream_unstuffed_once(
    relay: Relay, sink: Sink
) -> None:
    """Lines ..x, .., ... arrive upstream (after its one unstuffing) as .x, ., .. exactly."""
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], STUFFED)
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    [delivered] = sink.handler.delivered
    assert delivered.content.endswith(b"X-Dedupe-Key: R-7" + UNSTUFFED_BODY)
    assert await state_of(relay, RCPT, "report", "R-7") is State.SENT


async def test_upstream_wire_carries_the_client_stuffing(
    make_relay: MakeRelay, wire_sink: WireSink
) -> None:
    """The DATA bytes on the upstream wire end with exactly the stuffed lines the client sent."""
    relay = await make_relay(upstream=f"127.0.0.1:{wire_sink.port}")
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], STUFFED)
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    [wire] = wire_sink.data
    assert wire.endswith(STUFFED + b".\r\n")
    assert wire.count(b"\r\n.\r\n") == 1


async def test_resend_with_other_dot_count_is_suppressed(relay: Relay, sink: Sink) -> None:
    """The body is not in the fingerprint: a resend with fewer dots is answered 250, not relayed."""
    client, _ = await ehlo(relay.port)
    first = await transaction(client, [RCPT], STUFFED)
    second = await transaction(client, [RCPT], msg("X-Template: report", "X-Dedupe-Key: R-7",
                                                   body=b"..hidden-file.txt\r\nend"))
    await client.close()
    assert codes(first) == codes(second) == [250, 250, 354, 250]
    assert "suppressed" in second[-1]
    assert len(sink.handler.delivered) == 1
    assert await state_of(relay, RCPT, "report", "R-7") is State.SENT


async def test_unstuffed_lone_dot_ends_the_message_early(relay: Relay, sink: Sink) -> None:
    """An unstuffed "." line ends DATA; .x arrives as x; the lines after it get 500/502."""
    client, _ = await ehlo(relay.port)
    head = msg("X-Template: report", "X-Dedupe-Key: R-8", body=b".hidden-file.txt")
    got = await transaction(client, [RCPT], head)  # the "." of transaction() is the lone dot
    await client.write(b"end\r\n.\r\n")
    leftovers = [await client.reply(), await client.reply()]
    assert (await client.cmd("NOOP")).startswith("250 ")
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    assert all(re.match(r"50[02] 5\.5\.\d ", r) for r in leftovers), leftovers
    [delivered] = sink.handler.delivered
    assert delivered.content.endswith(b"X-Dedupe-Key: R-8\r\n\r\nhidden-file.txt\r\n")


# ------------------------------------------------------------------------------------------
# lines longer than 998 octets (RFC 5321 section 4.5.3.1.6)
# ------------------------------------------------------------------------------------------

REPORT = ("X-Template: nightly-report", "X-Dedupe-Key: NR-2024-03-01", "Content-Type: text/html")


@pytest.mark.parametrize("octets", [999, 1500])
async def test_long_line_is_refused_after_terminator_and_session_stays_in_sync(
    relay: Relay, sink: Sink, octets: int
) -> None:
    """A line over 998 octets: one 500 5.5.2 after the dot, nothing relayed, next MAIL works."""
    line = b"<html><body><table>" + b"A" * (octets - 41) + b"</table></body></html>"
    assert len(line) == octets
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], msg(*REPORT, body=line))
    assert codes(got)[:3] == [250, 250, 354]
    assert got[-1].startswith(("500 5.5.2 ", "552 5.3.4 "))
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []
    fixed = msg(*REPORT, body=line[:700] + b"\r\n" + line[700:])
    retry = await transaction(client, [RCPT], fixed)
    await client.close()
    assert codes(retry) == [250, 250, 354, 250]
    assert "relayed 1" in retry[-1]
    assert_relayed_unchanged(sink.handler.delivered[0], fixed)
    assert await state_of(relay, RCPT, "nightly-report", "NR-2024-03-01") is State.SENT


async def test_line_of_998_octets_is_relayed_unchanged(relay: Relay, sink: Sink) -> None:
    """A line of exactly 998 octets is within the limit and reaches upstream unwrapped."""
    line = b"B" * 998
    data = msg(*REPORT, body=line)
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], data)
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    assert_relayed_unchanged(sink.handler.delivered[0], data)
    assert b"\r\n" + line + b"\r\n" in sink.handler.delivered[0].content


async def test_long_dedupe_key_line_is_refused(relay: Relay, sink: Sink) -> None:
    """An X-Dedupe-Key line of 1200+ octets gets 500 5.5.2 (or 552 5.3.4); nothing relayed."""
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], msg("X-Template: nightly-report",
                                                b"X-Dedupe-Key: " + b"K" * 1200))
    assert codes(got)[:3] == [250, 250, 354]
    assert got[-1].startswith(("500 5.5.2 ", "552 5.3.4 "))
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250 ")
    await client.close()
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []


# ------------------------------------------------------------------------------------------
# 8-bit body (RFC 6152)
# ------------------------------------------------------------------------------------------

RECHNUNG = msg("X-Template: rechnung", "X-Dedupe-Key: R-2024-0042", "MIME-Version: 1.0",
               "Content-Type: text/plain; charset=iso-8859-1", "Content-Transfer-Encoding: 8bit",
               body=b"Gr\xfc\xdfe")


async def test_latin1_body_is_relayed_byte_exact_with_body_8bitmime(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """EHLO offers 8BITMIME+SMTPUTF8+SIZE; Latin-1 body bytes reach upstream unchanged."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_message_size=10485760)
    client, ehlo_reply = await ehlo(relay.port)
    lines = ehlo_reply.split("\n")
    assert all(re.match(r"250[ -]", line) for line in lines)
    assert not any(re.match(r"250[ -]\d\.\d{1,3}\.\d{1,3}", line) for line in lines)
    keywords = {line[4:] for line in lines[1:]}
    assert {"8BITMIME", "SMTPUTF8", "SIZE 10485760", "PIPELINING",
            "ENHANCEDSTATUSCODES"} <= keywords
    got = await transaction(client, ["kunde@example.net"], RECHNUNG,
                            mail=b"MAIL FROM:<app@example.com> BODY=8BITMIME")
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    [delivered] = sink.handler.delivered
    assert_relayed_unchanged(delivered, RECHNUNG)
    assert b"\r\nGr\xfc\xdfe\r\n" in delivered.content
    assert "BODY=8BITMIME" in sink.handler.mail_commands[0][1]
    assert await state_of(relay, "kunde@example.net", "rechnung", "R-2024-0042") is State.SENT


async def test_eight_bit_body_without_body_parameter_is_relayed(
    relay: Relay, sink: Sink
) -> None:
    """8-bit content after a MAIL without BODY= is accepted and relayed with BODY=8BITMIME."""
    client, _ = await ehlo(relay.port)
    got = await transaction(client, ["kunde@example.net"], RECHNUNG)
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    assert_relayed_unchanged(sink.handler.delivered[0], RECHNUNG)
    assert "BODY=8BITMIME" in sink.handler.mail_commands[0][1]
    assert await state_of(relay, "kunde@example.net", "rechnung", "R-2024-0042") is State.SENT


async def test_upstream_without_8bitmime_is_554_and_nothing_sent(
    make_relay: MakeRelay,
) -> None:
    """Upstream without 8BITMIME: 554 5.6.3 after the dot, no conversion, nothing sent, no key."""
    sink = await start_sink(eight_bit=False)
    try:
        relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
        client, _ = await ehlo(relay.port)
        got = await transaction(client, ["kunde@example.net"], RECHNUNG,
                                mail=b"MAIL FROM:<app@example.com> BODY=8BITMIME")
        await client.close()
        assert codes(got)[:3] == [250, 250, 354]
        assert got[-1] == str(replies.UPSTREAM_NO_8BITMIME)
        assert sink.handler.transactions == 0
        assert await stored_keys(relay) == []
    finally:
        sink.server.close()


async def test_byte_identical_eight_bit_key_resend_is_suppressed(
    relay: Relay, sink: Sink
) -> None:
    """A key holding a raw Latin-1 byte fingerprints by its bytes: the identical resend is kept."""
    data = msg("X-Template: rechnung", b"X-Dedupe-Key: R-\xfc-1", body=b"Gr\xfc\xdfe")
    client, _ = await ehlo(relay.port)
    first = await transaction(client, ["kunde@example.net"], data)
    second = await transaction(client, ["kunde@example.net"], data)
    await client.close()
    assert codes(first) == codes(second) == [250, 250, 354, 250]
    assert "suppressed" in second[-1]
    assert len(sink.handler.delivered) == 1
    assert len(await stored_keys(relay)) == 1


# ------------------------------------------------------------------------------------------
# empty reverse path (RFC 5321 section 4.5.5)
# ------------------------------------------------------------------------------------------

DSN = msg("From: Mail Delivery System <mailer-daemon@example.com>",
          "X-Template: delivery-failure", "X-Dedupe-Key: DSN-4711",
          body=b"Your message could not be delivered.")


@pytest.mark.parametrize("mail", [b"MAIL FROM:<>", b"MAIL FROM: <>", b"MAIL FROM:<> SIZE=1234"])
async def test_null_sender_forms_are_relayed_as_the_null_path(
    relay: Relay, sink: Sink, mail: bytes
) -> None:
    """MAIL FROM:<>, FROM: <> and <> SIZE=1234 get 250 and go upstream as the null path."""
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], DSN, mail=mail)
    await client.close()
    assert got[0] == str(replies.SENDER_OK)
    assert codes(got) == [250, 250, 354, 250]
    assert [m[0] for m in sink.handler.mail_commands] == ["<>"]
    assert sink.handler.delivered[0].rcpt_tos == [RCPT]
    assert await state_of(relay, RCPT, "delivery-failure", "DSN-4711") is State.SENT


async def test_null_sender_is_written_upstream_as_empty_path(
    make_relay: MakeRelay, wire_sink: WireSink
) -> None:
    """The upstream command is exactly MAIL FROM:<> (plus parameters), never <""> or <@>."""
    relay = await make_relay(upstream=f"127.0.0.1:{wire_sink.port}")
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], DSN, mail=b"MAIL FROM:<>")
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    [mail] = [c for c in wire_sink.commands if c.upper().startswith(b"MAIL")]
    assert re.fullmatch(rb"MAIL FROM:<>( [A-Z0-9=]+)*\r\n", mail), mail


async def test_second_dsn_copy_is_suppressed_whatever_the_sender(
    relay: Relay, sink: Sink
) -> None:
    """The sender is not in the fingerprint: DSN-4711 again from app@ is suppressed."""
    client, _ = await ehlo(relay.port)
    first = await transaction(client, [RCPT], DSN, mail=b"MAIL FROM:<>")
    second = await transaction(client, [RCPT], DSN)
    await client.close()
    assert codes(first) == codes(second) == [250, 250, 354, 250]
    assert "suppressed" in second[-1]
    assert sink.handler.transactions == 1
    assert await state_of(relay, RCPT, "delivery-failure", "DSN-4711") is State.SENT


async def test_upstream_501_on_null_sender_is_5xx_and_not_committed(
    relay: Relay, sink: Sink
) -> None:
    """Upstream 501 5.1.7 to MAIL FROM:<> gives the client 501 5.1.7 after DATA, no key."""
    sink.handler.mail_plan.append("501 5.1.7 Invalid MAIL FROM")
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], DSN, mail=b"MAIL FROM:<>")
    await client.close()
    assert codes(got)[:3] == [250, 250, 354]
    assert got[-1].startswith("501 5.1.7 ")
    assert sink.handler.delivered == []
    assert await state_of(relay, RCPT, "delivery-failure", "DSN-4711") is State.ABSENT


# ------------------------------------------------------------------------------------------
# SIZE and oversize messages (RFC 1870)
# ------------------------------------------------------------------------------------------

MIB = 1024 * 1024
EXPORT = ("X-Template: export", "X-Dedupe-Key: EXP-1")


def big_message(size: int) -> bytes:
    """An export message of at least ``size`` bytes in 998-octet lines."""
    line = b"x" * 998 + b"\r\n"
    return msg(*EXPORT, body=(line * (size // len(line) + 1)).rstrip(b"\r\n"))


async def test_declared_oversize_is_552_at_mail(make_relay: MakeRelay, sink: Sink) -> None:
    """EHLO advertises the enforced SIZE 1048576; MAIL ... SIZE=5242880 gets 552 5.3.4."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_message_size=MIB)
    client, ehlo_reply = await ehlo(relay.port)
    assert f"SIZE {MIB}" in {line[4:] for line in ehlo_reply.split("\n")}
    reply = await client.cmd("MAIL FROM:<app@example.com> SIZE=5242880")
    assert_reply(reply, replies.MESSAGE_TOO_BIG)
    assert (await client.cmd(f"RCPT TO:<{RCPT}>")).startswith("503 5.5.1 ")
    await client.close()
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []


async def test_malformed_size_is_501(make_relay: MakeRelay, sink: Sink) -> None:
    """MAIL ... SIZE=abc gets 501 5.5.4 and opens no transaction."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_message_size=MIB)
    client, _ = await ehlo(relay.port)
    reply = await client.cmd("MAIL FROM:<app@example.com> SIZE=abc")
    assert reply.startswith("501 5.5.4 ")
    assert (await client.cmd(f"RCPT TO:<{RCPT}>")).startswith("503 5.5.1 ")
    await client.close()
    assert sink.handler.transactions == 0


@pytest.mark.parametrize("mail", [b"MAIL FROM:<app@example.com>",
                                  b"MAIL FROM:<app@example.com> SIZE=100"],
                         ids=["undeclared", "understated"])
async def test_oversize_data_gets_one_552_after_terminator(
    make_relay: MakeRelay, sink: Sink, mail: bytes
) -> None:
    """2 MiB of DATA over a 1 MiB limit: one 552 5.3.4 after the dot; the next message works."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_message_size=MIB)
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], big_message(2 * MIB), mail=mail)
    assert codes(got)[:3] == [250, 250, 354]
    assert_reply(got[-1], replies.MESSAGE_TOO_BIG)
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []
    small = msg(*EXPORT)
    again = await transaction(client, [RCPT], small)
    await client.close()
    assert codes(again) == [250, 250, 354, 250]
    assert "relayed 1" in again[-1]
    assert_relayed_unchanged(sink.handler.delivered[0], small)
    assert await state_of(relay, RCPT, "export", "EXP-1") is State.SENT


async def test_relayed_message_declares_its_actual_size_upstream(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """A message under the limit is relayed with SIZE=<bytes sent> on the upstream MAIL."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_message_size=MIB)
    data = big_message(100_000)
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], data, mail=b"MAIL FROM:<app@example.com> SIZE=100")
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    [delivered] = sink.handler.delivered
    assert_relayed_unchanged(delivered, data)
    assert f"SIZE={len(delivered.content)}" in sink.handler.mail_commands[0][1]


def message_of_exactly(size: int) -> bytes:
    """An export message of exactly ``size`` octets whose body lines are lone dots, so that
    on the wire, stuffed, it is a third longer."""
    head = msg(*EXPORT, body=b"")[:-2]  # headers and the empty line
    body_lines, rest = divmod(size - len(head), 3)
    content = head + b".\r\n" * body_lines + b"x" * rest
    if rest:
        content = head + b".\r\n" * (body_lines - 1) + b"x" * (rest + 1) + b"\r\n"
    assert len(content) == size
    return content


@pytest.mark.parametrize(("size", "accepted"), [(4096, True), (4097, False)])
async def test_size_counts_the_message_not_its_transparency_dots(
    make_relay: MakeRelay, sink: Sink, size: int, accepted: bool
) -> None:
    """SIZE 4096: a message of exactly 4096 octets is relayed though, stuffed, the wire
    carried ~5400; 4097 octets get 552 5.3.4 (RFC 1870 section 3 does not count the dots)."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_message_size=4096)
    content = message_of_exactly(size)
    stuffed = b"".join(b"." + line if line.startswith(b".") else line
                       for line in content.splitlines(keepends=True))
    assert len(stuffed) > size * 1.3
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], stuffed,
                            mail=f"MAIL FROM:<app@example.com> SIZE={size}".encode())
    await client.close()
    if accepted:
        assert codes(got) == [250, 250, 354, 250]
        assert_relayed_unchanged(sink.handler.delivered[0], content)
    else:
        assert codes(got)[0] == 552 or got[-1].startswith("552 5.3.4")
        assert sink.handler.transactions == 0 and await stored_keys(relay) == []


async def test_upstream_552_at_mail_is_552_and_no_key(relay: Relay, sink: Sink) -> None:
    """Upstream 552 at MAIL (its limit is smaller) gives the client 552 after DATA, no key."""
    sink.handler.mail_plan.append("552 5.3.4 Message size exceeds fixed maximum message size")
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], msg(*EXPORT))
    await client.close()
    assert codes(got)[:3] == [250, 250, 354]
    assert_reply(got[-1], replies.MESSAGE_TOO_BIG)
    assert sink.handler.delivered == []
    assert await state_of(relay, RCPT, "export", "EXP-1") is State.ABSENT


# ------------------------------------------------------------------------------------------
# client disconnects in the middle of DATA: nothing relayed, nothing reserved
# ------------------------------------------------------------------------------------------

PAYSLIP_HEAD = b"From: app@example.com\r\nX-Template: payslip\r\nX-Dedupe-Key: PAY-2024-09-0042\r\n"
PAYSLIP = PAYSLIP_HEAD + b"\r\nfirst half of the body\r\nsecond half\r\n"


def abort_with_rst(client: RawClient) -> None:
    """Close the client's socket with a TCP RST (SO_LINGER 0) instead of a FIN."""
    sock = client.writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.writer.transport.abort()


@pytest.mark.parametrize(("partial", "rst"), [
    (PAYSLIP_HEAD + b"\r\nfirst half of the body\r\n", False),
    (PAYSLIP_HEAD[:40], False),
    (PAYSLIP_HEAD + b"\r\nfirst half of the body\r\n", True),
], ids=["FIN-in-body", "FIN-in-headers", "RST-in-body"])
async def test_disconnect_mid_data_leaves_no_trace_and_retry_is_relayed(
    relay: Relay, sink: Sink, partial: bytes, rst: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A client gone before the dot: nothing upstream, no key, other sessions fine, retry 250."""
    bystander, _ = await ehlo(relay.port)
    client, _ = await ehlo(relay.port)
    got = [await client.cmd("MAIL FROM:<app@example.com>"), await client.cmd(f"RCPT TO:<{RCPT}>"),
           await client.cmd("DATA")]
    await client.write(partial)
    if rst:
        abort_with_rst(client)
    else:
        await client.close()
    await asyncio.sleep(0.3)
    assert codes(got) == [250, 250, 354]
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []
    other = await transaction(bystander, ["other@example.net"], msg("X-Template: t",
                                                                    "X-Dedupe-Key: O-1"))
    await bystander.close()
    assert codes(other) == [250, 250, 354, 250]
    retry = await send(relay.port, [RCPT], PAYSLIP)
    assert retry.code == 250 and "relayed 1" in retry.text
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["other@example.net"], [RCPT]]
    assert_relayed_unchanged(sink.handler.delivered[1], PAYSLIP)
    assert await state_of(relay, RCPT, "payslip", "PAY-2024-09-0042") is State.SENT
    assert not [r for r in caplog.records if r.exc_info]  # no traceback logged


async def test_hangup_after_the_dot_still_settles_the_send(
    relay: Relay, sink: Sink
) -> None:
    """A client gone right after the dot: upstream gets it once, the key is SENT, retry kept."""
    sink.handler.delay_s = 0.5
    client, _ = await ehlo(relay.port)
    got = [await client.cmd("MAIL FROM:<app@example.com>"), await client.cmd(f"RCPT TO:<{RCPT}>"),
           await client.cmd("DATA")]
    await client.write(PAYSLIP + b".\r\n")
    await client.close()

    async def settled() -> bool:
        return await state_of(relay, RCPT, "payslip", "PAY-2024-09-0042") is State.SENT

    await until(settled, what="the SENT mark of the message whose client hung up")
    assert codes(got) == [250, 250, 354]
    assert len(sink.handler.delivered) == 1
    sink.handler.delay_s = 0.0
    retry = await send(relay.port, [RCPT], PAYSLIP)
    assert retry.code == 250 and "suppressed" in retry.text
    assert sink.handler.transactions == 1


# ------------------------------------------------------------------------------------------
# RSET in and after a transaction (RFC 5321 section 4.1.1.5)
# ------------------------------------------------------------------------------------------


async def test_rset_sequence_gets_the_rfc_replies_and_one_delivery(
    relay: Relay, sink: Sink
) -> None:
    """RSET before EHLO, mid-transaction and after a send: RFC replies, one copy, to b only."""
    r1 = msg("X-Template: t", "X-Dedupe-Key: R-1", body=b"body")
    client = await RawClient.connect(relay.port)
    got = [await client.cmd("RSET"), await client.cmd("EHLO legacy.example.com"),
           await client.cmd("MAIL FROM:<app@example.com>"),
           await client.cmd("RCPT TO:<a@example.net>"), await client.cmd("RSET"),
           await client.cmd("DATA")]
    got += await transaction(client, ["b@example.net"], r1)
    got.append(await client.cmd("RSET"))
    got += await transaction(client, ["b@example.net"], r1)
    quit_reply = await client.cmd("QUIT")
    await client.close()
    assert codes(got) == [250, 250, 250, 250, 250, 503, 250, 250, 354, 250, 250, 250, 250, 354,
                          250]
    assert quit_reply.startswith("221 2.0.0")
    for reply in [*got[:1], *got[2:], quit_reply]:  # RFC 2034: all but EHLO and 354
        assert reply.startswith("354 ") or re.match(r"\d{3} [245]\.\d{1,3}\.\d{1,3} ", reply)
    assert got[5].startswith("503 5.5.1 ")
    assert "relayed 1" in got[9] and "suppressed" in got[14]
    assert sink.handler.rcpt_commands == ["b@example.net"]
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["b@example.net"]]
    assert await state_of(relay, "b@example.net", "t", "R-1") is State.SENT
    assert await state_of(relay, "a@example.net", "t", "R-1") is State.ABSENT


async def test_session_is_reusable_after_an_upstream_failure(
    relay: Relay, sink: Sink
) -> None:
    """After an upstream 451 mid-transaction, RSET and a resend on the same session get 250."""
    sink.handler.data_plan = deque(["451 4.3.0 Try again later"])
    r1 = msg("X-Template: t", "X-Dedupe-Key: R-2")
    client, _ = await ehlo(relay.port)
    first = await transaction(client, ["b@example.net"], r1)
    rset = await client.cmd("RSET")
    second = await transaction(client, ["b@example.net"], r1)
    await client.close()
    assert first[-1].startswith("451 4.3.0 ")
    assert rset.startswith("250 ")
    assert codes(second) == [250, 250, 354, 250]
    assert len(sink.handler.mail_commands) == 2
    assert len(sink.handler.delivered) == 1
    assert await state_of(relay, "b@example.net", "t", "R-2") is State.SENT


async def test_pipelined_commands_with_rset_get_ordered_replies(
    relay: Relay, sink: Sink
) -> None:
    """MAIL, RCPT a, RSET, MAIL, RCPT b, DATA in one write: six replies in order, b only."""
    client, _ = await ehlo(relay.port)
    await client.write(b"MAIL FROM:<app@example.com>\r\nRCPT TO:<a@example.net>\r\nRSET\r\n"
                       b"MAIL FROM:<app@example.com>\r\nRCPT TO:<b@example.net>\r\nDATA\r\n")
    got = [await client.reply() for _ in range(6)]
    await client.write(msg("X-Template: t", "X-Dedupe-Key: P-9") + b".\r\n")
    got.append(await client.reply())
    await client.close()
    assert codes(got) == [250, 250, 250, 250, 250, 354, 250]
    assert sink.handler.rcpt_commands == ["b@example.net"]
    assert await state_of(relay, "b@example.net", "t", "P-9") is State.SENT
    assert await state_of(relay, "a@example.net", "t", "P-9") is State.ABSENT


# ------------------------------------------------------------------------------------------
# idle clients (RFC 5321 section 4.5.3.2.7)
# ------------------------------------------------------------------------------------------


async def test_idle_client_gets_421_and_is_closed(make_relay: MakeRelay, sink: Sink) -> None:
    """A client that says nothing gets 421 4.4.2 after the command timeout and is closed."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", client_timeout=1.0)
    client = await RawClient.connect(relay.port)
    assert await client.reply(wait_s=3.0) == str(replies.CLIENT_TIMEOUT)
    assert await closed_by_server(client)
    await client.close()
    assert sink.handler.transactions == 0


async def test_silent_client_in_data_gets_421_and_nothing_is_relayed(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """A client silent after 354 gets 421 4.4.2, is closed, and nothing is relayed or kept."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", client_timeout=1.0)
    client, _ = await ehlo(relay.port)
    got = [await client.cmd("MAIL FROM:<app@example.com>"), await client.cmd(f"RCPT TO:<{RCPT}>"),
           await client.cmd("DATA")]
    await client.write(b"From: app@example.com\r\nX-Template: contract\r\nX-Dedupe-Key: T-3\r\n")
    assert codes(got) == [250, 250, 354]
    assert await client.reply(wait_s=3.0) == str(replies.CLIENT_TIMEOUT)
    assert await closed_by_server(client)
    await client.close()
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []


async def test_client_sending_data_steadily_is_not_cut_off(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """A client sending DATA past the idle timeout is not cut off (RFC 5321 4.5.3.2.5)."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", client_timeout=1.0)
    client, _ = await ehlo(relay.port)
    got = [await client.cmd("MAIL FROM:<app@example.com>"), await client.cmd(f"RCPT TO:<{RCPT}>"),
           await client.cmd("DATA")]
    data = msg("X-Template: contract", "X-Dedupe-Key: T-5", body=b"line\r\n" * 5 + b"end")
    first_reply = asyncio.ensure_future(client.reply(wait_s=5.0))  # also catches a mid-DATA one
    with contextlib.suppress(ConnectionError):
        for index, line in enumerate(data.split(b"\r\n")[:-1]):  # ~1.3 s, silent <= 0.25 s
            await client.write(line + b"\r\n")
            if index % 2:
                await asyncio.sleep(0.25)
        await client.write(b".\r\n")
    got.append(await first_reply)
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    assert_relayed_unchanged(sink.handler.delivered[0], data)
    assert await state_of(relay, RCPT, "contract", "T-5") is State.SENT


# ------------------------------------------------------------------------------------------
# CR/LF injection in headers and envelope addresses (RFC 5321 section 2.3.8)
# ------------------------------------------------------------------------------------------


async def test_bare_cr_in_header_value_is_refused(each_newline_relay: Relay, sink: Sink) -> None:
    """X-Dedupe-Key: INV-9<CR>Bcc: ... gets 550 5.6.0; nothing upstream, no key."""
    relay = each_newline_relay
    data = msg("X-Template: invoice", b"X-Dedupe-Key: INV-9\rBcc: attacker@example.org")
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], data)
    await client.close()
    assert codes(got)[:3] == [250, 250, 354]
    assert got[-1] == str(replies.BARE_CR_OR_LF)
    assert sink.handler.transactions == 0
    assert await state_of(relay, RCPT, "invoice", "INV-9") is State.ABSENT
    assert await stored_keys(relay) == []


async def test_nul_in_message_is_refused(relay: Relay, sink: Sink) -> None:
    """A NUL octet in the message gets 550 5.6.0 and nothing reaches upstream."""
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], msg("X-Template: invoice", "X-Dedupe-Key: INV-9",
                                                body=b"nul\x00here"))
    await client.close()
    assert got[-1] == str(replies.NUL_IN_MESSAGE)
    assert sink.handler.transactions == 0
    assert await stored_keys(relay) == []


@pytest.mark.parametrize("rcpt", [
    b'RCPT TO:<"x\rRCPT TO:<attacker@example.org>"@example.com>',
    b"RCPT TO:<x\x00RCPT TO:<attacker@example.org>@example.com>",
    b"RCPT TO:<x\x0bRCPT TO:<attacker@example.org>@example.com>",
], ids=["CR-in-quoted-local-part", "NUL", "VT"])
async def test_control_character_in_rcpt_is_501(
    relay: Relay, sink: Sink, rcpt: bytes
) -> None:
    """A control character in a RCPT path gets 501 5.1.3; upstream never sees an extra RCPT."""
    client, _ = await ehlo(relay.port)
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250 ")
    assert await client.cmd(rcpt) == str(replies.BAD_RECIPIENT_SYNTAX)
    got = [await client.cmd(f"RCPT TO:<{RCPT}>"), await client.cmd("DATA")]
    await client.write(msg("X-Template: invoice", "X-Dedupe-Key: INV-9") + b".\r\n")
    got.append(await client.reply())
    await client.close()
    assert codes(got) == [250, 354, 250]
    assert sink.handler.rcpt_commands == [RCPT]
    assert [d.rcpt_tos for d in sink.handler.delivered] == [[RCPT]]


@pytest.mark.parametrize("lines", [
    b"RCPT TO:<a@example.net>\nRCPT TO:<attacker@example.org>\r\n",
    b"RCPT TO:<a@example.net>\r\r\n",
    b"RCPT TO:<a@example.net>\n",
], ids=["LF-between-commands", "CR-before-CRLF", "LF-only"])
async def test_bare_cr_or_lf_in_a_command_line_closes_with_421(
    each_newline_relay: Relay, sink: Sink, lines: bytes
) -> None:
    """A command line ends in CRLF only (RFC 5321 2.3.8): a bare LF, or a CR just before the
    CRLF, gets 421 and a close (a CR inside a path is the path check's 501, tested above).

    Read as two commands, the first line would add a recipient an application that strips
    only CRLF never meant to send to. Nothing of the transaction reaches upstream.
    """
    relay = each_newline_relay
    client, _ = await ehlo(relay.port)
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250 ")
    await client.write(lines)
    assert await client.reply() == str(replies.BARE_CR_OR_LF_IN_COMMAND)
    assert await closed_by_server(client)
    await client.close()
    assert sink.handler.transactions == 0 and sink.handler.rcpt_commands == []
    assert await stored_keys(relay) == []


async def test_an_over_long_command_line_ending_in_crlf_is_500_and_the_session_stays(
        relay: Relay) -> None:
    """1001+ octets then CRLF: 500 5.5.2 (too long, RFC 5321 4.5.3.1.4), not the bare-LF 421."""
    client, _ = await ehlo(relay.port)
    for length in (996, 2000, 5000):
        await client.write(b"EHLO " + b"h" * length + b"\r\n")
        assert (await client.reply()).startswith("500 5.5.2"), length
    assert (await client.cmd("NOOP")).startswith("250")
    await client.close()


async def test_an_over_long_command_line_ending_in_a_bare_lf_is_421(each_newline_relay: Relay,
                                                                    sink: Sink) -> None:
    """A long line hides a bare LF past the reader's limit: still 421 and a close, so the
    RCPT after it is not read as a command."""
    relay = each_newline_relay
    client, _ = await ehlo(relay.port)
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250 ")
    await client.write(b"NOOP " + b"x" * 3000 + b"\nRCPT TO:<attacker@example.org>\r\n")
    assert await client.reply() == str(replies.BARE_CR_OR_LF_IN_COMMAND)
    assert await closed_by_server(client)
    await client.close()
    assert sink.handler.rcpt_commands == []


async def test_lf_only_session_is_closed_at_its_first_command(each_newline_relay: Relay) -> None:
    """A client that ends its commands with LF only is told 421 at once, not left waiting."""
    relay = each_newline_relay
    client = await RawClient.connect(relay.port)  # the 220 greeting read
    await client.write(b"EHLO legacy.example.com\n")
    assert await client.reply() == str(replies.BARE_CR_OR_LF_IN_COMMAND)
    assert await closed_by_server(client)
    await client.close()


async def test_control_character_in_mail_from_is_501(relay: Relay, sink: Sink) -> None:
    """A CR in the MAIL FROM path gets 501 5.1.7; the injected RCPT never reaches upstream."""
    client, _ = await ehlo(relay.port)
    reply = await client.cmd(b"MAIL FROM:<a\rRCPT TO:<attacker@example.org>@example.com>")
    assert reply == str(replies.BAD_SENDER_SYNTAX)
    got = await transaction(client, [RCPT], msg("X-Template: invoice", "X-Dedupe-Key: INV-9"))
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    assert [m[0] for m in sink.handler.mail_commands] == ["app@example.com"]
    assert sink.handler.rcpt_commands == [RCPT]


async def test_injected_bcc_header_adds_no_recipient(relay: Relay, sink: Sink) -> None:
    """A real Bcc: header is relayed as sent, adds no envelope recipient, keys on INV-9 only."""
    data = msg("X-Template: invoice", "X-Dedupe-Key: INV-9", "Bcc: attacker@example.org",
               body=b"body")
    client, _ = await ehlo(relay.port)
    got = await transaction(client, [RCPT], data)
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    assert sink.handler.rcpt_commands == [RCPT]
    assert_relayed_unchanged(sink.handler.delivered[0], data)
    assert await state_of(relay, RCPT, "invoice", "INV-9") is State.SENT
    assert len(await stored_keys(relay)) == 1

