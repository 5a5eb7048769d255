"""Key rules: a dedupe key and template derived from what an application already sends, for a
message without a key header (``[[key_rule]]``, docs/design.md §2.1). Pure functions, no I/O.

A :class:`KeyRule` is built once from its settings (:func:`build_rule`, which raises
``ValueError`` naming the rule for an invalid one); :func:`first_match` tries the rules in order
on a :class:`MessageView` (the message's header section as the core already parsed it, its
decoded text parsed on first use only) and returns the first rule whose ``match`` holds with
what its ``key`` source yields (``None`` for a miss).

Patterns are the ``regex`` module's (Python's syntax) and run over a bounded prefix of their
text (:data:`MAX_HEADER_CHARS`, :data:`MAX_TEXT_CHARS`) with a time limit
(:data:`PATTERN_TIMEOUT_S`): a backtracking pattern and a crafted message cannot make a rule
take seconds; a pattern past its limit does not match.
"""

from __future__ import annotations

import base64
import email
import email.parser
import email.policy
import functools
import hashlib
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from email.message import Message
from fnmatch import fnmatchcase
from html.parser import HTMLParser
from typing import Literal

import regex

from relay.core.errors import InvalidDedupKeyError
from relay.core.headers import ParsedMessage, normalize_header_value

RuleMode = Literal["enforce", "shadow"]
SourceKind = Literal["header", "subject", "body", "content"]

MAX_HEADER_CHARS = 998
"""Characters of a Subject or header value a pattern sees (RFC 5322 section 2.1.1's line)."""
MAX_TEXT_CHARS = 65536
"""Characters of the decoded text a ``body:`` pattern and the content digest see."""
PATTERN_TIMEOUT_S = 0.01
"""Seconds one pattern may take on one text; past it, it does not match (a miss)."""
TEMPLATE_FROM_SUBJECT = "subject"
"""The ``template`` value that takes the Subject, digit runs and hex tokens masked."""

# the built-in volatile parts of a text, removed before the content digest: URL query strings
# and fragments, UUIDs, dates and times, long hex and base64 tokens (ours: reviewed, linear)
_VOLATILE: tuple[re.Pattern[str], ...] = (
    # after a URL's path: its query and fragment (a ? or # after a character that is not a
    # blank, quote or bracket); the [?#] first lets the search skip to the next ? or #
    re.compile(r"[?#](?<=[^\s?#\"'<>][?#])[^\s\"'<>]*"),
    re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
               r"[0-9a-fA-F]{12}\b"),
    re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?"
               r"(?:Z|[+-]\d{2}:?\d{2})?)?\b"),
    re.compile(r"\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b"),
    re.compile(r"\b(?:\d{1,2} )?(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
               r"(?: \d{1,2})?,? \d{4}\b", re.IGNORECASE),
    re.compile(r"\b\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?: ?[AaPp][Mm])?"
               r"(?: ?(?:UTC|GMT|Z|[+-]\d{2}:?\d{2}))?"),
    re.compile(r"\b[0-9a-fA-F]{16,}\b"),
    re.compile(r"(?<![A-Za-z0-9_\-+/])(?=[A-Za-z0-9_\-+/]*\d)(?=[A-Za-z0-9_\-+/]*[A-Za-z])"
               r"[A-Za-z0-9_\-+/]{20,}={0,2}"),
)
_BLANKS = re.compile(r"\s+")
_HEX_TOKEN = re.compile(r"\b(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{6,}\b")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class KeyRule:
    """One ``[[key_rule]]``: ``name``; its match (each given one must hold: ``sender`` a glob
    on the envelope sender, lower-cased; ``recipient_domain`` a glob every recipient's domain
    matches; ``header`` a field name the message has; ``subject`` a pattern the Subject
    holds); its key ``source`` (``header``: the field ``field``; ``subject`` / ``body``: the
    first capture group of ``pattern``; ``content``: a digest of the normalized text);
    ``template`` (None: the message's own; :data:`TEMPLATE_FROM_SUBJECT`; else a fixed name);
    ``ignore`` (removed from the text before ``content``) and ``mode``."""

    name: str
    source: SourceKind
    field: str = ""
    pattern: regex.Pattern[str] | None = None
    sender: str | None = None
    recipient_domain: str | None = None
    header: str | None = None
    subject: regex.Pattern[str] | None = None
    template: str | None = None
    ignore: tuple[regex.Pattern[str], ...] = ()
    mode: RuleMode = "enforce"


@dataclass(frozen=True)
class RuleMatch:
    """What a matching rule derived: ``key`` (normalized; None: its source yielded nothing, a
    miss) and ``template`` (None: the message's own)."""

    rule: KeyRule
    key: str | None
    template: str | None


def _compile(text: str, what: str, name: str, *, capture: bool) -> regex.Pattern[str]:
    """``text`` compiled; ``ValueError`` naming rule ``name`` when it is invalid, or when
    ``capture`` and it has no group."""
    try:
        compiled = regex.compile(text)
    except regex.error as exc:
        raise ValueError(f"key_rule {name!r}: {what} {text!r} is not a valid pattern: {exc}"
                         ) from None
    if capture and compiled.groups < 1:
        raise ValueError(f"key_rule {name!r}: {what} {text!r} needs a capture group "
                         "(the key is its first group)")
    return compiled


def build_rule(*, name: str, key: str, sender: str | None = None,
               recipient_domain: str | None = None, header: str | None = None,
               subject: str | None = None, template: str | None = None,
               ignore: Sequence[str] = (), mode: RuleMode = "enforce") -> KeyRule:
    """A :class:`KeyRule` from its settings; ``key`` is ``header:NAME``, ``subject:REGEX``,
    ``body:REGEX`` or ``content``. Raises ``ValueError`` naming the rule for an unknown source,
    an invalid pattern or one without the capture group its key needs."""
    kind, _, arg = key.partition(":")
    source: SourceKind
    field, pattern = "", None
    if kind == "content" and not arg:
        source = "content"
    elif kind == "header" and arg.strip():
        source, field = "header", arg.strip()
    elif kind in ("subject", "body") and arg:
        source = "subject" if kind == "subject" else "body"
        pattern = _compile(arg, "key", name, capture=True)
    else:
        raise ValueError(f"key_rule {name!r}: key {key!r} is none of header:NAME, "
                         "subject:REGEX, body:REGEX, content")
    return KeyRule(
        name=name, source=source, field=field, pattern=pattern,
        sender=sender.lower() if sender else None,
        recipient_domain=recipient_domain.lower() if recipient_domain else None,
        header=header or None,
        subject=_compile(subject, "match.subject", name, capture=False) if subject else None,
        template=template or None,
        ignore=tuple(_compile(p, "ignore", name, capture=False) for p in ignore), mode=mode)


class _TextOfHtml(HTMLParser):
    """The text of an HTML part: tags dropped, character references decoded, script and
    style left out."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: object) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("br", "p", "div", "tr", "li"):
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def html_text(html: str) -> str:
    """The text of ``html`` (:class:`_TextOfHtml`)."""
    parser = _TextOfHtml()
    parser.feed(html)
    parser.close()
    return "".join(parser.parts)


_PREFERENCE = ("plain", "html")
_HEADERS = email.parser.BytesHeaderParser(policy=email.policy.compat32)
_BLANK_LINE = re.compile(rb"\r?\n\r?\n")


@dataclass(frozen=True)
class _Part:
    """One MIME part: its header fields (a compat32 :class:`Message` without a payload) and
    where its body lies in the message, ``data[start:end]`` (never copied but for the part
    chosen, never parsed line by line)."""

    head: Message
    data: bytes
    start: int
    end: int


def _part(data: bytes, start: int, end: int) -> _Part:
    """The part ``data[start:end]`` split at the end of its header section: the first empty
    line (RFC 5322 section 2.1; a part starting with one has no header field)."""
    if data.startswith(b"\n", start) or data.startswith(b"\r\n", start):
        return _Part(_HEADERS.parsebytes(b""), data, data.index(b"\n", start) + 1, end)
    found = _BLANK_LINE.search(data, start, end)
    if found is None:
        return _Part(_HEADERS.parsebytes(data[start:end]), data, end, end)
    return _Part(_HEADERS.parsebytes(data[start:found.start()] + b"\r\n"), data,
                 found.end(), end)


def _subparts(part: _Part, boundary: str) -> list[_Part]:
    """The body parts of the multipart ``part`` (RFC 2046 section 5.1.1): what lies between
    its delimiter lines (``--boundary``, blanks allowed after it; ``--boundary--`` closes),
    the preamble and epilogue left out, each part without the line break that belongs to
    the delimiter after it. An unclosed last part runs to the end. Found with
    ``bytes.find``: an attachment's lines are skipped, not read."""
    data, delimiter = part.data, b"--" + boundary.encode("utf-8", "surrogateescape")
    spans: list[tuple[int, int]] = []
    start: int | None = None
    at = data.find(delimiter, part.start, part.end)
    while at >= 0:
        eol = data.find(b"\n", at, part.end)
        line_end = part.end if eol < 0 else eol
        rest = data[at + len(delimiter):line_end].rstrip(b"\r \t")
        if (at == part.start or data[at - 1] == 0x0A) and rest in (b"", b"--"):
            if start is not None:
                stop = max(start, at - 1)
                spans.append((start, stop - 1 if data[stop - 1:stop] == b"\r" else stop))
            if rest == b"--":
                break
            start = min(line_end + 1, part.end)
        at = data.find(delimiter, at + len(delimiter), part.end)
    else:
        if start is not None:
            spans.append((start, part.end))
    return [_part(data, begin, stop) for begin, stop in spans]


def _candidates(top: _Part, part: _Part) -> Iterator[tuple[int, _Part]]:
    """``EmailMessage._find_body`` for ``("plain", "html")``: (preference, part) of each text
    part not an attachment, depth first; of a multipart/related only its root (its
    ``start`` part, else its first)."""
    head = part.head
    if head.get_content_disposition() == "attachment":
        return
    maintype, subtype = head.get_content_maintype(), head.get_content_subtype()
    if maintype == "text":
        if subtype in _PREFERENCE:
            yield _PREFERENCE.index(subtype), part
        return
    boundary = head.get_boundary() if maintype == "multipart" else None
    if boundary is None or top.head.get_boundary() is None:
        return
    subparts = _subparts(part, boundary)
    if subtype != "related":
        for subpart in subparts:
            yield from _candidates(top, subpart)
        return
    start = head.get_param("start")
    root = next((p for p in subparts if start and p.head["content-id"] == start), None)
    if root is None and subparts:
        root = subparts[0]
    if root is not None:
        yield from _candidates(top, root)


def body_part(content: bytes, header_end: int) -> Message | None:
    """The part of the message ``content`` (its header section ending at ``header_end``,
    :class:`relay.core.headers.ParsedMessage`) whose text is its body, with its payload: the
    first text/plain part, else the first text/html one, attachments skipped (what
    ``EmailMessage.get_body(("plain", "html"))`` returns); None when it has neither. The
    structure is read from the header sections and the boundary lines alone (a MiB of
    attachment costs a scan for its boundary, not a parse of its lines)."""
    body = header_end + (2 if content.startswith(b"\r\n", header_end) else
                         1 if content.startswith(b"\n", header_end) else 0)
    top = _Part(_HEADERS.parsebytes(content[:header_end] + b"\r\n"), content,
                min(body, len(content)), len(content))
    best: tuple[int, _Part] | None = None
    for found in _candidates(top, top):
        if best is None or found[0] < best[0]:
            best = found
            if found[0] == 0:
                break
    if best is None:
        return None
    chosen = best[1]
    chosen.head.set_payload(chosen.data[chosen.start:chosen.end].decode("ascii",
                                                                         "surrogateescape"))
    return chosen.head


def _charset(part: Message) -> str:
    """The charset ``part``'s text is in (``ascii`` when it names none)."""
    charset = part.get_content_charset()
    return charset if charset else "ascii"


class MessageView:
    """What the rules read of one message: its envelope sender and recipients, its header
    section (the :class:`ParsedMessage` the core already has) and, parsed on first use only,
    its decoded text (:attr:`text`)."""

    def __init__(self, message: ParsedMessage, *, mail_from: str,
                 rcpt_tos: Sequence[str]) -> None:
        self.message = message
        self.mail_from = mail_from.strip().strip("<>").lower()
        self.rcpt_tos = tuple(rcpt_tos)
        # content_digest's, by ignore patterns: computed once per message
        self.digests: dict[tuple[regex.Pattern[str], ...], str] = {}

    def field(self, name: str) -> str | None:
        """The first ``name`` field, unfolded, encoded-words decoded, blanks collapsed, at
        most :data:`MAX_HEADER_CHARS` characters; None when absent."""
        raw = self.message.first(name)
        if raw is None:
            return None
        try:
            value = normalize_header_value(raw, label="header", max_chars=1 << 20)
        except InvalidDedupKeyError:  # a control character: the raw value
            value = raw
        return value[:MAX_HEADER_CHARS]

    @functools.cached_property
    def subject(self) -> str:
        """The Subject (:meth:`field`), ``""`` without one."""
        return self.field("subject") or ""

    @functools.cached_property
    def text(self) -> str:
        """The decoded text (transfer encoding and charset decoded: the text/plain part, else
        text/html with its tags removed), at most :data:`MAX_TEXT_CHARS` characters; ``""``
        when the message has none or it cannot be decoded. The part is the one
        ``EmailMessage.get_body(("plain", "html"))`` picks (:func:`body_part`: its header
        fields read through the ``compat32`` policy, a tenth of ``email.policy.default``'s
        cost, and no attachment parsed)."""
        body = body_part(self.message.content, self.message.header_end)
        if body is None:
            return ""
        payload = body.get_payload(decode=True)
        if not isinstance(payload, bytes):
            return ""
        try:
            content = payload.decode(_charset(body), errors="replace")
        except LookupError:  # an unknown charset
            return ""
        if body.get_content_subtype() == "html":
            content = html_text(content)
        return content[:MAX_TEXT_CHARS]

    def domains(self) -> list[str]:
        """Each recipient's domain, lower-cased (``""`` for one without)."""
        return [rcpt.strip().strip("<>").rpartition("@")[2].lower() for rcpt in self.rcpt_tos]


def _search(pattern: regex.Pattern[str], text: str) -> regex.Match[str] | None:
    """``pattern`` searched in ``text`` within :data:`PATTERN_TIMEOUT_S` (None past it)."""
    try:
        return pattern.search(text, timeout=PATTERN_TIMEOUT_S)
    except TimeoutError:
        return None


def _matches(rule: KeyRule, view: MessageView) -> bool:
    """Whether every match condition ``rule`` gives holds for ``view``."""
    if rule.sender is not None and not fnmatchcase(view.mail_from, rule.sender):
        return False
    if rule.recipient_domain is not None:
        domains = view.domains()
        if not domains or not all(fnmatchcase(d, rule.recipient_domain) for d in domains):
            return False
    if rule.header is not None and view.message.first(rule.header) is None:
        return False
    return rule.subject is None or _search(rule.subject, view.subject) is not None


def normalized_text(text: str, ignore: Sequence[regex.Pattern[str]] = ()) -> str:
    """``text`` without ``ignore`` matches and the built-in volatile parts (URL query
    strings, UUIDs, dates and times, long hex and base64 tokens), blanks collapsed."""
    for pattern in ignore:
        try:
            text = pattern.sub(" ", text, timeout=PATTERN_TIMEOUT_S)
        except TimeoutError:
            continue
    for volatile in _VOLATILE:
        text = volatile.sub(" ", text)
    return _BLANKS.sub(" ", text).strip()


def content_digest(view: MessageView, ignore: Sequence[regex.Pattern[str]] = ()) -> str:
    """SHA-256 hex of the Subject and the :func:`normalized_text` of the decoded text,
    NUL-joined (MIME boundaries, Message-ID and Date are never part of it). Computed once
    per view and ``ignore`` (the view keeps it: a ``content`` rule's key and the digest the
    store keeps share one computation)."""
    key = tuple(ignore)
    found = view.digests.get(key)
    if found is None:
        data = f"{normalized_text(view.subject, ignore)}\0{normalized_text(view.text, ignore)}"
        found = view.digests[key] = hashlib.sha256(
            data.encode("utf-8", "surrogateescape")).hexdigest()
    return found


STORED_DIGEST_CHARS = 10
"""Characters of a content digest as a store keeps it (:func:`stored_digest`): 60 bits."""


def stored_digest(hex_digest: str) -> str:
    """What a store keeps of a :func:`content_digest` (64 hex): its first 60 bits as
    :data:`STORED_DIGEST_CHARS` base64url characters (RFC 4648 section 5), ``[A-Za-z0-9_-]``
    only. Two contents are told apart with certainty but for one chance in 2**60."""
    raw = base64.urlsafe_b64encode(bytes.fromhex(hex_digest[:16]))
    return raw[:STORED_DIGEST_CHARS].decode("ascii")


def subject_template(subject: str) -> str:
    """``subject`` with hex tokens and digit runs masked as ``#``, blanks collapsed."""
    return _BLANKS.sub(" ", _DIGITS.sub("#", _HEX_TOKEN.sub("#", subject))).strip()


def _source_value(rule: KeyRule, view: MessageView) -> str | None:
    """What ``rule``'s key source yields for ``view`` (None or ``""``: nothing)."""
    if rule.source == "header":
        return view.field(rule.field)
    if rule.source == "content":
        return content_digest(view, rule.ignore)
    assert rule.pattern is not None  # subject and body rules have one (build_rule)
    found = _search(rule.pattern, view.subject if rule.source == "subject" else view.text)
    return found.group(1) if found is not None else None


def _as_key(value: str | None, max_chars: int) -> str | None:
    """``value`` normalized as a key (design.md §2); a longer one becomes ``sha256:`` and its
    digest; None for nothing or a value with a control character."""
    if not value:
        return None
    try:
        key = normalize_header_value(unicodedata.normalize("NFC", value), max_chars=1 << 20)
    except InvalidDedupKeyError:
        return None
    if len(key) > max_chars:
        key = "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
    return key or None


def first_match(rules: Sequence[KeyRule], view: MessageView, *,
                max_key_chars: int) -> RuleMatch | None:
    """The first of ``rules`` whose match holds for ``view``, with the key (at most
    ``max_key_chars`` characters before the digest form) and template it derives; None when
    none matches."""
    for rule in rules:
        if not _matches(rule, view):
            continue
        template = rule.template
        if template == TEMPLATE_FROM_SUBJECT:
            template = subject_template(view.subject)[:max_key_chars]
        return RuleMatch(rule=rule, key=_as_key(_source_value(rule, view), max_key_chars),
                         template=template)
    return None
