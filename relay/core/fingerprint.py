"""Fingerprint inputs and the fingerprint itself (docs/design.md §2).

Pure functions, no I/O. A fingerprint is computed per envelope recipient::

    fp = hex(SHA-256(norm_rcpt NUL template NUL dedupe_key))     # or HMAC-SHA-256 with a secret
    store key = prefix + fp                                      # default prefix "email:fp:"

With one key, one template and plain ASCII values this equals the seed Go mailer's
``email:fp:`` + hex SHA-256 of ``lower(trim(to)) NUL template NUL key``. The header section,
value and recipient rules are in docs/design.md §2; each public function below names the RFC
sections it follows.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import contextlib
import functools
import hashlib
import hmac
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import idna

from relay.core.address import ADDRESS_LITERAL, DOT_STRING, canonical_literal
from relay.core.errors import InvalidAddressError, InvalidDedupKeyError

DEFAULT_KEY_NAMES: tuple[str, ...] = ("X-Dedupe-Key", "Idempotency-Key")
DEFAULT_TEMPLATE_NAMES: tuple[str, ...] = ("X-Template",)
DEFAULT_MAX_KEY_CHARS = 256
DEFAULT_STORE_PREFIX = "email:fp:"
#: Joins the three fingerprint parts (design.md §2).
VALUE_SEPARATOR = "\0"
#: Joins several distinct values of one field. The first contract said NUL, but then the field
#: boundary is lost: templates {a, b} with key c would hash like template a with keys {b, c}
#: (mail wrongly suppressed). A value never holds a control character (refused with 554), so
#: US (0x1F) cannot occur inside one. A single value per field, the Go seed's shape, is unchanged.
SET_SEPARATOR = "\x1f"

# -- header section -------------------------------------------------------------------------

# RFC 5322 section 3.6.8: field-name = 1*ftext, ftext = %d33-57 / %d59-126.
_FIELD_NAME = re.compile(rb"[\x21-\x39\x3b-\x7e]+")
_FOLD = re.compile(r"\r?\n(?=[ \t])")
_BLANK_RUN = re.compile(r"([ \t]+)")

# RFC 2047 section 2: encoded-word = "=?" charset "?" encoding "?" encoded-text "?=", with the
# RFC 2231 section 5 language suffix ("*" language) allowed after the charset. charset is a
# token (no SPACE, CTLs or especials); encoded-text is printable ASCII without "?" and SPACE.
_ENCODED_WORD = re.compile(
    r"=\?(?P<charset>[A-Za-z0-9!#$%&'+\-^_`{|}~]+)(?:\*[A-Za-z0-9\-]*)?"
    r"\?(?P<encoding>[BbQq])\?(?P<text>[\x21-\x3e\x40-\x7e]*)\?="
)
_Q_VALID = re.compile(r"(?:[^=]|=[0-9A-Fa-f]{2})*")
_Q_TOKEN = re.compile(r"=([0-9A-Fa-f]{2})|_")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class DedupHeaders:
    """The dedup fields of one message, normalized (design.md §2).

    ``keys`` and ``templates`` hold the distinct non-empty normalized values, sorted by code
    point. ``key`` and ``template`` are what goes into :func:`fingerprint`.
    """

    keys: tuple[str, ...]
    templates: tuple[str, ...]

    @property
    def key(self) -> str | None:
        """The key values joined by US (0x1F), or ``None`` when the message has no usable key."""
        return SET_SEPARATOR.join(self.keys) if self.keys else None

    @property
    def template(self) -> str:
        """The template values joined by US (0x1F); ``""`` when absent or empty."""
        return SET_SEPARATOR.join(self.templates)


def extract_dedup_headers(
    content: bytes,
    *,
    key_names: Sequence[str] = DEFAULT_KEY_NAMES,
    template_names: Sequence[str] = DEFAULT_TEMPLATE_NAMES,
    max_key_chars: int = DEFAULT_MAX_KEY_CHARS,
) -> DedupHeaders:
    """Read every dedupe-key and template occurrence from a message's header section.

    ``content`` is the message as received (CRLF line ends; a bare LF is accepted as a line end
    too; any bytes). Only the header section is read (:func:`header_section_end`: it ends at
    the first empty line or the first line that is neither a field nor a continuation, RFC 5322
    sections 2.1, 3.5), so a body that starts without the empty line, such as a first MIME
    part, is never read as header. Names in ``key_names``
    are aliases of one field and match case-insensitively (RFC 5322 section 1.2.2), as do
    ``template_names``; a name in both counts as a key. Each value is normalized with
    :func:`normalize_header_value`; values empty after normalization are ignored.

    Raises :class:`InvalidDedupKeyError` when any key or template occurrence is longer than
    ``max_key_chars`` characters or holds a control character (design.md §2: ``554 5.6.0``),
    and ``ValueError`` when a configured name is not an RFC 5322 field name.
    """
    wanted_keys = _field_names(key_names)
    wanted_templates = _field_names(template_names) - wanted_keys
    keys: set[str] = set()
    templates: set[str] = set()
    for name, raw in _header_fields(content):
        if name in wanted_keys:
            target, label = keys, "dedupe key"
        elif name in wanted_templates:
            target, label = templates, "template"
        else:
            continue
        value = normalize_header_value(raw, label=label, max_chars=max_key_chars)
        if value:
            target.add(value)
    return DedupHeaders(keys=tuple(sorted(keys)), templates=tuple(sorted(templates)))


def normalize_header_value(
    raw: bytes | str, *, label: str = "dedupe key", max_chars: int = DEFAULT_MAX_KEY_CHARS
) -> str:
    """Normalize one header value and check it (design.md §2).

    ``raw`` is the value after the colon, folded or not; bytes are decoded as UTF-8 with
    ``surrogateescape``, so non-UTF-8 bytes survive as U+DC80..U+DCFF. Steps: unfold (RFC 5322
    section 2.2.3), decode encoded-words (RFC 2047 sections 4, 6.2), NFC, collapse SP/HTAB runs
    to one space, trim. Returns ``""`` for a blank value. Usable for a key an operator types.

    Raises :class:`InvalidDedupKeyError` (its text names ``label``, never the value) when the
    result is longer than ``max_chars`` characters or holds a character of category Cc (CR, LF,
    NUL, DEL, C1 controls; a TAB is collapsed to a space before the check).
    """
    text = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
    text = _decode_encoded_words(_FOLD.sub("", text))
    text = _BLANK_RUN.sub(" ", unicodedata.normalize("NFC", text)).strip(" ")
    if len(text) > max_chars:
        raise InvalidDedupKeyError(
            f"{label} is {len(text)} characters long; at most {max_chars} are allowed"
        )
    control = next((char for char in text if unicodedata.category(char) == "Cc"), None)
    if control is not None:
        raise InvalidDedupKeyError(f"{label} holds the control character U+{ord(control):04X}")
    return text


def strip_fields(content: bytes, names: Sequence[str]) -> bytes:
    """``content`` without the header fields named ``names`` (their continuation lines too).

    The header section is read by the same rules as :func:`extract_dedup_headers` (so what
    is stripped is exactly what was read); the body and every other byte stay as they are.
    Used for the ``strip_dedupe_headers`` option (design.md §5.2). Raises ``ValueError``
    when a name is not an RFC 5322 field name.
    """
    wanted = _field_names(names)
    cut = header_section_end(content)
    kept: list[bytes] = []
    dropping = False
    for line in _split_lines(content[:cut]):
        if line[:1] in (b" ", b"\t"):
            if not dropping:
                kept.append(line)
            continue
        name, _ = _field_start(line.removesuffix(b"\n").removesuffix(b"\r"))
        dropping = name in wanted
        if not dropping:
            kept.append(line)
    return b"".join(kept) + content[cut:]


def header_section_end(content: bytes) -> int:
    """Offset in ``content`` of the first byte after the top-level header section.

    The section ends at the first empty line (RFC 5322 section 2.1) or at the first line that
    can be neither a field (``name [blanks] ":"``, RFC 5322 sections 3.6.8, 4.5.8) nor a
    continuation (starts with SP or HTAB, section 2.2.3): a body that starts without the empty
    line is body, never header (RFC 5322 section 3.5; Python's MissingHeaderBodySeparatorDefect
    rule). A first line ``From ...`` (an mbox envelope line) is skipped, as Python's parser does.
    The returned offset is where that empty or non-field line starts, or ``len(content)``.
    Line ends are CRLF or a bare LF.
    """
    offset = 0
    for line in _split_lines(content):
        if not _in_header_section(line.removesuffix(b"\n").removesuffix(b"\r"), offset == 0):
            return offset
        offset += len(line)
    return len(content)


def _in_header_section(line: bytes, first: bool) -> bool:
    """Whether ``line`` (without its line end) can belong to a header section."""
    if line[:1] in (b" ", b"\t"):
        return True
    if first and line.startswith(b"From "):
        return True
    return _field_start(line)[0] is not None


def _split_lines(data: bytes) -> Iterator[bytes]:
    """The lines of ``data``, each with its LF (or CRLF) end; the last may have none."""
    start = 0
    while start < len(data):
        stop = data.find(b"\n", start) + 1 or len(data)
        yield data[start:stop]
        start = stop


def check_field_names(names: Sequence[str]) -> None:
    """Raise ``ValueError`` (naming the bad one) unless every name is an RFC 5322 field name
    (section 3.6.8: printable ASCII without the colon); the settings check this at start-up."""
    _field_names(names)


def _field_names(names: Sequence[str]) -> frozenset[bytes]:
    """Lower-cased ASCII field names; a bare str counts as one name, not as its letters."""
    if isinstance(names, str):
        names = (names,)
    result: set[bytes] = set()
    for name in names:
        encoded = name.encode("ascii", "replace")
        if not name.isascii() or _FIELD_NAME.fullmatch(encoded) is None:
            raise ValueError(f"not an RFC 5322 header field name: {name!r}")
        result.add(encoded.lower())
    return frozenset(result)


def first_field(content: bytes, name: str) -> str | None:
    """The unfolded value of the first ``name`` field of ``content``'s header section (the
    name matches case-insensitively, RFC 5322 section 1.2.2), decoded as UTF-8 with
    replacement and stripped of surrounding blanks; None when there is none."""
    wanted = name.lower().encode("ascii")
    for field_name, raw in _header_fields(content):
        if field_name == wanted:
            return raw.decode("utf-8", "replace").strip(" \t")
    return None


def _header_fields(content: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Yield (lower-cased name, unfolded raw value) for each field of the header section."""
    name: bytes | None = None
    parts: list[bytes] = []
    for raw_line in _split_lines(content[: header_section_end(content)]):
        line = raw_line.removesuffix(b"\n").removesuffix(b"\r")
        if line[:1] in (b" ", b"\t"):
            parts.append(line)  # RFC 5322 section 2.2.3: unfolding deletes the line end only
            continue
        if name is not None:
            yield name, b"".join(parts)
        name, parts = _field_start(line)
    if name is not None:
        yield name, b"".join(parts)


def _field_start(line: bytes) -> tuple[bytes | None, list[bytes]]:
    """Split ``name: value``; (None, []) for a line that does not start a field."""
    name, colon, value = line.partition(b":")
    name = name.rstrip(b" \t")  # RFC 5322 section 4.5.8 (obs-optional): blanks before the colon
    if not colon or _FIELD_NAME.fullmatch(name) is None:
        return None, []
    return name.lower(), [value]


# -- RFC 2047 ---------------------------------------------------------------------------------


def _decode_encoded_words(text: str) -> str:
    """Decode the encoded-words of an unstructured value (RFC 2047 sections 5(1), 6.2).

    An encoded-word counts only as a whole blank-delimited word. Consecutive encoded-words of
    one charset are joined as bytes, then decoded; blanks between two decoded runs are dropped.
    A run that is malformed, in an unknown charset or undecodable stays literal.
    """
    pieces = _BLANK_RUN.split(text)  # words at even indexes, blank runs at odd ones
    words = pieces[0::2]
    parsed = [_parse_encoded_word(word) for word in words]
    out: list[str] = []
    previous_decoded = False
    start = 0
    while start < len(words):
        stop, unit, decoded = _take_unit(pieces, parsed, start)
        if start > 0 and not (previous_decoded and decoded):
            out.append(pieces[2 * start - 1])
        out.append(unit)
        previous_decoded = decoded
        start = stop
    return "".join(out)


def _take_unit(
    pieces: list[str], parsed: list[tuple[str, bytes] | None], start: int
) -> tuple[int, str, bool]:
    """From word ``start``: (next word index, text, whether it was decoded)."""
    first = parsed[start]
    if first is None:
        return start + 1, pieces[2 * start], False
    charset = first[0]
    stop = start + 1
    while stop < len(parsed) and (following := parsed[stop]) is not None:
        if following[0] != charset:
            break
        stop += 1
    data = b"".join(item[1] for item in parsed[start:stop] if item is not None)
    decoded = _decode_charset(data, charset)
    if decoded is None:
        return stop, "".join(pieces[2 * start : 2 * stop - 1]), False
    return stop, decoded, True


def _parse_encoded_word(word: str) -> tuple[str, bytes] | None:
    """(charset, raw bytes) of one encoded-word, or None when it is not one.

    The charset is named by its Python codec (``utf8`` and ``UTF-8`` are one charset, so their
    words join); an unknown one stays as written, lowercased, and later fails to decode. An
    empty encoded-text (``=?utf-8?q??=``, which CPython's header folder writes) is the empty
    string: RFC 2047 asks for at least one character, but the writer meant nothing else.
    """
    match = _ENCODED_WORD.fullmatch(word)
    if match is None:
        return None
    text = match["text"]
    data = _b_decode(text) if match["encoding"] in "Bb" else _q_decode(text)
    if data is None:
        return None
    charset = match["charset"].lower()
    with contextlib.suppress(LookupError):
        charset = codecs.lookup(charset).name
    return charset, data


def _b_decode(text: str) -> bytes | None:
    """RFC 2047 section 4.1 ("B" is RFC 2045 base64); missing padding is tolerated."""
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error:
        return None


def _q_decode(text: str) -> bytes | None:
    """RFC 2047 section 4.2: ``_`` is 0x20, ``=XX`` a hex octet; a stray ``=`` is malformed."""
    if _Q_VALID.fullmatch(text) is None:
        return None
    decoded = _Q_TOKEN.sub(lambda m: chr(int(m[1], 16)) if m[1] else " ", text)
    return decoded.encode("latin-1")


_NOT_MIME_CHARSETS = frozenset(
    {"unicode-escape", "raw-unicode-escape", "idna", "punycode", "undefined"})


def _decode_charset(data: bytes, charset: str) -> str | None:
    """Strictly decode; None for an unknown or non-text codec, bad bytes or lone surrogates.

    Python codecs that are no MIME charset (``unicode_escape``, ``idna``...) are refused, so
    an encoded-word cannot make two different byte strings decode alike.
    """
    try:
        if codecs.lookup(charset).name in _NOT_MIME_CHARSETS:
            return None
        text = data.decode(charset)
    except (LookupError, ValueError):  # ValueError covers UnicodeDecodeError and codec errors
        return None
    # Surrogates in a value stand only for raw non-UTF-8 bytes (surrogateescape).
    return None if _SURROGATE.search(text) else text


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


# -- fingerprint ------------------------------------------------------------------------------


def fingerprint(norm_rcpt: str, template: str, key: str, *, secret: bytes | None = None,
                scope: str | None = None) -> str:
    """Lower-case hex SHA-256 of ``norm_rcpt NUL template NUL key`` (design.md §2).

    Inputs are :func:`normalize_recipient` output and :class:`DedupHeaders` ``template`` /
    ``key``; they are encoded as UTF-8 with ``surrogateescape``, so raw non-UTF-8 header bytes
    hash as themselves. With ``secret`` the digest is HMAC-SHA-256 (RFC 2104) keyed by it.
    A non-empty ``scope`` (the AUTH identity, design.md §2's optional tenant scoping) is a
    fourth NUL-joined part, so two tenants' equal keys never suppress each other; without one
    the input is the seed's three parts. Returns 64 hex characters. Raises ``ValueError`` for
    an empty secret.
    """
    parts = (norm_rcpt, template, key, scope) if scope else (norm_rcpt, template, key)
    data = VALUE_SEPARATOR.join(parts).encode("utf-8", "surrogateescape")
    if secret is None:
        return hashlib.sha256(data).hexdigest()
    if not secret:
        raise ValueError("an HMAC secret must not be empty")
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def store_key(prefix: str, fp: str) -> str:
    """The store key of a fingerprint: ``prefix + fp`` (default prefix ``email:fp:``)."""
    return prefix + fp
