"""A bounded, seeded fuzz run of the DATA path against a live relay (design.md §1, §4, §5).

One relay on the real Redis, in front of the recording aiosmtpd sink, gets about 150 messages
over loopback from the byte-exact RawClient: well-formed messages with and without dedupe
headers (spelled, folded and encoded in many ways), random header fields (printable, 8-bit,
UTF-8), folded and very long header values, lone CR, lone LF and NUL octets, lines of 990-1010
octets, leading dots, empty bodies, messages without the empty line, random binary bodies, and
resends of earlier messages (the same bytes, or the same headers with a new body).

The client dot-stuffs every line (RFC 5321 section 4.5.2) and ends with CRLF.CRLF. The run is
made under both values of ``bare_newline``: under ``normalize`` the relay sees the message with
its lone LFs made CRLF (and the client stuffs a line after a lone LF too, as smtplib does); under
``reject`` a lone LF is refused. For each message the test predicts the reply from the
contract, with relay.core.fingerprint as the fingerprint oracle and the sink's record as the
history of what was delivered, and checks the reply, what reached the sink, and that the session
still answers. Discrepancies are collected and reported together at the end, so one run shows
every one of them.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import random
import re
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aredis

from relay.app import Relay
from relay.core import replies
from relay.core.errors import InvalidDedupKeyError
from relay.core.fingerprint import fingerprint
from relay.core.headers import DedupHeaders, extract_dedup_headers
from relay.core.recipients import normalize_recipient
from tests.support.clients import RawClient
from tests.support.relays import MakeRelay
from tests.support.sink import Delivered, Sink
from tests.support.wire import added_before

SEED = 20240917
MESSAGES = 150
RECONNECT_EVERY = 40
# RFC 5321 section 4.5.3.1.6: 1000 octets per line including CRLF, "not counting the leading
# dot duplicated for transparency"
MAX_LINE_OCTETS = 1000

REPLY_LINE = re.compile(r"^([245])\d\d ([245])\.\d{1,3}\.\d{1,3}(?: |$)")
BARE_CR_OR_LF = re.compile(rb"\r(?!\n)|(?<!\r)\n")
LINE_START_DOT = re.compile(rb"(?:\A|(?<=\r\n))\.")
LINE_START_DOT_AFTER_LF = re.compile(rb"(?m)^\.")
BARE_LF = re.compile(rb"(?<!\r)\n")

# every spelling in a group is one recipient after normalization (design.md §2)
RECIPIENT_GROUPS = (
    ("user@example.net", "User@Example.NET", "USER@EXAMPLE.net"),
    ("other@example.net", "Other@EXAMPLE.NET"),
    ("jörg@bücher.example", "JÖRG@BÜCHER.example", "jörg@xn--bcher-kva.example"),
    ("postmaster@example.net", "Postmaster@Example.Net"),
    ('"quoted user"@example.net', '"Quoted User"@example.net'),
)
SENDERS = ("app@example.com", "", "absender@bücher.example")
KEYS = (*(f"K-{n}" for n in range(20)), "Kö-1", "order 123 for customer 42")
TEMPLATES = ("welcome", "invoice", "password reset")
UTF8_WORDS = ("Grüße", "日本語", "Ελληνικά", "ñandú", "🙂", "naïve café")
FTEXT = bytes(c for c in range(0x21, 0x7F) if c != ord(":"))
PRINTABLE = bytes(range(0x20, 0x7F))

# what the corpus must contain, so a change of seed or weights cannot silently drop a case
KINDS = {
    "head:valid", "head:valid+random", "head:random", "head:none", "head:long-subject",
    "head:long-key", "head:long-line", "key", "no-key", "body:text", "body:dots", "body:long",
    "body:long-dot", "body:empty", "body:binary-crlf", "body:binary-raw", "no-separator",
    "bad:cr", "bad:lf", "bad:nul", "resend:same", "resend:new-body", "smtputf8",
}


# ------------------------------------------------------------------------------------------
# the corpus
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outgoing:
    """One message to send: envelope, header section and body (the message is ``data``)."""

    mail_from: str
    rcpts: tuple[str, ...]
    head: bytes
    body: bytes
    kinds: frozenset[str]
    smtputf8: bool

    @property
    def data(self) -> bytes:
        """The message as the relay must rebuild it: CRLF-terminated, or empty."""
        raw = self.head + self.body
        return raw if raw == b"" or raw.endswith(b"\r\n") else raw + b"\r\n"


def key_field(rnd: random.Random, key: str) -> bytes:
    """A dedupe-key field for ``key``: any name case or alias, folded or encoded."""
    name = rnd.choice([b"X-Dedupe-Key", b"x-dedupe-key", b"X-DEDUPE-KEY", b"Idempotency-Key"])
    raw = key.encode()
    return rnd.choice([
        name + b": " + raw,
        name + b":" + raw + b"  \t",
        name + b":\r\n\t" + raw,
        name + b": =?utf-8?b?" + base64.b64encode(raw) + b"?=",
        name + b": " + raw.replace(b" ", b"\r\n   "),
    ])


def template_field(rnd: random.Random, template: str) -> bytes:
    """An X-Template field for ``template``."""
    name = rnd.choice([b"X-Template", b"x-template", b"X-TEMPLATE"])
    raw = template.encode()
    return rnd.choice([
        name + b": " + raw,
        name + b":\t " + raw.replace(b" ", b"   "),
        name + b": =?UTF-8?Q?" + raw.replace(b" ", b"_") + b"?=",
    ])


def random_value(rnd: random.Random) -> bytes:
    """A header value: printable ASCII, 8-bit bytes or UTF-8 words, maybe folded."""
    kind = rnd.randrange(3)
    if kind == 0:
        value = bytes(rnd.choice(PRINTABLE) for _ in range(rnd.randrange(80)))
    elif kind == 1:
        value = bytes(rnd.choice([rnd.randrange(0x80, 0x100), *b"ab "])
                      for _ in range(rnd.randrange(1, 40)))
    else:
        value = " ".join(rnd.choices(UTF8_WORDS, k=rnd.randrange(1, 6))).encode()
    if rnd.random() < 0.3:
        value = value.replace(b" ", b"\r\n ", 1)
    return value


def random_field(rnd: random.Random) -> bytes:
    """A field with a random RFC 5322 name and a random value."""
    name = bytes(rnd.choice(FTEXT) for _ in range(rnd.randrange(1, 20)))
    return name + b":" + rnd.choice([b" ", b""]) + random_value(rnd)


def folded(words: list[str], width: int = 70) -> bytes:
    """``words`` joined by spaces and folded before a blank every ~``width`` octets."""
    lines, current = [], ""
    for word in words:
        if current and len(current) + len(word) > width:
            lines.append(current)
            current = ""
        current += " " + word
    return "\r\n".join([*lines, current]).encode()


@dataclass
class Corpus:
    """The seeded message generator; ``sent`` keeps every message built so far."""

    rnd: random.Random
    sent: list[Outgoing] = field(default_factory=list)

    def envelope(self) -> tuple[str, tuple[str, ...]]:
        groups = self.rnd.sample(RECIPIENT_GROUPS, self.rnd.choice([1, 1, 2]))
        return self.rnd.choice(SENDERS), tuple(self.rnd.choice(g) for g in groups)

    def dedup_fields(self, kinds: set[str]) -> list[bytes]:
        out = []
        if self.rnd.random() < 0.7:
            out.append(template_field(self.rnd, self.rnd.choice(TEMPLATES)))
        if self.rnd.random() < 0.75:
            kinds.add("key")
            out.append(key_field(self.rnd, self.rnd.choice(KEYS)))
        else:
            kinds.add("no-key")
        self.rnd.shuffle(out)
        return out

    def valid_fields(self, kinds: set[str]) -> list[bytes]:
        subject = " ".join(self.rnd.choices(["hello", "order", "Grüße", "news"], k=3))
        return [
            b"From: App <app@example.com>",
            b"To: user@example.net",
            b"Subject: " + subject.encode(),
            b"Date: Mon, 1 Jan 2024 00:00:00 +0000",
            f"Message-ID: <{self.rnd.getrandbits(64):x}@example.com>".encode(),
            *self.dedup_fields(kinds),
        ]

    def long_field(self, kinds: set[str]) -> list[bytes]:
        kind = self.rnd.choice(["long-subject", "long-key", "long-line"])
        kinds.add(f"head:{kind}")
        if kind == "long-subject":
            return [b"Subject:" + folded(self.rnd.choices((*UTF8_WORDS, "word"), k=600))]
        if kind == "long-key":
            return [b"X-Dedupe-Key:" + folded(["k" * 50] * self.rnd.randrange(5, 12))]
        octets = self.rnd.randrange(990, 1011)
        return [b"X-Long: " + b"v" * (octets - len(b"X-Long: "))]

    def header(self, kinds: set[str]) -> list[bytes]:
        kind = self.rnd.choices(["valid", "valid+random", "random", "none", "long"],
                                weights=[5, 3, 2, 1, 2])[0]
        if kind == "long":
            return self.valid_fields(kinds) + self.long_field(kinds)
        kinds.add(f"head:{kind}")
        if kind == "none":
            return []
        extra = [random_field(self.rnd) for _ in range(self.rnd.randrange(1, 6))]
        if kind == "random":
            return extra + self.dedup_fields(kinds) if self.rnd.random() < 0.5 else extra
        fields = self.valid_fields(kinds)
        if kind == "valid+random":
            fields += extra
            self.rnd.shuffle(fields)
        return fields

    def long_lines(self, kinds: set[str]) -> bytes:
        lines = []
        for _ in range(self.rnd.randrange(1, 4)):
            # the boundary (998 octets + CRLF) twice as often as any other length
            octets = self.rnd.choice([997, 998, 998, 999, self.rnd.randrange(990, 1011)])
            dot = self.rnd.random() < 0.4
            kinds.add("body:long-dot" if dot else "body:long")
            lines.append((b"." if dot else b"") + b"x" * (octets - dot))
        return b"\r\n".join(lines) + b"\r\n"

    def binary(self, kinds: set[str]) -> bytes:
        raw = self.rnd.randbytes(self.rnd.randrange(1, 1500))
        if self.rnd.random() < 0.5:
            kinds.add("body:binary-crlf")
            raw = re.sub(rb"\r\n|\r|\n", b"\r\n", raw)
            return raw.replace(b"\0", b"") if self.rnd.random() < 0.5 else raw
        kinds.add("body:binary-raw")  # lone CR/LF stay; a CRLF at least every 900 octets
        parts, at = [], 0
        while at < len(raw):
            step = self.rnd.randrange(1, 900)
            parts.append(raw[at : at + step])
            at += step
        return b"\r\n".join(parts)

    def body(self, kinds: set[str]) -> bytes:
        kind = self.rnd.choices(["text", "dots", "long", "empty", "binary"],
                                weights=[4, 2, 2, 1, 2])[0]
        if kind == "long":
            return self.long_lines(kinds)
        if kind == "binary":
            return self.binary(kinds)
        kinds.add(f"body:{kind}")
        if kind == "empty":
            return b""
        if kind == "dots":
            pool = [".", "..", ".hidden", "...", ". x", ".\t", "x", "", "From here"]
        else:
            pool = ["Hello,", "your order shipped.", "", *UTF8_WORDS, "-- ", "X-Dedupe-Key: no"]
        lines = self.rnd.choices(pool, k=self.rnd.randrange(1, 10))
        return "".join(line + "\r\n" for line in lines).encode()

    def bad_octet(self, data: bytes, kinds: set[str]) -> bytes:
        """Insert one lone CR, lone LF or NUL at a random place."""
        octet, kind = self.rnd.choice([(b"\r", "bad:cr"), (b"\n", "bad:lf"), (b"\0", "bad:nul")])
        for _ in range(20):
            at = self.rnd.randrange(len(data) + 1)
            lone = not ((octet == b"\r" and data[at:at + 1] == b"\n")
                        or (octet == b"\n" and data[at - 1:at] == b"\r"))
            if lone:
                kinds.add(kind)
                return data[:at] + octet + data[at:]
        return data

    def resend(self) -> Outgoing:
        earlier = self.rnd.choice(self.sent)
        groups = [next(g for g in RECIPIENT_GROUPS if r in g) for r in earlier.rcpts]
        rcpts = tuple(self.rnd.choice(g) for g in groups)
        kinds = {"resend:same"}
        body = earlier.body
        if earlier.head and self.rnd.random() < 0.3:
            kinds = {"resend:new-body"}
            body = self.body(kinds)
        return self.finish(self.rnd.choice(SENDERS), rcpts, earlier.head, body,
                           kinds | earlier.kinds)

    def finish(self, mail_from: str, rcpts: tuple[str, ...], head: bytes, body: bytes,
               kinds: set[str]) -> Outgoing:
        """The message, with SMTPUTF8 when an address needs it (and mostly for UTF-8 headers)."""
        needs = not all(a.isascii() for a in (mail_from, *rcpts)) or (
            not head.isascii() and self.rnd.random() < 0.7)
        if needs:
            kinds.add("smtputf8")
        return Outgoing(mail_from=mail_from, rcpts=rcpts, head=head, body=body,
                        kinds=frozenset(kinds), smtputf8=needs)

    def fresh(self) -> Outgoing:
        kinds: set[str] = set()
        lines = self.header(kinds)
        head = b"".join(line + b"\r\n" for line in lines)
        if lines and self.rnd.random() < 0.08:
            kinds.add("no-separator")
            body = b""
        else:
            head += b"\r\n"
            body = self.body(kinds)
        if self.rnd.random() < 0.12:
            body = self.bad_octet(body, kinds) if body else body
            if self.rnd.random() < 0.3:
                head = self.bad_octet(head, kinds)
        mail_from, rcpts = self.envelope()
        return self.finish(mail_from, rcpts, head, body, kinds)

    def next(self) -> Outgoing:
        out = self.resend() if self.sent and self.rnd.random() < 0.15 else self.fresh()
        self.sent.append(out)
        return out


# ------------------------------------------------------------------------------------------
# the oracle
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """The reply the contract calls for, and the normalized recipients that must go upstream.

    ``exact`` is the whole reply when it is fixed; otherwise ``prefix`` starts it, and a 250
    that relays is rebuilt from the catalogue with the queue id the relay chose.
    """

    prefix: str
    exact: str | None = None
    deliver: frozenset[str] = frozenset()
    suppressed: int = 0
    relayed: int = 0


def dedup_headers(data: bytes) -> DedupHeaders | None:
    """The dedup headers of ``data``, or None when they are invalid."""
    try:
        return extract_dedup_headers(data)
    except InvalidDedupKeyError:
        return None


def too_long_line(data: bytes) -> bool:
    """Whether a line, CRLF included and unstuffed, exceeds 1000 octets."""
    return any(len(line) + 2 > MAX_LINE_OCTETS for line in data.split(b"\r\n")[:-1])


def has_bad_octet(data: bytes) -> bool:
    """Whether ``data`` holds a lone CR, a lone LF or a NUL."""
    return BARE_CR_OR_LF.search(data) is not None or b"\0" in data


def expect(out: Outgoing, delivered_fps: set[str]) -> Expected:
    """What design.md §2, §4 and §5 say the relay answers to ``out`` now."""
    data = out.data
    if too_long_line(data):
        return Expected(prefix="500 5.5.2", exact=str(replies.LINE_TOO_LONG))
    if BARE_CR_OR_LF.search(data):
        return Expected(prefix="550 5.6.0", exact=str(replies.BARE_CR_OR_LF))
    if b"\0" in data:
        return Expected(prefix="550 5.6.0", exact=str(replies.NUL_IN_MESSAGE))
    headers = dedup_headers(data)
    if headers is None:
        return Expected(prefix="554 5.6.0 Invalid dedupe header: ")
    norm = [normalize_recipient(r) for r in out.rcpts]
    if headers.key is None:
        return Expected(prefix="250 2.0.0 Ok: relayed", deliver=frozenset(norm),
                        relayed=len(norm))
    fresh = frozenset(n for n in norm
                      if fingerprint(n, headers.template, headers.key) not in delivered_fps)
    if not fresh:
        return Expected(prefix=f"250 2.0.0 Ok: duplicate suppressed for {len(norm)} recipient(s)",
                        suppressed=len(norm))
    return Expected(prefix="250 2.0.0 Ok: relayed", deliver=fresh, relayed=len(fresh),
                    suppressed=len(norm) - len(fresh))


def delivered_fingerprints(data: bytes, new: list[Delivered]) -> set[str]:
    """The fingerprints that the deliveries ``new`` of message ``data`` put on record."""
    headers = dedup_headers(data)
    if headers is None or headers.key is None:
        return set()
    return {fingerprint(normalize_recipient(r), headers.template, headers.key)
            for d in new for r in d.rcpt_tos}


def form_problems(reply: str, out: Outgoing) -> list[str]:
    """Shape of the reply: one line, 2yz/4yz/5yz with an RFC 3463 code of the same class."""
    match = REPLY_LINE.match(reply)
    if "\n" in reply or match is None or match[1] != match[2]:
        return [f"malformed reply {reply!r}"]
    if has_bad_octet(out.data) and not too_long_line(out.data) and not reply.startswith(
            "550 5.6.0 "):
        return [f"lone CR/LF or NUL answered {reply!r}, not 550 5.6.0"]
    return []


def trace_problems(delivered: Delivered, data: bytes) -> list[str]:
    """The sink got ``data`` unchanged after exactly one Received: header (RFC 5321 4.4) and
    the Message-ID the relay adds to a message without one (add_message_id)."""
    content = delivered.content
    if not content.endswith(data):
        return [f"upstream content differs: sent {data[:80]!r}, got {content[:160]!r}"]
    lines = content[: len(content) - len(data)].split(b"\r\n")
    for start in added_before(data):
        if len(lines) < 3 or not lines[-2].startswith(start):
            return [f"no {start!r} line added before the message: {lines!r}"]
        del lines[-2]
    if not lines[0].startswith(b"Received: from ") or lines[-1] != b"" or not all(
            line[:1] in (b" ", b"\t") for line in lines[1:-1]):
        return [f"upstream got more than one Received: header before the message: {lines!r}"]
    return []


def delivery_problems(reply: str, exp: Expected, new: list[Delivered], data: bytes) -> list[str]:
    """What reached the sink matches the reply: one transaction for 250, none otherwise."""
    if not reply.startswith("250 "):
        return [f"refused with {reply!r}, yet upstream got it"] if new else []
    if not new:
        return [] if "suppressed" in reply else [f"250 without delivery or suppression: {reply!r}"]
    if len(new) != 1:
        return [f"{len(new)} upstream transactions for one message"]
    got = {normalize_recipient(r) for r in new[0].rcpt_tos}
    problems = trace_problems(new[0], data)
    if got != exp.deliver or len(new[0].rcpt_tos) != len(exp.deliver):
        problems.append(f"upstream recipients {new[0].rcpt_tos}, expected {sorted(exp.deliver)}")
    return problems


def oracle_problems(reply: str, exp: Expected) -> list[str]:
    """The reply is the one the contract predicts."""
    if exp.exact is not None:
        return [] if reply == exp.exact else [f"expected {exp.exact!r}, got {reply!r}"]
    if not reply.startswith(exp.prefix):
        return [f"expected a reply starting {exp.prefix!r}, got {reply!r}"]
    if exp.relayed:
        queue_id = reply.rpartition("id=")[2]
        wanted = str(replies.accepted(exp.relayed, exp.suppressed, 0, queue_id))
        return [] if reply == wanted else [f"expected {wanted!r}, got {reply!r}"]
    return []


# ------------------------------------------------------------------------------------------
# the client side
# ------------------------------------------------------------------------------------------


def stuffed(data: bytes, bare_newline: str) -> bytes:
    """``data`` with a dot added before every line that starts with one (RFC 5321 4.5.2); a
    line after a lone LF counts as one under ``normalize``."""
    if bare_newline == "normalize":
        return LINE_START_DOT_AFTER_LF.sub(b"..", data)
    return LINE_START_DOT.sub(b"..", data)


def as_read(data: bytes, bare_newline: str) -> bytes:
    """``data`` as the relay reads it: under ``normalize`` every lone LF is a CRLF."""
    return BARE_LF.sub(b"\r\n", data) if bare_newline == "normalize" else data


async def send_one(client: RawClient, out: Outgoing, bare_newline: str) -> str:
    """MAIL, RCPT..., DATA, the stuffed message and CRLF.CRLF; returns the final reply."""
    data = out.data
    params = (" SMTPUTF8" if out.smtputf8 else "") + (
        "" if data.isascii() else " BODY=8BITMIME")
    reply = await client.cmd(f"MAIL FROM:<{out.mail_from}>{params}".encode())
    assert reply == str(replies.SENDER_OK), (out.mail_from, params, reply)
    for rcpt in out.rcpts:
        reply = await client.cmd(f"RCPT TO:<{rcpt}>".encode())
        assert reply == str(replies.RECIPIENT_OK), (rcpt, reply)
    reply = await client.cmd("DATA")
    assert reply.startswith("354 "), reply
    await client.write(stuffed(data, bare_newline) + b".\r\n")
    return await client.reply()


async def session(port: int) -> RawClient:
    client = await RawClient.connect(port)
    reply = await client.cmd("EHLO fuzz.example")
    assert reply.startswith("250"), reply
    return client


async def quit_session(client: RawClient) -> None:
    """QUIT is answered 221 and nothing else is left unread on the connection."""
    reply = await client.cmd("QUIT")
    assert reply.startswith("221 "), reply
    assert await client.reader.read() == b""
    await client.close()


async def stored_values(relay: Relay) -> dict[bytes, bytes]:
    """Every key under the relay's prefix and its value (``P|`` PENDING, ``S|`` SENT...)."""
    client = aredis.Redis.from_url(relay.settings.store)  # no decode_responses: bytes
    try:
        stored: dict[bytes, bytes] = {}
        async for key in client.scan_iter(match=relay.settings.store_prefix + "*"):
            value = await client.get(key)
            assert isinstance(value, bytes), (key, value)
            stored[key] = value
        return stored
    finally:
        await client.aclose()


def describe(index: int, out: Outgoing) -> str:
    """One line naming a message of the corpus, for the failure report."""
    long_lines = [(len(line), line[:1]) for line in out.data.split(b"\r\n") if len(line) > 900]
    return (f"#{index} kinds={sorted(out.kinds)} from={out.mail_from!r} rcpts={out.rcpts} "
            f"lines>900 (octets w/o CRLF, first octet)={long_lines} data[:120]={out.data[:120]!r}")


# ------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("bare_newline", ["normalize", "reject"])
async def test_fuzzed_messages_get_one_sound_reply_and_the_matching_delivery(
    make_relay: MakeRelay, sink: Sink, caplog: pytest.LogCaptureFixture, bare_newline: str
) -> None:
    """Every fuzzed message gets one well-formed reply that matches what reached upstream."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", bare_newline=bare_newline)
    corpus = Corpus(random.Random(SEED))
    delivered_fps: set[str] = set()
    problems: list[str] = []
    outcomes: set[str] = set()
    client = await session(relay.port)
    for index in range(MESSAGES):
        if index and index % RECONNECT_EVERY == 0:
            await quit_session(client)
            client = await session(relay.port)
        sent = corpus.next()
        out = dataclasses.replace(sent, head=as_read(sent.head + sent.body, bare_newline),
                                  body=b"")
        exp = expect(out, delivered_fps)
        before = len(sink.handler.delivered)
        reply = await send_one(client, sent, bare_newline)
        new = sink.handler.delivered[before:]
        outcomes.add("suppressed" if "suppressed for" in reply else reply[:3])
        found = (form_problems(reply, out) + oracle_problems(reply, exp)
                 + delivery_problems(reply, exp, new, out.data))
        problems += [f"{describe(index, sent)}\n    {p}" for p in found]
        delivered_fps |= delivered_fingerprints(out.data, new)
        noop = await client.cmd("NOOP")
        assert noop.startswith("250 "), (describe(index, out), noop)
    await quit_session(client)

    assert {k for out in corpus.sent for k in out.kinds} >= KINDS, "corpus lost a case"
    assert outcomes >= {"250", "suppressed", "500", "550", "554"}, outcomes
    await quit_session(await session(relay.port))  # still accepts a new connection
    stored = await stored_values(relay)
    assert stored, "no fingerprint was stored at all"
    assert [k for k, v in stored.items() if v.startswith(b"P|")] == []  # nothing left PENDING
    tracebacks = [r for r in caplog.records
                  if r.name.split(".")[0] == "relay" and r.levelno >= logging.ERROR and r.exc_info]
    assert tracebacks == []
    assert not problems, f"{len(problems)} discrepancies:\n" + "\n".join(problems)
