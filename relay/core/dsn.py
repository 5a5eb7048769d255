"""Delivery status notifications (RFC 3464) for mail the relay answered 250 and could not deliver.

When the upstream accepts a message for some recipients and refuses others permanently, the
client is answered ``250`` (its accepted recipients must not be retried), and from then on the
relay owes the envelope sender a non-delivery notification (RFC 5321 sections 4.2.5 and 6.1).
:func:`build_dsn` builds it with the stdlib ``email`` package: a ``multipart/report;
report-type=delivery-status`` with a human-readable part, a ``message/delivery-status`` part
(RFC 3464 section 2) and the original header section (``text/rfc822-headers``, RFC 6522; or
``message/global-headers`` when it holds UTF-8, RFC 6533). :class:`DsnSender` (a
:class:`~relay.core.interfaces.Notifier`) sends it from the null reverse path (RFC 5321 4.5.5,
so it never causes another notice) through the same upstream, in background tasks that shutdown
waits for. A notice the upstream refuses or cannot take is logged at ERROR and counted
(``relay_dsn_total{result="failed"}``); it is never retried, never notified about.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from email import policy as email_policy
from email.generator import BytesGenerator
from email.message import EmailMessage, Message
from email.utils import format_datetime, make_msgid
from typing import TypeAlias

from relay.core.address import mask_address
from relay.core.headers import header_section_end
from relay.core.interfaces import (
    DsnResult,
    Metrics,
    NonDelivery,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    Upstream,
)

log = logging.getLogger("relay.core.dsn")

_NOT_PRINTABLE = re.compile(r"[^\x20-\x7e]")
_Policy: TypeAlias = "email_policy.EmailPolicy[EmailMessage]"  # SMTP, or SMTPUTF8


def build_dsn(notice: NonDelivery, *, reporting_mta: str, arrival: float,
              remote_mta: str | None = None) -> OutboundMessage:
    """The RFC 3464 report on ``notice``, ready for the upstream: from ``<>`` to the sender.

    ``reporting_mta`` is this relay's host name; ``arrival`` the unix time in seconds the relay
    took the message (``Arrival-Date`` and ``Date``); ``remote_mta`` the upstream's host name,
    named for refusals that came from it. SMTPUTF8 is asked only for a non-ASCII sender, 8BITMIME
    only for a UTF-8 header section quoted back; everything else is ASCII.
    """
    utf8_sender = not notice.mail_from.isascii()
    pol = email_policy.SMTPUTF8 if utf8_sender else email_policy.SMTP
    report = EmailMessage(policy=pol)
    report["From"] = f"Mail Delivery System <MAILER-DAEMON@{reporting_mta}>"
    report["To"] = notice.mail_from
    report["Subject"] = "Undelivered Mail Returned to Sender"
    report["Date"] = format_datetime(datetime.fromtimestamp(arrival, tz=UTC))
    report["Message-ID"] = make_msgid(domain=reporting_mta)
    report["Auto-Submitted"] = "auto-replied"  # RFC 3834 section 5
    report["MIME-Version"] = "1.0"
    report["Content-Type"] = 'multipart/report; report-type="delivery-status"'
    report.attach(_human_part(notice, reporting_mta, pol))
    report.attach(_status_part(notice, reporting_mta, arrival, remote_mta, pol))
    headers = _headers_part(notice.content, notice.header_end, pol)
    report.attach(headers)
    out = io.BytesIO()
    _ReportGenerator(out, policy=pol).flatten(report)
    return OutboundMessage(
        mail_from="", rcpt_tos=[notice.mail_from], content=out.getvalue(),
        smtputf8=utf8_sender, utf8_headers=utf8_sender,
        eight_bit=headers.get_content_type() == "message/global-headers")


def _human_part(notice: NonDelivery, reporting_mta: str,
                pol: _Policy) -> EmailMessage:
    """The text/plain part: what happened, in words (RFC 3464 section 2, first part)."""
    lines = [f"This is the mail relay at {reporting_mta}.", "",
             "Your message was delivered to some of its recipients, but the next mail server",
             "refused the recipients below permanently. The relay will not try them again.", ""]
    lines += [f"<{rcpt}>: {_reply_text(r)}" for rcpt, r in notice.failures.items()]
    if notice.queue_id:
        lines += ["", f"Relay queue id: {notice.queue_id}"]
    lines += ["", "The delivery report and the header section of your message are attached.", ""]
    body = "\n".join(lines)
    part = EmailMessage(policy=pol)
    part.set_content(body, cte="7bit" if body.isascii() else "quoted-printable")
    del part["MIME-Version"]  # set_content adds it; only the report's own header needs it
    return part


def _status_part(notice: NonDelivery, reporting_mta: str, arrival: float,
                 remote_mta: str | None, pol: _Policy) -> EmailMessage:
    """The message/delivery-status part: one per-message block, one block per recipient."""
    per_message = Message(policy=pol)
    per_message["Reporting-MTA"] = f"dns; {reporting_mta}"
    per_message["Arrival-Date"] = format_datetime(datetime.fromtimestamp(arrival, tz=UTC))
    blocks: list[Message | str] = [per_message]
    for rcpt, result in notice.failures.items():
        block = Message(policy=pol)
        block["Final-Recipient"] = _address_field(rcpt)
        block["Action"] = "failed"
        block["Status"] = status_code(result)
        if result.from_upstream:  # a reply the relay made itself is no remote diagnostic
            if remote_mta is not None:
                block["Remote-MTA"] = f"dns; {remote_mta}"
            block["Diagnostic-Code"] = f"smtp; {_reply_text(result)}"
        blocks.append(block)
    part = EmailMessage(policy=pol)
    part["Content-Type"] = "message/delivery-status"
    part.set_payload(blocks)
    return part


def _headers_part(content: bytes, header_end: int | None, pol: _Policy) -> EmailMessage:
    """The original header section: text/rfc822-headers (RFC 6522 section 4), or
    message/global-headers with 8bit when it holds UTF-8 (RFC 6533). The section ends where the
    fingerprint's does (:func:`relay.core.headers.header_section_end`: the first empty line or
    the first line that cannot be a field), so no body text is quoted back; bytes that are not
    UTF-8 become U+FFFD. ``header_end``: where the section ends, when the caller knows."""
    section = content[: header_section_end(content) if header_end is None else header_end]
    if not section.isascii():
        section = section.decode("utf-8", "replace").encode("utf-8")
    if not section.endswith(b"\r\n"):
        section += b"\r\n"
    part = EmailMessage(policy=pol)
    if section.isascii():
        part["Content-Type"] = "text/rfc822-headers"
    else:
        part["Content-Type"] = "message/global-headers"
        part["Content-Transfer-Encoding"] = "8bit"
    part.set_payload(section.decode("ascii", "surrogateescape"))  # bytes kept as they came
    return part


def status_code(result: RcptResult) -> str:
    """The RFC 3463 status of a permanent refusal: the reply's own 5.x.x
    (:attr:`SmtpReply.stated_enhanced`), else ``5.0.0``."""
    enhanced = result.reply.stated_enhanced
    return enhanced if enhanced is not None and enhanced.startswith("5") else "5.0.0"


def _reply_text(result: RcptResult) -> str:
    """The refusal as one line of printable ASCII (``550 5.1.1 User unknown``)."""
    return _NOT_PRINTABLE.sub("?", str(result.reply))


def _address_field(address: str) -> str:
    """``rfc822; a@b``, or for a non-ASCII address ``utf-8; `` and its utf-8-addr-xtext
    (RFC 6533 section 3), so the report stays ASCII."""
    if address.isascii():
        return f"rfc822; {address}"
    xtext = "".join(c if "!" <= c <= "~" and c not in "+=\\" else f"\\x{{{ord(c):X}}}"
                    for c in address)
    return f"utf-8; {xtext}"


class _ReportGenerator(BytesGenerator):
    """BytesGenerator that writes a message/global-headers payload byte for byte, as it does
    for text (the stdlib treats every message/* type as an embedded message)."""

    def _handle_message_global_headers(self, msg: Message) -> None:
        self._handle_text(msg)  # type: ignore[attr-defined]  # stdlib's own text handler


class DsnSender:
    """Implements :class:`relay.core.interfaces.Notifier`: RFC 3464 notices through ``upstream``.

    ``reporting_mta`` is this relay's host name, ``remote_mta`` the upstream's (``None`` for a
    Maildir); ``log_addresses`` shows senders unmasked in logs. ``background`` holds the sends
    still running; shutdown waits for them before closing the upstream.
    """

    def __init__(self, *, upstream: Upstream, metrics: Metrics, reporting_mta: str,
                 remote_mta: str | None = None, log_addresses: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self._upstream = upstream
        self._metrics = metrics
        self._reporting_mta = reporting_mta
        self._remote_mta = remote_mta
        self._show = (lambda a: a) if log_addresses else mask_address
        self._clock = clock
        self.background: set[asyncio.Task[None]] = set()

    def non_delivery(self, notice: NonDelivery) -> None:
        """Send ``notice`` in the background; nothing for the null sender or no failure."""
        if not notice.mail_from or not notice.failures:
            return
        task = asyncio.create_task(self._send(notice, self._clock()),
                                   name=f"dsn-{notice.queue_id}")
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _send(self, notice: NonDelivery, arrival: float) -> None:
        """Build and deliver one notice; log and count what became of it, never raise."""
        extra = {"queue_id": notice.queue_id, "sender": self._show(notice.mail_from)}
        try:
            dsn = build_dsn(notice, reporting_mta=self._reporting_mta, arrival=arrival,
                            remote_mta=self._remote_mta)
            result = await self._upstream.deliver(dsn)
        except asyncio.CancelledError:
            log.error("DSN to the sender cut by shutdown: not sent", extra=extra)
            self._metrics.dsn(DsnResult.FAILED)
            raise
        except Exception:  # a bug here must not become an unretrieved task error
            log.exception("DSN to the sender could not be built or sent", extra=extra)
            self._metrics.dsn(DsnResult.FAILED)
            return
        outcome = result.recipients.get(notice.mail_from)
        if outcome is not None and outcome.status is RcptStatus.ACCEPTED:
            log.info("DSN sent to the sender for %d refused recipient(s)",
                     len(notice.failures), extra=extra)
            self._metrics.dsn(DsnResult.SENT)
            return
        reason = str(outcome.reply) if outcome is not None else "no result"
        log.error("DSN to the sender not delivered: %s", reason, extra=extra)
        self._metrics.dsn(DsnResult.FAILED)
