"""The fault bench's traffic and checker: distinct messages, clients that retry like MTAs and
queue workers, and :func:`check`, which joins what the clients saw with the sink's log.

Counting is per fingerprint ``(recipient, key)``, the unit of design.md §1; see
:class:`Counts` for what each number means.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay.core import replies


@dataclass(frozen=True)
class BenchMessage:
    """One distinct message: a unique dedupe key and one or two recipients."""

    index: int
    key: str
    rcpts: tuple[str, ...]
    pad_bytes: int = 0  # body lines of 998 x's adding about this many bytes

    def data(self) -> bytes:
        lines = ["From: app@example.com", f"To: {self.rcpts[0]}", f"Subject: bench {self.index}",
                 f"Message-ID: <{self.key}@bench.test>", "X-Template: bench",
                 f"X-Dedupe-Key: {self.key}", "", f"message {self.index}",
                 *["x" * 998] * (self.pad_bytes // 1000), ""]
        return "\r\n".join(lines).encode()


def make_messages(count: int, tag: str, *, two_rcpt_every: int = 3, big_every: int = 0,
                  big_bytes: int = 0) -> list[BenchMessage]:
    """``count`` messages with unique keys; every ``two_rcpt_every``-th has two recipients,
    every ``big_every``-th (from the second) a body of about ``big_bytes``."""
    out = []
    for i in range(count):
        rcpts = [f"m{i}-a.{tag}@example.net"]
        if two_rcpt_every and i % two_rcpt_every == 0:
            rcpts.append(f"m{i}-b.{tag}@example.net")
        pad = big_bytes if big_every and i % big_every == 1 else 0
        out.append(BenchMessage(index=i, key=f"{tag}-{i}", rcpts=tuple(rcpts), pad_bytes=pad))
    return out


@dataclass(frozen=True)
class Attempt:
    """One SMTP attempt: the deciding reply (``code`` None: no reply, see ``error``)."""

    port: int
    code: int | None
    text: str
    error: str = ""
    after_dot: bool = False  # the client had written its final dot


class _NoReply(Exception):
    """The relay closed the connection or said nothing in time."""


async def _read_reply(reader: asyncio.StreamReader, timeout_s: float) -> tuple[int, str]:
    texts = []
    while True:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout_s)
        except (TimeoutError, OSError, ValueError) as exc:
            raise _NoReply(type(exc).__name__) from exc
        if not line:
            raise _NoReply("closed")
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        texts.append(text[4:])
        if len(text) < 4 or text[3] != "-":
            if not text[:3].isdigit():
                raise _NoReply(f"garbage {text[:40]!r}")
            return int(text[:3]), " ".join(texts)


async def send_once(port: int, msg: BenchMessage, timeout_s: float) -> Attempt:
    """One SMTP transaction to 127.0.0.1:port; never raises for network trouble."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), timeout_s)
    except (OSError, TimeoutError) as exc:
        return Attempt(port, None, "", error=f"connect: {type(exc).__name__}")
    state = {"after_dot": False}
    try:  # every reply waits timeout_s at most, the whole attempt 2 * timeout_s
        code, text = await asyncio.wait_for(
            _dialogue(reader, writer, msg, timeout_s, state), 2 * timeout_s)
        return Attempt(port, code, text, after_dot=state["after_dot"])
    except _NoReply as exc:
        return Attempt(port, None, "", error=str(exc), after_dot=state["after_dot"])
    except TimeoutError:
        return Attempt(port, None, "", error="attempt timeout", after_dot=state["after_dot"])
    finally:
        writer.close()
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(writer.wait_closed(), 1)


async def _dialogue(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    msg: BenchMessage, timeout_s: float, state: dict[str, bool]
                    ) -> tuple[int, str]:
    """Greeting to final dot; returns the first refusal or the reply to the dot."""
    code, text = await _read_reply(reader, timeout_s)
    if code != 220:
        return code, text
    steps = [b"EHLO client.bench", b"MAIL FROM:<app@example.com>",
             *(f"RCPT TO:<{r}>".encode() for r in msg.rcpts), b"DATA"]
    for line in steps:
        try:
            writer.write(line + b"\r\n")
            await asyncio.wait_for(writer.drain(), timeout_s)
        except (OSError, TimeoutError) as exc:
            raise _NoReply(type(exc).__name__) from exc
        code, text = await _read_reply(reader, timeout_s)
        if code >= 400:
            return code, text
        if (line == b"DATA") != (code == 354):  # a 354 only to DATA, only a 354 to DATA
            raise _NoReply(f"unexpected {code} to {line.split(b' ')[0].decode()}")
    payload = re.sub(rb"(?m)^\.", b"..", msg.data()) + b".\r\n"
    try:
        writer.write(payload)
        state["after_dot"] = True
        await asyncio.wait_for(writer.drain(), timeout_s)
    except (OSError, TimeoutError) as exc:
        raise _NoReply(type(exc).__name__) from exc
    code, text = await _read_reply(reader, timeout_s)
    with contextlib.suppress(OSError):
        writer.write(b"QUIT\r\n")
    return code, text


@dataclass(frozen=True)
class RetryPolicy:
    """MTA-like retries, scaled to seconds: exponential backoff with full jitter.

    4yz and no reply (refused, lost, timed out) -> retry; 5yz -> give up; 2yz -> done.
    """

    base_s: float = 0.1
    max_s: float = 2.0
    timeout_s: float = 10.0  # per reply; longer than the relay's slowest answer

    def backoff_s(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.5, 1.0) * min(self.max_s, self.base_s * 2.0 ** min(attempt, 16))


@dataclass
class MessageLog:
    """Everything one client saw for one message, and how it ended."""

    message: BenchMessage
    attempts: list[Attempt] = field(default_factory=list)
    end: str = "unfinished"  # accepted | gave_up | unfinished
    ended_at: float = 0.0

    @property
    def saw_in_doubt(self) -> bool:
        """The relay said the message is in doubt: ``451 4.4.2`` (OUTCOME_UNKNOWN or
        HELD_UNKNOWN), or a ``250`` that suppressed it because an earlier attempt is UNKNOWN."""
        doubts = {str(replies.OUTCOME_UNKNOWN), str(replies.HELD_UNKNOWN)}
        return any(f"{a.code} {a.text}" in doubts or (a.code == 250 and " in doubt" in a.text)
                   for a in self.attempts)

    def to_json(self) -> str:
        return json.dumps({"key": self.message.key, "rcpts": self.message.rcpts,
                           "end": self.end, "attempts": [asdict(a) for a in self.attempts]})


async def deliver(msg: BenchMessage, ports: Sequence[int], policy: RetryPolicy,
                  deadline: float, gate: asyncio.Semaphore, rng: random.Random) -> MessageLog:
    """Send ``msg`` until 2yz (accepted) or 5yz (gave up) or ``deadline`` (loop time).

    Attempts go to ``ports`` in turn (one port: always the same relay).
    """
    loop = asyncio.get_running_loop()
    log = MessageLog(msg)
    while loop.time() < deadline:
        port = ports[len(log.attempts) % len(ports)]
        async with gate:
            attempt = await send_once(port, msg, policy.timeout_s)
        log.attempts.append(attempt)
        if attempt.code is not None and attempt.code < 400:
            log.end = "accepted"
        elif attempt.code is not None and attempt.code >= 500:
            log.end = "gave_up"
        if log.end != "unfinished":
            log.ended_at = loop.time()
            return log
        pause = policy.backoff_s(len(log.attempts) - 1, rng)
        await asyncio.sleep(max(0.0, min(pause, deadline - loop.time())))
    return log


# ------------------------------------------------------------------------------------------
# the checker
# ------------------------------------------------------------------------------------------


@dataclass
class Counts:
    """One run's result, per fingerprint (recipient, key) unless a name says otherwise.

    ``delivered``: fingerprints with at least one copy at the sink. ``dup_outside``: more
    than one copy, and the client never saw the relay's in-doubt 451 4.4.2 for it (this
    breaks design.md §1). ``dup_unknown``: more than one copy of a fingerprint the relay
    declared in doubt (the honest exception). ``accepted_lost``: the client got 250, the sink
    has no copy, and the relay never said in doubt. ``unknown``: the client saw the in-doubt
    451 4.4.2 at least once. ``gave_up``: the client got a 5yz. ``unfinished``: no 2yz/5yz
    before the deadline. ``no_reply_after_dot``: attempts whose final dot got no reply.
    """

    messages: int = 0
    fingerprints: int = 0
    attempts: int = 0
    retries: int = 0
    delivered: int = 0
    copies: int = 0
    dup_outside: int = 0
    dup_unknown: int = 0
    accepted_lost: int = 0
    unknown: int = 0
    gave_up: int = 0
    unfinished: int = 0
    no_reply_after_dot: int = 0
    stray_copies: int = 0  # sink lines of no bench fingerprint (should be 0)
    wall_s: float = 0.0
    concerned: dict[str, list[str]] = field(default_factory=dict)
    replies: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        return (f"messages={self.messages} fingerprints={self.fingerprints} "
                f"retries={self.retries} delivered={self.delivered} copies={self.copies} "
                f"dup_outside_unknown={self.dup_outside} dup_within_unknown={self.dup_unknown} "
                f"accepted_but_lost={self.accepted_lost} unknown={self.unknown} "
                f"gave_up={self.gave_up} unfinished={self.unfinished} "
                f"no_reply_after_dot={self.no_reply_after_dot} stray={self.stray_copies} "
                f"wall={self.wall_s:.1f}s concerned={self.concerned} "
                f"replies={dict(self.replies)}")


def read_sink_log(path: Path) -> Counter[tuple[str, str]]:
    """Copies per (recipient, key) from the sink's JSON lines."""
    copies: Counter[tuple[str, str]] = Counter()
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        copies[(entry["rcpt"], entry["key"])] += 1
    return copies


def reply_class(attempt: Attempt) -> str:
    """A short label of what an attempt ended with, for the reply histogram."""
    if attempt.code is None:
        return f"no reply ({attempt.error.split(':')[0]})"
    enhanced = attempt.text.split(" ", 1)[0]
    return f"{attempt.code} {enhanced}" + (" in doubt" if "in doubt" in attempt.text else "")


def check(logs: Sequence[MessageLog], sink_log: Path) -> Counts:
    """Join the clients' logs and the sink's log into :class:`Counts`."""
    copies = read_sink_log(sink_log)
    c = Counts(messages=len(logs))
    known: set[tuple[str, str]] = set()
    for log in logs:
        c.attempts += len(log.attempts)
        c.retries += max(0, len(log.attempts) - 1)
        c.no_reply_after_dot += sum(1 for a in log.attempts if a.code is None and a.after_dot)
        c.replies.update(reply_class(a) for a in log.attempts)
        for rcpt in log.message.rcpts:
            fp = (rcpt.lower(), log.message.key)
            known.add(fp)
            _count_fingerprint(c, fp, copies[fp], log)
    c.stray_copies = sum(n for fp, n in copies.items() if fp not in known)
    return c


def _count_fingerprint(c: Counts, fp: tuple[str, str], n: int, log: MessageLog) -> None:
    name = f"{fp[0]}|{fp[1]}"
    c.fingerprints += 1
    c.copies += n
    c.delivered += n > 0
    doubt = log.saw_in_doubt
    c.unknown += doubt
    c.gave_up += log.end == "gave_up"
    c.unfinished += log.end == "unfinished"
    if n > 1:
        bucket = "dup_unknown" if doubt else "dup_outside"
        setattr(c, bucket, getattr(c, bucket) + 1)
        c.concerned.setdefault(bucket, []).append(f"{name} x{n}")
    if log.end == "accepted" and n == 0 and not doubt:
        c.accepted_lost += 1
        c.concerned.setdefault("accepted_lost", []).append(name)
    if log.end == "unfinished":
        c.concerned.setdefault("unfinished", []).append(name)
