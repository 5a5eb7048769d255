"""Recipient normalization for the fingerprint (docs/design.md §2; RFC 5321 sections 2.4,
4.1.2, 4.1.3; RFC 5890-5891 IDNA for domains): the forward-path syntax stripped, the local
part kept (case-folded unless configured otherwise), the domain lower-cased and in its A-label
form, an address literal canonical. Pure functions, no I/O."""

from __future__ import annotations

import functools
import re
import unicodedata

import idna

from relay.core.address import ADDRESS_LITERAL, DOT_STRING, canonical_literal
from relay.core.errors import InvalidAddressError

# -- recipient --------------------------------------------------------------------------------

# RFC 5321 section 4.1.2: A-d-l = At-domain *( "," At-domain ) ":", At-domain = "@" Domain.
_AT_DOMAIN = r"@(?:\[[^\]]*\]|[^,:\[\]]*)"
_SOURCE_ROUTE = re.compile(rf"{_AT_DOMAIN}(?:,[ \t]*{_AT_DOMAIN})*:")


def normalize_recipient(address: str, *, local_part_case_sensitive: bool = False) -> str:
    """Normalize an envelope recipient for the fingerprint (design.md §2).

    ``address`` is the RCPT TO path as the SMTP server parsed it, e.g. ``"John@Example.COM"``;
    surrounding spaces, one pair of angle brackets and a source route (``@a,@b:``, RFC 5321
    section 4.1.2) are dropped. The local part loses redundant quotes (``"john"`` -> ``john``;
    needed ones stay, escaping only ``"`` and ``\\``), is NFC-normalized and lowercased with
    ``str.lower()`` unless ``local_part_case_sensitive`` (RFC 5321 section 2.4); ``postmaster``
    in any case is always ``postmaster`` (RFC 5321 section 4.5.1). The domain becomes its
    lower-case A-label (UTS 46 mapping, IDNA2008 check: RFC 5890/5891; a root dot, also one
    mapped from U+3002, is refused); an IP address literal is written canonically
    (``[IPv6:2001:DB8:0::1]`` -> ``[ipv6:2001:db8::1]``), another one lowercased. Without a
    domain only the local part is returned.

    Returns ``local@domain`` as a str. Raises :class:`InvalidAddressError` for control
    characters (category Cc), invalid UTF-8 (surrogate escapes), an empty address, a malformed
    source route, quoted string or address literal, an unbalanced angle bracket, or a domain
    IDNA refuses.
    """
    text = _strip_path_syntax(address)
    local, domain = _split_mailbox(text)
    norm_local = _normalize_local_part(local, case_sensitive=local_part_case_sensitive)
    if domain is None:
        return norm_local
    return f"{norm_local}@{_normalize_domain(domain)}"


def ascii_address(address: str) -> str:
    """The ASCII form of an envelope address for a hop without SMTPUTF8 (RFC 6531 section 3.2).

    The domain becomes its A-label (RFC 5890); the local part must already be ASCII, since a
    non-ASCII local part has no downgrade (RFC 6530). ``""`` (the null path) stays ``""``.
    Raises :class:`InvalidAddressError` when no ASCII form exists.
    """
    if address.isascii():
        return address
    local, at, domain = address.rpartition("@")
    if not at or not local.isascii():
        raise InvalidAddressError("the local part is not ASCII: no SMTPUTF8 downgrade exists")
    return f"{local}@{_a_label(domain)}"


def _strip_path_syntax(address: str) -> str:
    """Check the characters; drop surrounding spaces, angle brackets and a source route."""
    try:
        address.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidAddressError("address is not valid UTF-8") from None
    control = next((char for char in address if unicodedata.category(char) == "Cc"), None)
    if control is not None:
        raise InvalidAddressError(f"address holds the control character U+{ord(control):04X}")
    text = address.strip(" ")
    if text.startswith("<") and text.endswith(">"):
        text = text[1:-1]
    if text.startswith(("<", ">")) or text.endswith(("<", ">")):  # never a Mailbox's ends
        raise InvalidAddressError("address has an unbalanced angle bracket")
    if text.startswith("@"):
        route = _SOURCE_ROUTE.match(text)
        if route is None:
            raise InvalidAddressError("address has a malformed source route")
        text = text[route.end() :]
    if not text:
        raise InvalidAddressError("address is empty")
    return text


def _split_mailbox(text: str) -> tuple[str, str | None]:
    """(local part with quotes and quoted-pairs resolved, domain or None) of ``text``."""
    local: list[str] = []
    quoted = False
    index = 0
    while index < len(text):
        char = text[index]
        if quoted and char == "\\":
            if index + 1 == len(text):
                raise InvalidAddressError("quoted local part ends in a backslash")
            local.append(text[index + 1])
            index += 2
            continue
        if char == '"':
            quoted = not quoted
        elif char == "@" and not quoted:
            return "".join(local), text[index + 1 :]
        else:
            local.append(char)
        index += 1
    if quoted:
        raise InvalidAddressError("address has an unterminated quoted string")
    return "".join(local), None


def _normalize_local_part(local: str, *, case_sensitive: bool) -> str:
    """NFC, case policy, postmaster rule, then the minimal RFC 5321 form (bare or quoted)."""
    text = unicodedata.normalize("NFC", local)
    if text.isascii() and text.lower() == "postmaster":
        return "postmaster"
    if not case_sensitive:
        text = unicodedata.normalize("NFC", text.lower())
    if DOT_STRING.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def normalize_domain(domain: str) -> str:
    """The lower-case A-label of ``domain`` (an address literal in its canonical spelling), as
    a recipient's domain is normalized. Raises :class:`InvalidAddressError`."""
    return _normalize_domain(domain)


def _normalize_domain(domain: str) -> str:
    """Lower-case A-label of ``domain``, or the address literal in its canonical spelling."""
    if domain.startswith("["):
        if ADDRESS_LITERAL.fullmatch(domain) is None:
            raise InvalidAddressError("address has a malformed address literal")
        return canonical_literal(domain)
    return _a_label(domain)


@functools.lru_cache(maxsize=1024)  # pure; IDNA is most of the cost of a recipient
def _a_label(domain: str) -> str:
    """Lower-case A-label of a domain name (UTS 46 mapping, IDNA2008 checks)."""
    try:
        encoded = idna.encode(domain, uts46=True)
    except UnicodeError as exc:  # idna.IDNAError and its subclasses
        # The exception text quotes the domain; recipients stay out of logs (design.md §6.4).
        raise InvalidAddressError(
            f"domain is not a valid IDNA name ({type(exc).__name__})"
        ) from None
    if encoded.endswith(b".") or not encoded:
        # UTS 46 maps U+3002, U+FF0E and U+FF61 to ".": "example.net\u3002" would be a second
        # spelling of example.net (RFC 5321 section 4.1.2: a Domain has no root dot)
        raise InvalidAddressError("domain ends with a dot")
    return encoded.decode("ascii").lower()


