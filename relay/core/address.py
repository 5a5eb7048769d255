"""Envelope address syntax: is a MAIL FROM / RCPT TO path an RFC 5321 Mailbox?

Pure functions, no I/O. aiosmtpd hands the hooks the path without its angle brackets and
source route, and accepts much that is no Mailbox (``user`` with no domain, ``a..b@x``,
``u@[]``): an upstream would then complete, rewrite or refuse it, so such a path would reach
someone else or bounce later instead of being refused now. Rules:

- RFC 5321 section 4.1.2: ``Mailbox = Local-part "@" ( Domain / address-literal )``,
  ``Local-part = Dot-string / Quoted-string``; RFC 6531 section 3.3 adds UTF-8 to both.
- RFC 5321 section 4.1.3: address literals are IPv4, ``IPv6:`` or a general ``tag:content``.
- RFC 5321 section 4.5.1: ``Postmaster`` is the one recipient that needs no domain.

The domain's IDNA validity is checked where the recipient is normalized
(:func:`relay.core.recipients.normalize_recipient`); here a domain is only a dot-separated list of
non-empty labels.
"""

from __future__ import annotations

import ipaddress
import re

# RFC 5321 Dot-string over RFC 5322 atext, extended with UTF8-non-ascii by RFC 6531 section 3.3.
ATEXT = "[A-Za-z0-9!#$%&'*+\\-/=?^_`{|}~\u0080-\U0010ffff]"
DOT_STRING = re.compile(rf"{ATEXT}+(?:\.{ATEXT}+)*")
# RFC 5321 section 4.1.2: qtextSMTP = %d32-33 / %d35-91 / %d93-126 (+ UTF-8), quoted-pairSMTP.
_QUOTED_STRING = re.compile(r'"(?:[\x20\x21\x23-\x5b\x5d-\x7e\u0080-\U0010ffff]|\\[\x20-\x7e])*"')
# RFC 5321 section 4.1.3: address-literal = "[" ... "]", dcontent = %d33-90 / %d94-126.
ADDRESS_LITERAL = re.compile(r"\[[\x21-\x5a\x5e-\x7e]*\]")
_GENERAL_TAG = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")
# A label holds no RFC 5322 special (section 3.2.3: ()<>[]:;@\\,.") and no blank: those are
# never part of a domain, and "u@example.net>" is an unbalanced path, not a domain "net>".
_LABEL = re.compile(r'[^.\s@\[\]<>():;\\,"]+')


def mailbox_problem(path: str, *, postmaster_alone: bool = False) -> str | None:
    """Why ``path`` is not an RFC 5321 Mailbox, or None when it is one.

    ``path`` is an address as aiosmtpd parsed it (``user@example.com``, no brackets);
    ``postmaster_alone`` lets ``Postmaster`` (any case) stand without a domain (RCPT only,
    RFC 5321 section 4.5.1). The reason is short and names no part of the address (it is logged).
    """
    if postmaster_alone and path.isascii() and path.lower() == "postmaster":
        return None
    local, domain = _split(path)
    if domain is None:
        return "no domain"
    if not (DOT_STRING.fullmatch(local) or _QUOTED_STRING.fullmatch(local)):
        return "local part is neither a dot-string nor a quoted string"
    if local == '""':  # a Quoted-string may be empty (RFC 5321 4.1.2), a mailbox name not
        return "local part is empty"
    if domain.startswith("["):
        return None if address_literal_ok(domain) else "malformed address literal"
    if not all(_LABEL.fullmatch(label) for label in domain.split(".")):
        return "domain has an empty or malformed label"
    return None


def address_literal_ok(literal: str) -> bool:
    """True when ``literal`` (``[...]``) is an IPv4, IPv6 or general address literal."""
    if ADDRESS_LITERAL.fullmatch(literal) is None:
        return False
    content = literal[1:-1]
    tag, colon, rest = content.partition(":")
    if not colon:
        return _is_ip(content, ipaddress.IPv4Address)
    if tag.lower() == "ipv6":
        return _is_ip(rest, ipaddress.IPv6Address)
    return _GENERAL_TAG.fullmatch(tag) is not None and bool(rest)


def canonical_literal(literal: str) -> str:
    """The one spelling of an address literal for the fingerprint: ``[192.0.2.1]``,
    ``[ipv6:2001:db8::1]`` (RFC 5952 compressed form); any other is lowercased."""
    content = literal[1:-1]
    tag, colon, rest = content.partition(":")
    try:
        if not colon:
            return f"[{ipaddress.IPv4Address(content)}]"
        if tag.lower() == "ipv6":
            return f"[ipv6:{ipaddress.IPv6Address(rest).compressed}]"
    except ValueError:
        pass
    return literal.lower()


def _is_ip(text: str, kind: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address]) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def _split(path: str) -> tuple[str, str | None]:
    """(local part as written, domain or None): the last ``@`` outside a quoted string."""
    quoted = escaped = False
    at = -1
    for index, char in enumerate(path):
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "@" and not quoted:
            at = index
    if at < 0:
        return path, None
    return path[:at], path[at + 1 :]


def mask_address(address: str) -> str:
    """Mask the local part of ``address``: ``john.doe@example.com`` -> ``j***@example.com``;
    a local part of one character, or a quoted one, is masked whole (``***@example.com``):
    its first character would be all of it, or a quote."""
    local, at, domain = address.rpartition("@")
    if not at:
        return address[:1] + "***"
    shown = local[:1] if len(local) > 1 and not local.startswith('"') else ""
    return f"{shown}***@{domain}"


# an address inside free text (an upstream's reply, a log message): a dot-atom or quoted local
# part (RFC 5321 section 4.1.2, UTF-8 per RFC 6531 section 3.3), "@", then a domain of
# dot-separated labels or an address literal; the text around it is left as it is
_ADDRESS_IN_TEXT = re.compile(
    rf'(?:"(?:[^"\\\r\n]|\\.)*"|{ATEXT}+(?:\.{ATEXT}+)*)'
    r"@(?:\[[^\]\s]*\]|[\w-]+(?:\.[\w-]+)*)")


def mask_addresses_in(text: str) -> str:
    """``text`` with every address in it masked by :func:`mask_address`
    (``450 4.2.0 <jane.roe@example.net>: greylisted`` -> ``450 4.2.0 <j***@example.net>:
    greylisted``). Idempotent: a masked address stays as it is."""
    if "@" not in text:
        return text
    return _ADDRESS_IN_TEXT.sub(lambda m: mask_address(m.group()), text)

