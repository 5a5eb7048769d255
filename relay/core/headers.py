"""The header section of a message, read once (RFC 5322 sections 2.1, 2.2.3, 3.5, 3.6.8;
RFC 2047 encoded-words): where it ends, its fields with their byte spans, the dedup key and
template values (docs/design.md §2), the Message-ID, and the message without some fields.

:func:`parse_message` is the one place the end of the header section is located: the listener
calls it once per message at DATA and everything after it (the fingerprint's values, header
stripping, the audit ledger's Message-ID, the RFC 3464 notice's headers, the 8-bit checks)
reads the :class:`ParsedMessage` it returns. Pure functions, no I/O.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import contextlib
import dataclasses
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from relay.core.errors import InvalidDedupKeyError

DEFAULT_KEY_NAMES: tuple[str, ...] = ("X-Dedupe-Key", "Idempotency-Key")
DEFAULT_TEMPLATE_NAMES: tuple[str, ...] = ("X-Template",)
DEFAULT_MAX_KEY_CHARS = 256
#: Joins several distinct values of one field. The first contract said NUL, but then the field
#: boundary is lost: templates {a, b} with key c would hash like template a with keys {b, c}
#: (mail wrongly suppressed). A value never holds a control character (refused with 554), so
#: US (0x1F) cannot occur inside one. A single value per field, the Go seed's shape, is unchanged.
SET_SEPARATOR = "\x1f"

# -- fields and values ----------------------------------------------------------------------------

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
    """:meth:`ParsedMessage.dedup_headers` of ``content`` (parsed here: for callers that hold
    no :class:`ParsedMessage`, such as an admin command given a message file)."""
    return parse_message(content).dedup_headers(
        key_names=key_names, template_names=template_names, max_key_chars=max_key_chars)


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


@dataclass(frozen=True)
class HeaderField:
    """One field of a header section: its lower-cased ``name``, its unfolded raw ``value`` (the
    bytes after the colon, the line ends of its folds removed: RFC 5322 section 2.2.3), and
    ``start`` / ``end``, the offsets of its first line and of the byte after its last line's
    line end in the message."""

    name: bytes
    value: bytes
    start: int
    end: int


@dataclass(frozen=True)
class ParsedMessage:
    """A message's ``content`` (bytes as received, CRLF or bare LF line ends) with its header
    section located once: ``header_end`` is the offset of the first byte after it (RFC 5322
    sections 2.1, 3.5: at the first empty line, or at the first line that can be neither a
    field, ``name [blanks] ":"``, nor a continuation; a first ``From ...`` line, an mbox
    envelope line, is skipped as Python's parser does), ``fields`` its fields in order.
    ``eight_bit_headers`` and ``eight_bit`` say whether the header section and the whole
    content hold a byte >= 0x80 (RFC 6531 section 3.4, RFC 6152). Made by
    :func:`parse_message`."""

    content: bytes
    header_end: int
    fields: tuple[HeaderField, ...]
    eight_bit_headers: bool
    eight_bit: bool

    def first(self, name: str) -> str | None:
        """The unfolded value of the first ``name`` field (the name matches
        case-insensitively, RFC 5322 section 1.2.2), decoded as UTF-8 with replacement and
        stripped of surrounding blanks; None when there is none."""
        wanted = name.lower().encode("ascii")
        for field in self.fields:
            if field.name == wanted:
                return field.value.decode("utf-8", "replace").strip(" \t")
        return None

    @property
    def message_id(self) -> str:
        """The Message-ID field (RFC 5322 section 3.6.4) as written, ``""`` when the message
        has none; at most 998 characters (a line's limit)."""
        value = self.first("message-id")
        return value[:998] if value else ""

    def dedup_headers(self, *, key_names: Sequence[str] = DEFAULT_KEY_NAMES,
                      template_names: Sequence[str] = DEFAULT_TEMPLATE_NAMES,
                      max_key_chars: int = DEFAULT_MAX_KEY_CHARS) -> DedupHeaders:
        """Every dedupe-key and template occurrence of the header section, normalized.

        Names in ``key_names`` are aliases of one field and match case-insensitively (RFC 5322
        section 1.2.2), as do ``template_names``; a name in both counts as a key. Each value is
        normalized with :func:`normalize_header_value`; values empty after normalization are
        ignored. Only the header section is read, so a body that starts without the empty
        line, such as a first MIME part, is never read as header.

        Raises :class:`InvalidDedupKeyError` when any key or template occurrence is longer than
        ``max_key_chars`` characters or holds a control character (design.md §2: ``554
        5.6.0``), and ``ValueError`` when a configured name is not an RFC 5322 field name.
        """
        wanted_keys = _field_names(key_names)
        wanted_templates = _field_names(template_names) - wanted_keys
        keys: set[str] = set()
        templates: set[str] = set()
        for field in self.fields:
            if field.name in wanted_keys:
                target, label = keys, "dedupe key"
            elif field.name in wanted_templates:
                target, label = templates, "template"
            else:
                continue
            value = normalize_header_value(field.value, label=label, max_chars=max_key_chars)
            if value:
                target.add(value)
        return DedupHeaders(keys=tuple(sorted(keys)), templates=tuple(sorted(templates)))

    def with_field(self, name: str, value: str) -> ParsedMessage:
        """This message with the field ``name: value`` (ASCII, CRLF-terminated) added as the
        first field of its header section (after an mbox ``From`` line): every byte the
        message had follows it unchanged, its fields' offsets moved, no second parse. A
        missing Message-ID is added so (RFC 5322 section 3.6.4, as MTAs add one; the order of
        fields carries no meaning, section 3.6). Raises ``UnicodeEncodeError`` for a
        non-ASCII ``name`` or ``value``."""
        at = self.fields[0].start if self.fields else self.header_end
        line = f"{name}: {value}\r\n".encode("ascii")
        if at > 0 and self.content[at - 1:at] != b"\n":  # after a From line without its end
            line = b"\r\n" + line
        shift = len(line)
        added = HeaderField(name.lower().encode("ascii"), f" {value}".encode("ascii"),
                            at + shift - len(name) - len(value) - 4, at + shift)
        moved = [dataclasses.replace(f, start=f.start + shift, end=f.end + shift)
                 for f in self.fields]
        return ParsedMessage(content=self.content[:at] + line + self.content[at:],
                             header_end=self.header_end + shift, fields=(added, *moved),
                             eight_bit_headers=self.eight_bit_headers, eight_bit=self.eight_bit)

    def without(self, names: Sequence[str]) -> bytes:
        """The content without the header fields named ``names`` (their continuation lines
        too); the body and every other byte as they are. Used for ``strip_dedupe_headers``
        (design.md §5.2): what is stripped is exactly what :meth:`dedup_headers` read. Raises
        ``ValueError`` when a name is not an RFC 5322 field name."""
        wanted = _field_names(names)
        kept: list[bytes] = []
        offset = 0
        for field in self.fields:
            if field.name in wanted:
                kept.append(self.content[offset:field.start])
                offset = field.end
        kept.append(self.content[offset:])
        return b"".join(kept)


def parse_message(content: bytes) -> ParsedMessage:
    """``content`` with its header section located and split into fields: the one place the
    relay does so (the listener once per message at DATA). Never raises."""
    header_end, fields = _scan_header_section(content)
    return ParsedMessage(content=content, header_end=header_end, fields=fields,
                         eight_bit_headers=not content[:header_end].isascii(),
                         eight_bit=not content.isascii())


def _scan_header_section(content: bytes) -> tuple[int, tuple[HeaderField, ...]]:
    """One pass over the header section's lines: its end offset and its fields (see
    :class:`ParsedMessage`)."""
    fields: list[HeaderField] = []
    name: bytes | None = None
    parts: list[bytes] = []
    start = offset = 0
    for raw_line in _split_lines(content):
        line = raw_line.removesuffix(b"\n").removesuffix(b"\r")
        if line[:1] in (b" ", b"\t"):
            parts.append(line)  # RFC 5322 section 2.2.3: unfolding deletes the line end only
            offset += len(raw_line)
            continue
        new_name, new_parts = _field_start(line)
        first_from = offset == 0 and line.startswith(b"From ")
        if new_name is None and not first_from:
            break  # an empty line, or one that is neither a field nor a continuation
        if name is not None:
            fields.append(HeaderField(name, b"".join(parts), start, offset))
        name, parts, start = new_name, new_parts, offset
        offset += len(raw_line)
    if name is not None:
        fields.append(HeaderField(name, b"".join(parts), start, offset))
    return offset, tuple(fields)


def strip_fields(content: bytes, names: Sequence[str]) -> bytes:
    """:meth:`ParsedMessage.without` of ``content`` (parsed here)."""
    return parse_message(content).without(names)


def header_section_end(content: bytes) -> int:
    """:attr:`ParsedMessage.header_end` of ``content`` (parsed here)."""
    return parse_message(content).header_end


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


