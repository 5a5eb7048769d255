"""Delivery status notifications (RFC 3461/3464) for recipients refused permanently after the
relay answered 250 (RFC 5321 sections 4.2.5 and 6.1): real relay, real Redis, real aiosmtpd sink.
"""

from __future__ import annotations

import asyncio
import email
import logging
from collections import deque
from email import policy
from email.message import EmailMessage

import pytest

from relay.app import Relay
from relay.core.dsn import build_dsn
from relay.core.interfaces import NonDelivery, RcptResult, RcptStatus, SmtpReply
from tests.support.clients import message, send
from tests.support.relays import MakeRelay
from tests.support.sink import Delivered, Sink
from tests.support.waiting import until

SENDER = "app@example.com"
RCPTS = ["a@example.net", "b@example.net"]


async def wait_for_deliveries(sink: Sink, count: int, timeout_s: float = 10.0) -> None:
    """Wait until the sink accepted ``count`` messages (fails the test after ``timeout_s``)."""
    for _ in range(int(timeout_s / 0.02)):
        if len(sink.handler.delivered) >= count:
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"the sink got {len(sink.handler.delivered)} message(s), not {count}")


def parse(delivered: Delivered) -> EmailMessage:
    """The delivered bytes as a MIME message."""
    parsed = email.message_from_bytes(delivered.content, policy=policy.default)
    assert isinstance(parsed, EmailMessage)
    return parsed


def status_blocks(report: EmailMessage) -> list[EmailMessage]:
    """The per-message block and the per-recipient blocks of a multipart/report."""
    part = next(p for p in report.iter_parts() if p.get_content_type() == "message/delivery-status")
    blocks = part.get_payload()
    assert isinstance(blocks, list) and all(isinstance(b, EmailMessage) for b in blocks)
    return [b for b in blocks if isinstance(b, EmailMessage)]


def dsn_count(relay: Relay, result: str) -> float | None:
    """``relay_dsn_total{result}``."""
    return relay.registry.get_sample_value("relay_dsn_total", {"result": result})


def refuse_b(sink: Sink) -> None:
    """The sink refuses b@example.net with 550 5.1.1 (twice, for a retry)."""
    sink.handler.rcpt_plan["b@example.net"] = deque(["550 5.1.1 User unknown"] * 2)


# -- end to end --------------------------------------------------------------------------------


async def test_partial_permanent_refusal_sends_a_dsn_to_the_sender(
        relay: Relay, sink: Sink) -> None:
    """A 250 with one recipient refused 550 5.1.1 sends the sender an RFC 3464 DSN from <>."""
    refuse_b(sink)
    result = await send(relay.port, RCPTS, message(), mail_from=SENDER)
    assert result.code == 250 and "refused permanently 1" in result.text
    await wait_for_deliveries(sink, 2)
    original, dsn = sink.handler.delivered
    assert original.rcpt_tos == ["a@example.net"]
    assert (dsn.mail_from, dsn.rcpt_tos) == ("<>", [SENDER])  # aiosmtpd's null reverse path
    report = parse(dsn)
    assert report.get_content_type() == "multipart/report"
    assert report.get_param("report-type") == "delivery-status"
    assert report["To"] == SENDER and report["Auto-Submitted"] == "auto-replied"
    kinds = [p.get_content_type() for p in report.iter_parts()]
    assert kinds == ["text/plain", "message/delivery-status", "text/rfc822-headers"]
    per_message, per_rcpt = status_blocks(report)
    assert per_message["Reporting-MTA"] == "dns; relay.test"
    assert per_message["Arrival-Date"]
    assert per_rcpt["Final-Recipient"] == "rfc822; b@example.net"
    assert per_rcpt["Action"] == "failed"
    assert per_rcpt["Status"] == "5.1.1"
    assert per_rcpt["Diagnostic-Code"] == "smtp; 550 5.1.1 User unknown"
    headers = next(p for p in report.iter_parts()
                   if p.get_content_type() == "text/rfc822-headers").get_payload()
    assert "X-Dedupe-Key: K-1" in headers and "Subject: test" in headers
    assert "hello" not in headers  # the header section only, not the body
    # the sink holds the DSN once its DATA is answered; the relay counts it once it read that
    await until(lambda: dsn_count(relay, "sent") == 1.0, what="the DSN counted sent")
    assert dsn_count(relay, "failed") == 0.0


async def test_message_without_key_partly_refused_gets_a_dsn(relay: Relay, sink: Sink) -> None:
    """A message without a dedupe key, answered 250 with one recipient refused, gets a DSN too."""
    refuse_b(sink)
    result = await send(relay.port, RCPTS, message(key=None), mail_from=SENDER)
    assert result.code == 250
    await wait_for_deliveries(sink, 2)
    assert sink.handler.delivered[1].rcpt_tos == [SENDER]
    _, per_rcpt = status_blocks(parse(sink.handler.delivered[1]))
    assert per_rcpt["Final-Recipient"] == "rfc822; b@example.net"


async def test_null_sender_message_gets_no_dsn(relay: Relay, sink: Sink) -> None:
    """A message from the null sender <> partly refused gets no DSN (no notice about a notice)."""
    refuse_b(sink)
    result = await send(relay.port, RCPTS, message(), mail_from="")
    assert result.code == 250
    await relay.stop()  # waits for anything still in the background
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["a@example.net"]]
    assert dsn_count(relay, "sent") == 0.0


async def test_whole_message_refused_gets_no_dsn(relay: Relay, sink: Sink) -> None:
    """When every recipient is refused the client gets the 5yz and no DSN is sent."""
    refuse_b(sink)
    result = await send(relay.port, ["b@example.net"], message(), mail_from=SENDER)
    assert result.code == 550
    await relay.stop()
    assert sink.handler.delivered == []
    assert dsn_count(relay, "sent") == 0.0


async def test_dsn_can_be_turned_off(make_relay: MakeRelay, sink: Sink) -> None:
    """With dsn_on_partial_failure = false a partly refused message gets no DSN."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", dsn_on_partial_failure=False)
    refuse_b(sink)
    assert (await send(relay.port, RCPTS, message(), mail_from=SENDER)).code == 250
    await relay.stop()
    assert len(sink.handler.delivered) == 1


async def test_dsn_the_upstream_refuses_is_logged_and_counted(
        relay: Relay, sink: Sink, caplog: pytest.LogCaptureFixture) -> None:
    """A DSN the upstream refuses is logged at ERROR and counted failed; the client saw 250."""
    refuse_b(sink)
    sink.handler.rcpt_plan[SENDER] = deque(["550 5.1.1 No such sender mailbox"])
    with caplog.at_level(logging.ERROR, logger="relay.core.dsn"):
        assert (await send(relay.port, RCPTS, message(), mail_from=SENDER)).code == 250
        await relay.stop()
    assert dsn_count(relay, "failed") == 1.0 and dsn_count(relay, "sent") == 0.0
    assert any("5.1.1" in r.getMessage() for r in caplog.records if r.name == "relay.core.dsn")
    assert len(sink.handler.delivered) == 1


async def test_shutdown_waits_for_a_dsn_in_flight(make_relay: MakeRelay, sink: Sink) -> None:
    """A DSN still being sent when the relay stops is delivered before the upstream closes."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", shutdown_grace=10.0)
    refuse_b(sink)
    sink.handler.delay_s = 0.5  # every DATA reply, so the DSN is still going out at stop
    assert (await send(relay.port, RCPTS, message(), mail_from=SENDER)).code == 250
    await relay.stop()
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["a@example.net"], [SENDER]]


# -- the report itself -------------------------------------------------------------------------


def notice(failures: dict[str, RcptResult], *, content: bytes = b"Subject: s\r\n\r\nbody\r\n",
           mail_from: str = SENDER) -> NonDelivery:
    """A NonDelivery for ``failures``."""
    return NonDelivery(mail_from=mail_from, failures=failures, content=content, queue_id="Q1")


def refused(code: int, text: str, *, from_upstream: bool = True) -> RcptResult:
    """A refusal with the given reply."""
    return RcptResult(RcptStatus.REFUSED, SmtpReply.parse(code, text), from_upstream=from_upstream)


def test_reply_without_enhanced_code_gives_status_5_0_0() -> None:
    """An upstream refusal without an RFC 3463 code is reported as Status 5.0.0."""
    built = build_dsn(notice({"b@x.example": refused(550, "no such user")}),
                      reporting_mta="relay.test", arrival=0.0)
    _, per_rcpt = status_blocks(email.message_from_bytes(built.content, policy=policy.default))
    assert per_rcpt["Status"] == "5.0.0"
    assert per_rcpt["Diagnostic-Code"] == "smtp; 550 no such user"


@pytest.mark.parametrize("text", ["5.1.1\tUser unknown", "5.1.1\n5.1.1 User unknown"],
                         ids=["tab-after-the-code", "multiline-reply-first-line-only-the-code"])
def test_the_status_is_the_upstreams_whatever_blank_follows_its_code(text: str) -> None:
    """aiosmtplib keeps a tab inside a line and joins the lines of a multiline reply
    (``550-5.1.1`` CRLF ``550 5.1.1 User unknown``) with a line break: the notice's Status is
    the upstream's code either way (RFC 3464 section 2.3.4)."""
    built = build_dsn(notice({"b@x.example": refused(550, text)}),
                      reporting_mta="relay.test", arrival=0.0)
    _, per_rcpt = status_blocks(email.message_from_bytes(built.content, policy=policy.default))
    assert per_rcpt["Status"] == "5.1.1"


def test_relay_own_refusal_has_no_diagnostic_code() -> None:
    """A refusal the relay made itself carries no Diagnostic-Code (that field is the remote's)."""
    built = build_dsn(notice({"b@x.example": refused(550, "5.6.7 cannot downgrade",
                                                     from_upstream=False)}),
                      reporting_mta="relay.test", arrival=0.0, remote_mta="mx.example")
    _, per_rcpt = status_blocks(email.message_from_bytes(built.content, policy=policy.default))
    assert per_rcpt["Status"] == "5.6.7"
    assert per_rcpt["Diagnostic-Code"] is None and per_rcpt["Remote-MTA"] is None


def test_each_refused_recipient_has_its_own_block() -> None:
    """Two refused recipients give two per-recipient blocks, each with its own status."""
    built = build_dsn(notice({"b@x.example": refused(550, "5.1.1 unknown"),
                              "c@x.example": refused(552, "5.2.2 mailbox full")}),
                      reporting_mta="relay.test", arrival=0.0, remote_mta="mx.example")
    blocks = status_blocks(email.message_from_bytes(built.content, policy=policy.default))
    assert [(b["Final-Recipient"], b["Status"], b["Remote-MTA"]) for b in blocks[1:]] == [
        ("rfc822; b@x.example", "5.1.1", "dns; mx.example"),
        ("rfc822; c@x.example", "5.2.2", "dns; mx.example")]


def test_non_ascii_recipient_is_utf8_xtext() -> None:
    """A non-ASCII recipient is named as utf-8 xtext (RFC 6533 section 3), the report ASCII."""
    built = build_dsn(notice({"jörg+x@bücher.example": refused(550, "5.1.1 unknown")}),
                      reporting_mta="relay.test", arrival=0.0)
    _, per_rcpt = status_blocks(email.message_from_bytes(built.content, policy=policy.default))
    assert per_rcpt["Final-Recipient"] == r"utf-8; j\x{F6}rg\x{2B}x@b\x{FC}cher.example"
    assert built.content.isascii() and not built.smtputf8 and not built.eight_bit


def test_utf8_header_section_is_quoted_as_global_headers() -> None:
    """A header section holding UTF-8 is quoted byte for byte as message/global-headers."""
    content = "Subject: Grüße\r\n\r\nbody\r\n".encode()
    built = build_dsn(notice({"b@x.example": refused(550, "5.1.1 unknown")}, content=content),
                      reporting_mta="relay.test", arrival=0.0)
    assert "Subject: Grüße\r\n".encode() in built.content and built.eight_bit
    parsed = email.message_from_bytes(built.content, policy=policy.default)
    assert [p.get_content_type() for p in parsed.iter_parts()][2] == "message/global-headers"


def test_non_ascii_sender_is_sent_with_smtputf8() -> None:
    """A DSN to a non-ASCII sender needs SMTPUTF8 (its To: field holds UTF-8)."""
    built = build_dsn(notice({"b@x.example": refused(550, "5.1.1 unknown")},
                             mail_from="jörg@bücher.example"),
                      reporting_mta="relay.test", arrival=0.0)
    assert built.smtputf8 and built.utf8_headers
    assert "To: jörg@bücher.example\r\n".encode() in built.content


def test_a_body_without_the_empty_line_is_never_quoted_as_header() -> None:
    """A message whose body starts without the empty line: the notice quotes the header
    fields only, never the body text (it holds what the sender wrote to the customer)."""
    content = (b"X-Dedupe-Key: d3\r\nSubject: x\r\nDear customer, card 4111 1111\r\n"
               b"Regards\r\n")
    built = build_dsn(notice({"b@x.example": refused(550, "5.1.1 unknown")}, content=content),
                      reporting_mta="relay.test", arrival=0.0)
    assert b"Subject: x\r\n" in built.content
    assert b"Dear customer" not in built.content and b"Regards" not in built.content


def test_header_bytes_that_are_not_utf8_do_not_make_a_false_global_headers_part() -> None:
    """A header byte that is not UTF-8 is replaced, so the global-headers part is UTF-8."""
    content = b"X-Odd: caf\xe9\r\nSubject: s\r\n\r\nbody\r\n"
    built = build_dsn(notice({"b@x.example": refused(550, "5.1.1 unknown")}, content=content),
                      reporting_mta="relay.test", arrival=0.0)
    assert b"caf\xe9" not in built.content
    assert "X-Odd: caf\ufffd\r\n".encode() in built.content


def test_the_report_comes_from_the_relays_mailer_daemon() -> None:
    """The DSN's From: is one well-formed address, MAILER-DAEMON at the reporting MTA (RFC
    3464 section 2: the report is from the reporting MTA, not from the sender)."""
    built = build_dsn(notice({"b@x.example": refused(550, "5.1.1 unknown")}),
                      reporting_mta="relay.test", arrival=0.0)
    report = email.message_from_bytes(built.content, policy=policy.default)
    assert b"\r\nFrom: Mail Delivery System <MAILER-DAEMON@relay.test>\r\n" in (
        b"\r\n" + built.content)
    sender = report["From"]
    assert len(sender.addresses) == 1 and not sender.defects
    assert sender.addresses[0].addr_spec == "MAILER-DAEMON@relay.test"
    assert sender.addresses[0].display_name == "Mail Delivery System"
