"""The queue id a smarthost names in its reply to the final dot: the one parser of it, read by
the decision's log line (``upstream_queue_id``) and the audit ledger's rows alike."""

from __future__ import annotations

import re

from relay.core.interfaces import SmtpReply

# The queue id as the common smarthosts word their reply to the final dot (RFC 5321 leaves the
# text free): Postfix "250 2.0.0 Ok: queued as 4Xb2Lk1Zz9z3", Sendmail "250 2.0.0 3B1Kx2Ab012345
# Message accepted for delivery", Exim "250 OK id=1tQk2A-0001Xy-3C", Amazon SES "250 Ok
# 0100018c...-000000", Microsoft 365 "250 2.0.0 OK <id@host> [Hostname=...]", Gmail "250 2.0.0
# OK  1733100000 a1b2c3-4d.12 - gsmtp", Haraka / qmail "250 ... (QUEUED ID)", others "250 ...
# queue id ID". The first pattern that matches wins; none: "" (the reply itself is kept in full
# beside it). Only a 2yz reply names a queue id: a refusal queued nothing.
_QUEUE_ID_PATTERNS = (
    re.compile(r"queued as ([A-Za-z0-9][\w.\-]*)", re.IGNORECASE),
    re.compile(r"\bid=([\w.\-]+)", re.IGNORECASE),
    re.compile(r"^(?:\d\.\d{1,3}\.\d{1,3} )?([A-Za-z0-9]{8,}) Message accepted", re.IGNORECASE),
    re.compile(r"^(?:\d\.\d{1,3}\.\d{1,3} )?Ok:? ([0-9a-f]{16,}-[\w\-]+)", re.IGNORECASE),
    re.compile(r"(<[^<>\s]+@[^<>\s]+>)"),
    re.compile(r"\(queued (?:as )?([\w.\-@]+)\)", re.IGNORECASE),
    re.compile(r"OK\s+\d+ ([\w.\-]+) - gsmtp", re.IGNORECASE),
    re.compile(r"\bqueue id:? ([\w.:\-]+)", re.IGNORECASE),
)


def upstream_queue_id(reply: SmtpReply | None) -> str:
    """The queue id a smarthost named in its 2yz ``reply`` to the final dot ("" when the reply
    is not 2yz or names none the known forms match)."""
    if reply is None or not 200 <= reply.code < 300:
        return ""
    text = reply.text
    for pattern in _QUEUE_ID_PATTERNS:
        found = pattern.search(text)
        if found is not None:
            return found.group(1)[:200]
    return ""
