"""Property tests of the pure parts: header lookup, recipient normalization, path check, hashing.

Hypothesis explores the input space that the example tests in test_fingerprint.py pin down by
hand (design.md §2 and §5). The generators build header sections field by field (names in
mixed case, values made of plain words, raw 8-bit words and RFC 2047 encoded-words, blank runs,
folds), envelope addresses (dot-atoms, quoted strings, source routes, address literals, IDN
domains) and SMTP path arguments. Every test is bounded (at most 200 examples, no deadline)
and touches no network.
"""

from __future__ import annotations

import base64
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, replace

import idna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.core.errors import InvalidAddressError, InvalidDedupKeyError
from relay.core.fingerprint import fingerprint
from relay.core.headers import DedupHeaders, extract_dedup_headers, normalize_header_value
from relay.core.recipients import ascii_address, normalize_recipient
from relay.smtp.session import check_path_argument

BOUNDED = settings(max_examples=200, deadline=None)

KEY_NAMES = ("X-Dedupe-Key", "Idempotency-Key")
TEMPLATE_NAMES = ("X-Template",)
_WANTED = {name.lower() for name in KEY_NAMES + TEMPLATE_NAMES}


def is_control(char: str) -> bool:
    """Unicode category Cc: C0 controls, DEL and the C1 controls U+0080..U+009F."""
    return unicodedata.category(char) == "Cc"


def recase(text: str, upper: list[bool]) -> str:
    """``text`` with each character upper- or lower-cased by ``upper`` (cycled).

    Only characters whose case change is undone by ``str.lower()`` change (not ``ß`` -> ``SS``
    or long s -> ``S``), so the result is a case variant in the sense of the lowercasing rule.
    """
    out = []
    for index, char in enumerate(text):
        flip = upper[index % len(upper)] if upper else False
        other = char.upper() if flip else char.lower()
        out.append(other if other.lower() == char.lower() else char)
    return "".join(out)


# ------------------------------------------------------------------------------------------
# header sections
# ------------------------------------------------------------------------------------------

_FTEXT = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":")
_NAMES = st.one_of(
    st.sampled_from(
        [*KEY_NAMES, *TEMPLATE_NAMES, "Subject", "X-Dedupe_Key", "X-Dedupe-Keys", "X-Templat"]
    ),
    st.text(_FTEXT, min_size=1, max_size=12),
)
_BLANK_RUN = st.text(st.sampled_from(" \t"), min_size=1, max_size=4)
_MAYBE_BLANKS = st.text(st.sampled_from(" \t"), max_size=4)
# word characters: anything but controls, surrogates, SP; "?" is left out of encoded-word
# payloads only, so that no decoded text is itself an encoded-word (see the idempotence test)
_WORD_CHARS = st.characters(exclude_categories=("Cc", "Cs"), exclude_characters=" ")
_PAYLOAD_CHARS = st.characters(exclude_categories=("Cc", "Cs"), exclude_characters="?")
_CHARSETS = ("utf-8", "UTF-8", "iso-8859-1", "ISO-8859-15", "us-ascii", "utf-8*en", "windows-1252")


def q_encode(data: bytes) -> str:
    """RFC 2047 "Q" encoding: letters and digits literal, SP as "_", everything else =XX."""
    out = []
    for byte in data:
        char = chr(byte)
        if char.isascii() and char.isalnum():
            out.append(char)
        elif char == " ":
            out.append("_")
        else:
            out.append(f"={byte:02X}")
    return "".join(out)


@st.composite
def encoded_words(draw: st.DrawFn) -> bytes:
    """A well-formed RFC 2047 encoded-word ("B" or "Q") holding a short text."""
    charset = draw(st.sampled_from(_CHARSETS))
    text = draw(st.text(_PAYLOAD_CHARS, min_size=1, max_size=8))
    try:
        data = text.encode(charset.split("*")[0])
    except UnicodeEncodeError:
        charset, data = "utf-8", text.encode()
    if draw(st.booleans()):
        encoded = base64.b64encode(data).decode()
        if draw(st.booleans()):
            encoded = encoded.rstrip("=")  # missing padding is tolerated
        return f"=?{charset}?{draw(st.sampled_from('Bb'))}?{encoded}?=".encode()
    return f"=?{charset}?{draw(st.sampled_from('Qq'))}?{q_encode(data)}?=".encode()


_WORDS = st.one_of(
    st.text(_WORD_CHARS, min_size=1, max_size=8).map(lambda word: word.encode()),
    st.lists(st.integers(0x80, 0xFF), min_size=1, max_size=4).map(bytes),  # raw 8-bit
    encoded_words(),
)


@dataclass(frozen=True)
class Field:
    """One header field: a name and a value made of words, blank runs and folds.

    The blank runs are ``lead``, then ``gaps`` (one between two words), then ``trail``;
    ``folds[i]`` puts a CRLF before the i-th of them when it is not empty (RFC 5322 2.2.3).
    """

    name: str
    words: tuple[bytes, ...]
    gaps: tuple[str, ...]
    lead: str
    trail: str
    folds: tuple[bool, ...]

    def value(self) -> bytes:
        """The raw field body after the colon, folded as ``folds`` says."""
        runs = [self.lead, *self.gaps, self.trail]
        out = b""
        for index, run in enumerate(runs):
            if run and self.folds[index]:
                out += b"\r\n"
            out += run.encode()
            if index < len(self.words):
                out += self.words[index]
        return out

    def line(self) -> bytes:
        """The field as it stands in the header section, CRLF-terminated."""
        return self.name.encode() + b":" + self.value() + b"\r\n"


@st.composite
def fields(draw: st.DrawFn) -> Field:
    """A header field with a well-formed (possibly folded, possibly blank) value."""
    words = draw(st.lists(_WORDS, max_size=5))
    gaps = draw(st.lists(_BLANK_RUN, min_size=max(0, len(words) - 1),
                         max_size=max(0, len(words) - 1)))
    folds = draw(st.lists(st.booleans(), min_size=len(gaps) + 2, max_size=len(gaps) + 2))
    return Field(name=draw(_NAMES), words=tuple(words), gaps=tuple(gaps),
                 lead=draw(_MAYBE_BLANKS), trail=draw(_MAYBE_BLANKS), folds=tuple(folds))


_FIELD_LISTS = st.lists(fields(), max_size=8)


def section(block: list[Field], body: bytes = b"body\r\n") -> bytes:
    """A message: the fields, the empty line, ``body``."""
    return b"".join(f.line() for f in block) + b"\r\n" + body


def outcome(content: bytes) -> DedupHeaders | str:
    """What extraction gives: the headers, or ``"invalid"`` for InvalidDedupKeyError."""
    try:
        return extract_dedup_headers(content)
    except InvalidDedupKeyError:
        return "invalid"


_ANY_CHARSETS = st.sampled_from(
    ["utf-8", "utf-7", "utf-16", "utf-32", "latin-1", "shift_jis", "iso-2022-jp", "gb18030",
     "unicode_escape", "idna", "punycode", "base64", "hex", "rot13", "zlib", "undefined",
     "x-unknown", "UTF-8*de", "us-ascii"]
)


@st.composite
def odd_encoded_words(draw: st.DrawFn) -> bytes:
    """An encoded-word in any charset (codecs included) with any payload, maybe malformed."""
    payload = draw(st.binary(max_size=12))
    if draw(st.booleans()):
        text = base64.b64encode(payload).decode()
        kind = "B"
    else:
        text = "".join(f"={b:02X}" if draw(st.booleans()) else chr(b & 0x7F) for b in payload)
        kind = "Q"
    return f"=?{draw(_ANY_CHARSETS)}?{kind}?{text}?=".encode("latin-1")


_ANY_VALUE_PARTS = st.one_of(
    st.binary(max_size=20),
    st.text(max_size=12).map(lambda text: text.encode("utf-8", "surrogatepass")),
    _WORDS,
    odd_encoded_words(),
    st.sampled_from([b" ", b"\t", b"  \t ", b"\r\n ", b"\r\n\t", b"\r", b"\n", b"\x00", b"\x7f",
                     "\u0085".encode(), b"=?", b"?="]),
)
_LINE_ENDS = st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r"])


@st.composite
def arbitrary_sections(draw: st.DrawFn) -> bytes:
    """A header section of arbitrary fields and line ends, then anything."""
    lines = []
    for _ in range(draw(st.integers(0, 8))):
        name = draw(st.one_of(_NAMES, st.text(max_size=10)))
        name = recase(name, draw(st.lists(st.booleans(), max_size=6)))
        value = b"".join(draw(st.lists(_ANY_VALUE_PARTS, max_size=6)))
        colon = draw(st.sampled_from([b":", b" :", b"\t:", b""]))
        lines.append(name.encode("utf-8", "surrogatepass") + colon + value + draw(_LINE_ENDS))
    return b"".join(lines) + draw(st.sampled_from([b"\r\n", b""])) + draw(st.binary(max_size=40))


@BOUNDED
@given(content=arbitrary_sections())
def test_any_header_section_gives_headers_or_invalid_dedup_key(content: bytes) -> None:
    """Any header section is parsed into sorted distinct valid values or refused as invalid key."""
    try:
        headers = extract_dedup_headers(content)
    except InvalidDedupKeyError:
        return
    for values in (headers.keys, headers.templates):
        assert list(values) == sorted(set(values))
        assert all(value and len(value) <= 256 for value in values)
        assert not any(is_control(char) for value in values for char in value)


@BOUNDED
@given(block=_FIELD_LISTS, folds=st.lists(st.booleans(), min_size=1, max_size=12))
def test_refolding_values_at_blanks_keeps_the_result(block: list[Field], folds: list[bool]) -> None:
    """Folding a value before any of its blank runs, or unfolding it, changes no key or template."""
    refolded = [replace(f, folds=tuple(folds[i % len(folds)] for i in range(len(f.folds))))
                for f in block]
    unfolded = [replace(f, folds=(False,) * len(f.folds)) for f in block]
    assert outcome(section(refolded)) == outcome(section(block)) == outcome(section(unfolded))


@BOUNDED
@given(block=_FIELD_LISTS, upper=st.lists(st.booleans(), min_size=1, max_size=16))
def test_field_name_case_does_not_matter(block: list[Field], upper: list[bool]) -> None:
    """Changing the case of any field name changes no key or template."""
    recased = [replace(f, name=recase(f.name, upper)) for f in block]
    assert outcome(section(recased)) == outcome(section(block))


@BOUNDED
@given(block=_FIELD_LISTS, lead=_MAYBE_BLANKS, trail=_MAYBE_BLANKS)
def test_blanks_around_values_do_not_matter(block: list[Field], lead: str, trail: str) -> None:
    """Adding or removing SP/HTAB runs before and after values changes no key or template."""
    padded = [replace(f, lead=f.lead + lead, trail=trail + f.trail) for f in block]
    bare = [replace(f, lead="", trail="") for f in block]
    assert outcome(section(padded)) == outcome(section(block)) == outcome(section(bare))


@BOUNDED
@given(block=_FIELD_LISTS, data=st.data())
def test_order_of_occurrences_does_not_matter(block: list[Field], data: st.DataObject) -> None:
    """Reordering the fields of a header section changes no key or template."""
    shuffled = data.draw(st.permutations(block))
    assert outcome(section(shuffled)) == outcome(section(block))


@BOUNDED
@given(block=_FIELD_LISTS.filter(bool), data=st.data())
def test_duplicating_an_occurrence_does_not_matter(
    block: list[Field], data: st.DataObject
) -> None:
    """Repeating any field anywhere in the header section changes no key or template."""
    copy = block[data.draw(st.integers(0, len(block) - 1))]
    at = data.draw(st.integers(0, len(block)))
    assert outcome(section([*block[:at], copy, *block[at:]])) == outcome(section(block))


def expected_values(block: list[Field], names: tuple[str, ...]) -> tuple[str, ...]:
    """The sorted distinct non-empty normalized values of the fields named ``names``."""
    wanted = {name.lower() for name in names}
    values = {normalize_header_value(f.value()) for f in block if f.name.lower() in wanted}
    return tuple(sorted(values - {""}))


@BOUNDED
@given(block=_FIELD_LISTS)
def test_key_and_template_sets_are_the_normalized_values(block: list[Field]) -> None:
    """Keys and templates are the distinct normalized field values, each a fixed point."""
    try:
        expected = DedupHeaders(keys=expected_values(block, KEY_NAMES),
                                templates=expected_values(block, TEMPLATE_NAMES))
    except InvalidDedupKeyError:
        expected = None
    got = outcome(section(block))
    if expected is None:
        assert got == "invalid"
        return
    assert got == expected
    for value in expected.keys + expected.templates:
        assert normalize_header_value(value) == value


@BOUNDED
@given(block=_FIELD_LISTS, body=st.binary(max_size=200), fake=_FIELD_LISTS)
def test_nothing_after_the_first_empty_line_counts(
    block: list[Field], body: bytes, fake: list[Field]
) -> None:
    """Bytes after the first empty line, header-like or not, never change the result."""
    reference = outcome(section(block, b""))
    assert outcome(section(block, body)) == reference
    assert outcome(section(block, section(fake, body))) == reference
    assert outcome(section(block, b"".join(f.line() for f in fake) + body)) == reference


# ------------------------------------------------------------------------------------------
# recipients
# ------------------------------------------------------------------------------------------

_LABEL_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789-äöüéñçåжыωλ"
_LABELS = st.text(st.sampled_from(_LABEL_ALPHABET), min_size=1, max_size=10)


def idna_accepts(domain: str) -> bool:
    """Whether the idna package (IDNA2008 with UTS 46 mapping) encodes ``domain``."""
    try:
        idna.encode(domain, uts46=True)
    except idna.IDNAError:
        return False
    return True


_U_DOMAINS = st.lists(_LABELS, min_size=1, max_size=3).map(".".join).filter(idna_accepts)
_LITERALS = st.sampled_from(["[192.0.2.1]", "[IPv6:2001:DB8::1]", "[Ipv6:::1]"])
_ATEXT = st.one_of(
    st.sampled_from("abcxyzABCXYZ0189!#$%&'*+-/=?^_`{|}~"),
    st.characters(categories=("Lu", "Ll", "Nd"), min_codepoint=0x80),
)
_DOT_ATOMS = st.lists(st.text(_ATEXT, min_size=1, max_size=6), min_size=1, max_size=3).map(
    ".".join
)


def quote(local: str) -> str:
    """``local`` as an RFC 5321 quoted string."""
    return '"' + local.replace("\\", "\\\\").replace('"', '\\"') + '"'


_QUOTED = st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=8).map(quote)
_LOCALS = st.one_of(_DOT_ATOMS, _QUOTED, st.sampled_from(["Postmaster", "POSTMASTER"]))


@dataclass(frozen=True)
class Address:
    """An envelope path: ``<`` route ``local@domain`` ``>`` with optional surrounding spaces."""

    local: str
    domain: str | None
    route: str = ""
    brackets: bool = False
    spaces: str = ""

    def text(self) -> str:
        """The address as a client may write it."""
        mailbox = self.local if self.domain is None else f"{self.local}@{self.domain}"
        path = f"<{self.route}{mailbox}>" if self.brackets else self.route + mailbox
        return self.spaces + path + self.spaces


@st.composite
def addresses(draw: st.DrawFn) -> Address:
    """A well-formed envelope address, IDN domains and address literals included."""
    brackets = draw(st.booleans())
    route = draw(st.sampled_from(["", "@relay.example:", "@a.example,@[192.0.2.7]:"]))
    return Address(
        local=draw(_LOCALS),
        domain=draw(st.one_of(_U_DOMAINS, _U_DOMAINS, _LITERALS, st.none())),
        route=route if brackets else "",
        brackets=brackets,
        spaces=draw(st.sampled_from(["", " ", "  "])),
    )


def normalized(address: str, *, sensitive: bool = False) -> str:
    """normalize_recipient, with ``"invalid"`` for InvalidAddressError."""
    try:
        return normalize_recipient(address, local_part_case_sensitive=sensitive)
    except InvalidAddressError:
        return "invalid"


_ADDRESS_TEXT = st.one_of(addresses().map(Address.text), st.text(max_size=30))


@BOUNDED
@given(address=_ADDRESS_TEXT, sensitive=st.booleans())
def test_normalized_recipient_is_a_fixed_point(address: str, sensitive: bool) -> None:
    """Normalizing the output of normalize_recipient gives it back, under either case policy."""
    once = normalized(address, sensitive=sensitive)
    if once != "invalid":
        assert normalize_recipient(once, local_part_case_sensitive=sensitive) == once


@BOUNDED
@given(address=addresses(), upper=st.lists(st.booleans(), min_size=1, max_size=12),
       sensitive=st.booleans())
def test_domain_case_never_matters(address: Address, upper: list[bool], sensitive: bool) -> None:
    """Changing the case of the domain gives the same recipient under either case policy."""
    domain = None if address.domain is None else recase(address.domain, upper)
    variant = replace(address, domain=domain)
    assert normalized(variant.text(), sensitive=sensitive) == normalized(
        address.text(), sensitive=sensitive)


@BOUNDED
@given(address=addresses(), upper=st.lists(st.booleans(), min_size=1, max_size=12))
def test_local_part_case_does_not_matter_by_default(address: Address, upper: list[bool]) -> None:
    """Changing the case of the local part and domain gives the same recipient by default."""
    domain = None if address.domain is None else recase(address.domain, upper)
    variant = replace(address, local=recase(address.local, upper[::-1]), domain=domain)
    assert normalized(variant.text()) == normalized(address.text())


def a_label(domain: str) -> str:
    """The A-label form of a lower-case NFC domain, built with the stdlib punycode codec."""
    labels = [
        label if label.isascii() else "xn--" + label.encode("punycode").decode("ascii")
        for label in domain.split(".")
    ]
    return ".".join(labels)


@BOUNDED
@given(local=_LOCALS, domain=_U_DOMAINS, upper=st.lists(st.booleans(), min_size=1, max_size=8))
def test_u_label_and_a_label_domains_are_one_recipient(
    local: str, domain: str, upper: list[bool]
) -> None:
    """A domain written with U-labels and the same domain as A-labels, any case, are equal."""
    ace = a_label(domain)
    u_form = normalized(f"{local}@{domain}")
    assert u_form == normalized(f"{local}@{recase(ace, upper)}")
    if u_form != "invalid":
        assert u_form.endswith("@" + ace)


@BOUNDED
@given(address=st.text(), sensitive=st.booleans())
def test_arbitrary_text_is_normalized_or_refused(address: str, sensitive: bool) -> None:
    """Any text is either normalized to non-empty text or refused with InvalidAddressError."""
    try:
        result = normalize_recipient(address, local_part_case_sensitive=sensitive)
    except InvalidAddressError:
        return
    assert result
    assert not any(is_control(char) for char in result)


@BOUNDED
@given(before=_ADDRESS_TEXT, control=st.characters(categories=["Cc"]), after=_ADDRESS_TEXT,
       sensitive=st.booleans())
def test_any_control_character_refuses_the_address(
    before: str, control: str, after: str, sensitive: bool
) -> None:
    """An address holding any Cc character (C0, DEL, C1) raises InvalidAddressError."""
    with pytest.raises(InvalidAddressError):
        normalize_recipient(before + control + after, local_part_case_sensitive=sensitive)


def _ascii_or_invalid(address: str) -> str | None:
    try:
        return ascii_address(address)
    except InvalidAddressError:
        return None


@BOUNDED
@given(address=st.one_of(_ADDRESS_TEXT, st.builds("{}@{}".format, _LOCALS, _U_DOMAINS)))
def test_ascii_address_is_ascii_and_names_the_same_recipient(address: str) -> None:
    """ascii_address gives ASCII or raises, and its result normalizes like the original."""
    downgraded = _ascii_or_invalid(address)
    if downgraded is None:
        return
    assert downgraded.isascii()
    assert normalized(downgraded) == normalized(address)


# ------------------------------------------------------------------------------------------
# SMTP path arguments
# ------------------------------------------------------------------------------------------

_KEYWORDS = st.sampled_from(["FROM:", "TO:"])
# what may stand between the keyword and the path, or after it: blanks, and controls that
# str.strip() would also remove (CR, LF, HTAB, VT, FS..US, NEL)
_EDGE_BLANKS = st.sampled_from(["", " ", "  ", "\t", "\r", "\n", "\r\n", "\x0b", "\x1f", "\x85"])


@st.composite
def path_arguments(draw: st.DrawFn) -> tuple[str, str]:
    """(keyword, argument): the keyword in any case, then a path-like or arbitrary rest."""
    keyword = draw(_KEYWORDS)
    spelled = recase(keyword, draw(st.lists(st.booleans(), min_size=1, max_size=4)))
    blank = draw(st.one_of(_EDGE_BLANKS, st.text(max_size=2)))
    inner = draw(st.one_of(addresses().map(Address.text), _QUOTED, st.text(max_size=12)))
    params = draw(st.sampled_from(["", " SIZE=100", " SMTPUTF8", " BODY=8BITMIME"]))
    tail = draw(st.one_of(_EDGE_BLANKS, st.text(max_size=3)))
    rest = draw(st.one_of(st.just(f"<{inner}>{params}{tail}"), st.text(max_size=20)))
    return keyword, spelled + blank + rest


@BOUNDED
@given(keyword=_KEYWORDS, arg=st.one_of(st.none(), st.text()))
def test_path_check_never_raises(keyword: str, arg: str | None) -> None:
    """check_path_argument returns a reply or None for any argument, keyword or not."""
    reply = check_path_argument(arg, keyword)
    assert reply is None or 500 <= reply.code < 600


@BOUNDED
@given(case=path_arguments())
def test_path_check_passes_only_bracketed_paths_without_controls(case: tuple[str, str]) -> None:
    """An argument passes only if "<" follows the keyword (after spaces) and it holds no Cc."""
    keyword, arg = case
    if check_path_argument(arg, keyword) is None:
        assert not any(is_control(char) for char in arg), ascii(arg)
        assert arg[len(keyword):].lstrip().startswith("<"), ascii(arg)


@BOUNDED
@given(keyword=_KEYWORDS, local=_DOT_ATOMS, domain=_U_DOMAINS,
       params=st.sampled_from(["", " SIZE=100", " SMTPUTF8 BODY=8BITMIME"]))
def test_path_check_passes_a_plain_bracketed_path(
    keyword: str, local: str, domain: str, params: str
) -> None:
    """A bracketed dot-atom path with optional parameters passes the check."""
    assert check_path_argument(f"{keyword}<{local}@{domain}>{params}", keyword) is None


# ------------------------------------------------------------------------------------------
# fingerprints
# ------------------------------------------------------------------------------------------

_RECIPIENTS = addresses().map(lambda a: normalized(a.text())).filter(lambda r: r != "invalid")
_VALUE_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=40),
    st.binary(min_size=1, max_size=40).map(lambda raw: raw.decode("utf-8", "surrogateescape")),
)


def _normalized_values(texts: list[str]) -> str:
    values = set()
    for text in texts:
        try:
            values.add(normalize_header_value(text))
        except InvalidDedupKeyError:
            continue
    return "\0".join(sorted(values - {""}))


_NORM_VALUES = st.lists(_VALUE_TEXT, min_size=1, max_size=3).map(_normalized_values)
_SECRETS = st.binary(min_size=1, max_size=40)
_PARTS: dict[str, Callable[[tuple[str, str, str], str], tuple[str, str, str]]] = {
    "recipient": lambda fp_in, other: (other, fp_in[1], fp_in[2]),
    "template": lambda fp_in, other: (fp_in[0], other, fp_in[2]),
    "key": lambda fp_in, other: (fp_in[0], fp_in[1], other),
}


@BOUNDED
@given(rcpt=_RECIPIENTS, template=_NORM_VALUES, key=_NORM_VALUES,
       secret=st.one_of(st.none(), _SECRETS))
def test_fingerprint_is_deterministic_lowercase_hex(
    rcpt: str, template: str, key: str, secret: bytes | None
) -> None:
    """The same inputs always give the same 64-character lower-case hex fingerprint."""
    first = fingerprint(rcpt, template, key, secret=secret)
    assert first == fingerprint(rcpt, template, key, secret=secret)
    assert len(first) == 64
    assert set(first) <= set("0123456789abcdef")


@pytest.mark.parametrize("part", sorted(_PARTS))
@BOUNDED
@given(rcpt=_RECIPIENTS, template=_NORM_VALUES, key=_NORM_VALUES,
       other=st.one_of(_RECIPIENTS, _NORM_VALUES), secret=st.one_of(st.none(), _SECRETS))
def test_fingerprints_differ_when_one_part_differs(
    part: str, rcpt: str, template: str, key: str, other: str, secret: bytes | None
) -> None:
    """Changing only the recipient, only the template or only the key changes the fingerprint."""
    base = (rcpt, template, key)
    changed = _PARTS[part](base, other)
    if changed == base:
        return
    assert fingerprint(*changed, secret=secret) != fingerprint(*base, secret=secret)


@BOUNDED
@given(rcpt=_RECIPIENTS, template=_NORM_VALUES, key=_NORM_VALUES, secret=_SECRETS)
def test_hmac_fingerprint_differs_from_plain(
    rcpt: str, template: str, key: str, secret: bytes
) -> None:
    """With a secret the fingerprint is an HMAC that differs from the plain SHA-256 one."""
    assert fingerprint(rcpt, template, key, secret=secret) != fingerprint(rcpt, template, key)
