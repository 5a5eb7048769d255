"""Rate limits of the relay (design.md §4.7): which configured limits apply to one message, and in
which bucket each takes its share. Pure: no I/O; :class:`relay.core.interfaces.RateLimiter`
(the store) counts.

A :class:`RateRule` is one ``[[rate_limit]]`` entry. Its ``scope`` names what a bucket is per:

- ``upstream``: the upstream the relay would try first now (its configured name);
- ``auth_user``: the session's AUTH identity; an unauthenticated session is not limited by
  such an entry (its mail has no user to count against: use ``upstream`` for a global cap);
- ``sender_domain``: the MAIL FROM domain as its lower-case A-label (``"<>"`` for the null
  sender);
- ``template``: each normalized template value of the message (the empty value when it has
  none), so a message of two templates counts against both.

``match`` (a case-sensitive shell glob on the scope's value) restricts an entry to some values;
each value it matches has its own bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from relay.core.errors import InvalidAddressError
from relay.core.interfaces import LimitCheck
from relay.core.recipients import normalize_domain

SCOPES = ("upstream", "auth_user", "sender_domain", "template")


@dataclass(frozen=True)
class RateRule:
    """One configured limit: at most ``messages`` messages and/or ``recipients`` envelope
    recipients per ``per_s`` seconds in each bucket of ``scope`` whose value matches
    ``match``; ``label`` names it (metrics, replies, store keys)."""

    label: str
    scope: str
    per_s: float
    messages: int | None = None
    recipients: int | None = None
    match: str = "*"


@dataclass(frozen=True)
class LimitSubject:
    """What the limits of one message are judged on: the upstream name, the session's AUTH
    identity (None: unauthenticated), the reverse path (``""``: the null sender), the
    normalized template values and the number of distinct recipients."""

    upstream: str
    auth_user: str | None
    mail_from: str
    templates: Sequence[str]
    recipients: int


def sender_domain(mail_from: str) -> str:
    """The bucket value of ``sender_domain``: ``"<>"`` for the null sender, else the domain of
    ``mail_from`` as its lower-case A-label (an address literal canonical; a domain IDNA
    refuses lower-cased as it is; an address without a domain: ``""``)."""
    if not mail_from:
        return "<>"
    _, at, domain = mail_from.rpartition("@")
    if not at or not domain:
        return ""
    try:
        return normalize_domain(domain)
    except InvalidAddressError:
        return domain.lower()


def _values(rule: RateRule, subject: LimitSubject) -> list[str]:
    if rule.scope == "upstream":
        return [subject.upstream]
    if rule.scope == "auth_user":
        return [] if subject.auth_user is None else [subject.auth_user]
    if rule.scope == "sender_domain":
        return [sender_domain(subject.mail_from)]
    return list(dict.fromkeys(subject.templates or ("",)))


def checks_for(rules: Sequence[RateRule], subject: LimitSubject) -> list[LimitCheck]:
    """The checks of every rule that applies to ``subject``: per matching value, one for its
    ``messages`` (cost 1) and one for its ``recipients`` (cost: the recipient count)."""
    checks: list[LimitCheck] = []
    for rule in rules:
        for value in _values(rule, subject):
            if not fnmatchcase(value, rule.match):
                continue
            if rule.messages is not None:
                checks.append(LimitCheck(rule.label, "messages",
                                         f"{rule.label}:m:{rule.scope}:{value}",
                                         rule.messages, rule.per_s, 1))
            if rule.recipients is not None:
                checks.append(LimitCheck(rule.label, "recipients",
                                         f"{rule.label}:r:{rule.scope}:{value}",
                                         rule.recipients, rule.per_s, max(1, subject.recipients)))
    return checks
