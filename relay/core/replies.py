"""Every SMTP reply the relay gives, with its RFC 3463 enhanced status code, in one catalogue.

Tests compare against these constants rather than string literals. Replies that carry dynamic
text (counts, upstream text) are built by the small functions at the end of this module.

Sources: RFC 5321 section 4.2 (reply codes), RFC 3463 (enhanced status codes), RFC 2034
(every reply but the greeting and the EHLO/HELO response carries an enhanced code),
RFC 6531 (SMTPUTF8: 5.6.7), RFC 1870 (SIZE: 5.3.4), RFC 6152 (8BITMIME: 5.6.3).
"""

from __future__ import annotations

import math
import re

from relay.core.interfaces import SmtpReply

# --- envelope ---------------------------------------------------------------------------------
SENDER_OK = SmtpReply(250, "2.1.0", "Sender OK")
RECIPIENT_OK = SmtpReply(250, "2.1.5", "Recipient OK")
BAD_SENDER_SYNTAX = SmtpReply(501, "5.1.7", "Bad sender address syntax")
BAD_RECIPIENT_SYNTAX = SmtpReply(501, "5.1.3", "Bad recipient address syntax")
PATH_NEEDS_BRACKETS = SmtpReply(
    501, "5.5.4", "Syntax: address must be enclosed in <> (RFC 5321 4.1.2)"
)
BAD_RECIPIENT_ADDRESS = SmtpReply(553, "5.1.3", "Recipient address cannot be normalized")
NON_ASCII_WITHOUT_SMTPUTF8 = SmtpReply(
    553, "5.6.7", "Non-ASCII address requires MAIL FROM ... SMTPUTF8 (RFC 6531)"
)
INVALID_UTF8 = SmtpReply(501, "5.5.2", "Address is not valid UTF-8")
TOO_MANY_RECIPIENTS = SmtpReply(452, "4.5.3", "Too many recipients")

# --- message ----------------------------------------------------------------------------------
BARE_CR_OR_LF = SmtpReply(550, "5.6.0", "Message contains a bare CR or LF (RFC 5322 2.3)")
NUL_IN_MESSAGE = SmtpReply(550, "5.6.0", "Message contains a NUL octet (RFC 5322 2.3)")
LINE_TOO_LONG = SmtpReply(500, "5.5.2", "Line too long (RFC 5321 4.5.3.1.6)")
BARE_CR_OR_LF_IN_COMMAND = SmtpReply(
    421, "4.5.0", "Command line with a bare CR or LF (RFC 5321 2.3.8), closing connection")
# BDAT (RFC 3030) when CHUNKING is not offered: its chunk follows at once and must never be
# read as commands, so the connection closes (as Postfix answers with CHUNKING off)
BDAT_NOT_IMPLEMENTED = SmtpReply(
    521, "5.5.1", "BDAT not implemented (no CHUNKING, RFC 3030): send with DATA; closing "
    "connection")
MESSAGE_TOO_BIG = SmtpReply(552, "5.3.4", "Message size exceeds fixed maximum message size")
MISSING_KEY_REJECTED = SmtpReply(554, "5.6.0", "Message has no dedupe key header (policy: reject)")
# key_reuse = reject (design.md §4.9): RFC 5321 section 4.3.2 lists 550 after DATA for a policy
# refusal, RFC 3463 X.7.1 "delivery not authorized, message refused"
KEY_REUSED = SmtpReply(
    550, "5.7.1", "Dedupe key already used for other content; not sent (policy: key_reuse "
    "reject)")

# --- temporary outcomes -----------------------------------------------------------------------
STORE_DOWN = SmtpReply(451, "4.3.0", "Deduplication store unavailable, try again later")
# ledger_required = true and the audit ledger cannot take rows (design.md §6.7): nothing reserved
LEDGER_UNAVAILABLE = SmtpReply(451, "4.3.0", "Audit ledger unavailable, try again later")
OUTCOME_UNKNOWN = SmtpReply(
    451, "4.4.2", "Upstream did not confirm the message; it is held as in doubt, try again later"
)
HELD_UNKNOWN = SmtpReply(
    451, "4.4.2", "An earlier attempt of this message is in doubt (policy: hold), try again later"
)
INFLIGHT = SmtpReply(450, "4.2.0", "The same message is being relayed by another attempt, retry")
UPSTREAM_UNREACHABLE = SmtpReply(451, "4.4.1", "Upstream unreachable, try again later")
UPSTREAM_TIMEOUT = SmtpReply(451, "4.4.2", "Upstream timed out, try again later")
UPSTREAM_LOST = SmtpReply(451, "4.4.2", "Upstream connection lost, try again later")
UPSTREAM_AUTH_FAILED = SmtpReply(451, "4.7.0", "Relay cannot authenticate to its upstream")
UPSTREAM_NO_SMTPUTF8 = SmtpReply(550, "5.6.7", "Upstream does not support SMTPUTF8 (RFC 6531)")
UPSTREAM_NO_8BITMIME = SmtpReply(554, "5.6.3", "Upstream does not accept 8-bit data (RFC 6152)")
UPSTREAM_PROTOCOL_ERROR = SmtpReply(451, "4.5.0", "Upstream protocol error, try again later")
INTERNAL_ERROR = SmtpReply(451, "4.3.0", "Internal error, try again later")
RESERVATION_LOST = SmtpReply(
    451, "4.3.0", "The reservation of this message lapsed before the final dot; nothing was sent, "
    "try again later"
)
CUT_BY_SHUTDOWN = SmtpReply(
    451, "4.3.2", "Relay shut down before the upstream took the message, try again later"
)
SHUTTING_DOWN = SmtpReply(421, "4.3.2", "Service shutting down, try again later")
CLIENT_TIMEOUT = SmtpReply(421, "4.4.2", "Timeout, closing connection")
DATA_DEADLINE = SmtpReply(421, "4.4.2", "Message data took too long, closing connection")
SESSION_TOO_LONG = SmtpReply(421, "4.4.2", "Session lifetime reached, closing connection")
TOO_MANY_IDLE_COMMANDS = SmtpReply(
    421, "4.7.0", "Too many commands without a message, closing connection")

# --- access -----------------------------------------------------------------------------------
CLIENT_NOT_ALLOWED = SmtpReply(421, "4.7.0", "Client address not allowed, closing connection")
TOO_MANY_CONNECTIONS = SmtpReply(421, "4.7.0", "Too many connections, try again later")
TOO_MANY_CONNECTIONS_FROM_HOST = SmtpReply(
    421, "4.7.0", "Too many connections from your address, try again later"
)
AUTH_NOT_AVAILABLE = SmtpReply(502, "5.5.1", "Authentication not available")
SENDER_NOT_ALLOWED = SmtpReply(550, "5.7.1", "Sender address not allowed to relay")

# --- session ----------------------------------------------------------------------------------
NO_ENHANCED_CODE = frozenset({220, 334, 354})

# Default enhanced code per reply code, for replies built by aiosmtpd without one (RFC 3463).
DEFAULT_ENHANCED: dict[int, str] = {
    211: "2.0.0",
    214: "2.0.0",
    221: "2.0.0",
    235: "2.7.0",
    250: "2.0.0",
    251: "2.1.5",
    252: "2.0.0",
    421: "4.3.0",
    450: "4.2.0",
    451: "4.3.0",
    452: "4.3.1",
    454: "4.7.0",
    500: "5.5.2",
    501: "5.5.4",
    502: "5.5.1",
    503: "5.5.1",
    504: "5.5.4",
    530: "5.7.0",
    534: "5.7.9",
    535: "5.7.8",
    538: "5.7.11",
    550: "5.0.0",
    551: "5.1.6",
    552: "5.3.4",
    553: "5.1.3",
    554: "5.0.0",
    555: "5.5.4",
}

_ENHANCED_RE = re.compile(r"^[245]\.\d{1,3}\.\d{1,3}(?: |$)")
_STATUS_RE = re.compile(r"^(\d{3})([ -])(.*)$", re.DOTALL)
_UNRECOGNIZED_RE = re.compile(r"not recognized|not implemented", re.IGNORECASE)


def with_enhanced_code(status: str) -> str:
    """Return the reply line ``status`` with an RFC 3463 enhanced code inserted if it has none.

    ``status`` is one reply line such as ``"503 Error: need RCPT command"``. Lines without a
    three-digit code, and codes excluded by RFC 2034 section 3 (220 greeting, 334 AUTH
    challenge, 354 go-ahead) are returned unchanged. "Command not recognized" replies get
    ``5.5.1`` (invalid command) rather than the 500 default ``5.5.2`` (syntax error).
    """
    match = _STATUS_RE.match(status)
    if match is None:
        return status
    code = int(match.group(1))
    sep, text = match.group(2), match.group(3)
    if code in NO_ENHANCED_CODE or _ENHANCED_RE.match(text):
        return status
    enhanced = DEFAULT_ENHANCED.get(code, f"{code // 100}.0.0")
    if code in (500, 502) and _UNRECOGNIZED_RE.search(text):
        enhanced = "5.5.1"
    return f"{code}{sep}{enhanced} {text}".rstrip()


_PRINTABLE_RE = re.compile(r"[^\x20-\x7e]+")


def client_safe_text(text: str, *, limit: int = 200) -> str:
    """Flatten an upstream reply ``text`` to one printable ASCII line of at most ``limit`` chars."""
    return _PRINTABLE_RE.sub(" ", text).strip()[:limit]


def enhanced_of(reply: SmtpReply) -> str | None:
    """Return the enhanced status code of ``reply`` (``"4.2.1"``), or None: ``reply.enhanced``."""
    return reply.enhanced


def pass_through(reply: SmtpReply) -> SmtpReply:
    """Turn an upstream refusal into the reply for our client (design.md §4.2).

    ``421`` becomes ``451`` (the upstream closing its connection says nothing about ours);
    the upstream's enhanced code is kept when its class matches, else ``X.0.0`` is used;
    the text is flattened to one printable line and prefixed with ``upstream:``.
    """
    if not 400 <= reply.code < 600:  # only refusals pass; anything else is a protocol error
        return UPSTREAM_PROTOCOL_ERROR
    code = 451 if reply.code == 421 else reply.code
    enhanced = reply.enhanced
    # a multi-line reply repeats its enhanced code on every line (RFC 2034 section 3)
    text = " ".join(_ENHANCED_RE.sub("", line, count=1).strip()
                    for line in reply.text.splitlines())
    if enhanced is None or enhanced[0] != str(code)[0]:
        enhanced = DEFAULT_ENHANCED.get(code, f"{code // 100}.0.0")
    return SmtpReply(code, enhanced, f"upstream: {client_safe_text(text)}".rstrip())


def accepted(relayed: int, suppressed: int, refused: int, queue_id: str,
             in_doubt: int = 0) -> SmtpReply:
    """The ``250`` for a message with at least one recipient relayed (counts in the text).

    ``in_doubt`` of the ``suppressed`` were suppressed because an earlier attempt is in doubt
    (UNKNOWN, ``unknown_policy = suppress``): the text says so, so a client or a log reader can
    tell them from true duplicates.
    """
    parts = [f"relayed {relayed}"]
    if suppressed:
        doubt = f" ({in_doubt} in doubt)" if in_doubt else ""
        parts.append(f"suppressed {suppressed} duplicate(s){doubt}")
    if refused:
        parts.append(f"refused permanently {refused}")
    return SmtpReply(250, "2.0.0", f"Ok: {', '.join(parts)}; id={queue_id}")


def all_suppressed(count: int, first_sent_iso: str | None, queue_id: str,
                   in_doubt: int = 0) -> SmtpReply:
    """The ``250`` for a message whose every recipient is a duplicate (design.md §4.3).

    When ``in_doubt`` of them are suppressed because an earlier attempt is in doubt, the text
    says "in doubt" instead of claiming the original went.
    """
    if in_doubt:
        since = f" since {first_sent_iso}" if first_sent_iso else ""
        return SmtpReply(250, "2.0.0", f"Ok: duplicate suppressed for {count} recipient(s); "
                                       f"{in_doubt} in doubt{since}; id={queue_id}")
    when = f"; original sent {first_sent_iso}" if first_sent_iso else ""
    return SmtpReply(
        250, "2.0.0", f"Ok: duplicate suppressed for {count} recipient(s){when}; id={queue_id}"
    )


def duplicate_refused(count: int, first_sent_iso: str | None, queue_id: str,
                      in_doubt: int = 0) -> SmtpReply:
    """The ``550 5.7.1`` for a message whose every recipient is a duplicate, when its policy's
    ``duplicate_reply`` is ``"550"``: a refusal for policy reasons at the final dot (RFC 5321
    section 4.3.2 lists 550 after DATA; RFC 3463 X.7.1, "message refused"). The client's MTA
    then bounces it or its caller sees the error; nothing was relayed by this transaction.
    """
    if in_doubt:
        since = f" since {first_sent_iso}" if first_sent_iso else ""
        return SmtpReply(550, "5.7.1", f"Duplicate not sent again for {count} recipient(s): "
                                       f"{in_doubt} in doubt{since}; id={queue_id}")
    when = f"; original sent {first_sent_iso}" if first_sent_iso else ""
    return SmtpReply(550, "5.7.1", f"Duplicate not sent again for {count} recipient(s){when}; "
                                   f"id={queue_id}")


def invalid_key(reason: str) -> SmtpReply:
    """The ``554 5.6.0`` for a dedupe key or template that breaks design.md §2."""
    return SmtpReply(554, "5.6.0", f"Invalid dedupe header: {client_safe_text(reason, limit=120)}")


def rate_limited(label: str, retry_after_s: float) -> SmtpReply:
    """The ``451 4.7.0`` for a message over the ``messages`` limit ``label`` (design.md §4.7):
    nothing was reserved or relayed; the window has room again in ``retry_after_s``
    seconds (rounded up, at least 1)."""
    seconds = max(1, math.ceil(retry_after_s))
    return SmtpReply(451, "4.7.0", f"rate limit {label} reached: try again in {seconds} s")


def rate_limited_recipients(label: str, retry_after_s: float | None, count: int,
                            limit: int, per_s: float) -> SmtpReply:
    """The ``452 4.5.3`` for a message of ``count`` recipients over the ``recipients`` limit
    ``label`` (``limit`` per ``per_s`` seconds); ``retry_after_s`` None: the message alone has
    more recipients than the limit allows in a window (send fewer per message)."""
    if retry_after_s is None:
        return SmtpReply(452, "4.5.3", f"rate limit {label}: too many recipients ({count}, at "
                                       f"most {limit} per {per_s:g} s): send fewer per message")
    seconds = max(1, math.ceil(retry_after_s))
    return SmtpReply(452, "4.5.3", f"rate limit {label}: too many recipients ({count}) for "
                                   f"its window: try again in {seconds} s")


def upstream_token_unavailable(reason: str) -> SmtpReply:
    """``451 4.7.0``: no OAuth2 access token for the smarthost AUTH (``reason``: client-safe
    words such as "token endpoint unreachable"); nothing was sent, the retry is safe."""
    return SmtpReply(451, "4.7.0", f"Relay cannot get an OAuth2 token for its upstream "
                     f"({client_safe_text(reason)}), try again later")


# --- auth (RFC 4954 section 6; the 501s are aiosmtpd's wording, kept identical) ---------------
AUTH_SUCCEEDED = SmtpReply(235, "2.7.0", "Authentication successful")
AUTH_FAILED = SmtpReply(535, "5.7.8", "Authentication credentials invalid")
AUTH_CANCELLED = SmtpReply(501, "5.7.0", "Auth aborted")
AUTH_BAD_BASE64 = SmtpReply(501, "5.5.2", "Can't decode base64")
AUTH_TOO_MANY_FAILURES = SmtpReply(421, "4.7.0", "Too many failed authentication attempts")
TLS_ALREADY_ACTIVE = SmtpReply(503, "5.5.1", "TLS already active (RFC 3207 4.2)")
BAD_AUTH_PARAMETER = SmtpReply(
    501, "5.5.4", "AUTH= takes <> or an xtext mailbox (RFC 4954 5, RFC 3461 4)")
