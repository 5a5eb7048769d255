"""Fit a message to what the upstream's EHLO offers (RFC 6531, RFC 6152, RFC 1870). Pure.

The relay never converts content: 8-bit content needs 8BITMIME at the upstream. SMTPUTF8 is
asked for only when the message needs it; without it upstream, addresses whose only non-ASCII
part is the domain go as A-labels (RFC 6531 section 3.2); a non-ASCII local part or UTF-8 in
the header section cannot be downgraded (RFC 6530), and the message is refused permanently.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from relay.core import replies
from relay.core.errors import InvalidAddressError
from relay.core.interfaces import OutboundMessage, SmtpReply
from relay.core.recipients import ascii_address


@dataclass(frozen=True)
class WireEnvelope:
    """What goes on the upstream's command lines: MAIL FROM, RCPT TO per recipient, options.

    ``rcpt_to`` maps each recipient of the message to the address written on the wire.
    ``smtputf8`` tells whether the addresses are sent as UTF-8.
    """

    mail_from: str
    rcpt_to: dict[str, str]
    options: list[str]
    smtputf8: bool


def negotiate(message: OutboundMessage, extensions: Collection[str]) -> WireEnvelope | SmtpReply:
    """Return the wire envelope for ``message``, or the refusal when it cannot go upstream.

    ``extensions`` are the upstream's EHLO keywords in lower case (empty after HELO).
    Refusals: ``554 5.6.3`` (8-bit content, no 8BITMIME), ``550 5.6.7`` (needs SMTPUTF8).
    """
    mail_from = message.mail_from
    rcpt_to = {r: r for r in message.rcpt_tos}
    smtputf8 = message.smtputf8
    if smtputf8 and "smtputf8" not in extensions:
        if message.utf8_headers:
            return replies.UPSTREAM_NO_SMTPUTF8
        try:
            mail_from = ascii_address(mail_from)
            rcpt_to = {r: ascii_address(r) for r in message.rcpt_tos}
        except InvalidAddressError:
            return replies.UPSTREAM_NO_SMTPUTF8
        smtputf8 = False
    if message.eight_bit and "8bitmime" not in extensions:
        return replies.UPSTREAM_NO_8BITMIME
    options = []
    if smtputf8:
        options.append("SMTPUTF8")
    if message.eight_bit:
        options.append("BODY=8BITMIME")
    if "size" in extensions:
        options.append(f"SIZE={len(message.content)}")
    return WireEnvelope(mail_from=mail_from, rcpt_to=rcpt_to, options=options, smtputf8=smtputf8)
