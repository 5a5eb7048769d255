"""The nemesis's checker: one run's whole history in, the invariant's counts out.

The history (:class:`History`) is everything the run saw: every reply each client got (and
when), every final dot the smarthost received (taken or refused), the store's final record of
each fingerprint, the fingerprints ``dedup-relay in-doubt`` lists, and the copies a relay
announced as sent again over a record in doubt (``unknown_policy = send``, "possible
duplicate"). Counting is per fingerprint ``(recipient, key)``, the unit of design.md §1; the
rules (:func:`check`, also in docs/reliability.md):

- **duplicate**: more than one copy taken by the smarthost, beyond the copies a relay
  announced as sent again over a record in doubt; or two copies that relays logged as
  relayed (each read the smarthost's acceptance: the second was sent over a record that was
  in doubt only because the first one's SENT mark was lost);
- **lost**: the client's last reply was 2yz, the smarthost took no copy, and
  ``dedup-relay in-doubt`` does not list it;
- **in doubt**: listed by ``dedup-relay in-doubt``, or its final record is UNKNOWN or
  SENDING (every attempt has ended: a SENDING record is one whose relay died after the dot);
  counted, not a break; one not listed is counted apart (``unlisted``);
- **unfinished**: the client had neither 2yz nor 5yz when the run ended.

Pure: no I/O, so the rules are tested on histories written by hand.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

Fingerprint = tuple[str, str]
"""(recipient lower-cased, X-Dedupe-Key)."""

IN_DOUBT_RECORDS = frozenset({"unknown", "sending"})


@dataclass(frozen=True)
class Reply:
    """What one SMTP attempt of a client ended with (``code`` None: no reply, ``error``
    says why); ``t`` (unix seconds) when it ended; ``port`` the relay it reached."""

    t: float
    port: int
    code: int | None
    text: str
    error: str = ""

    @property
    def in_doubt(self) -> bool:
        """The relay said the message is in doubt (``451 4.4.2 ... in doubt``, or a 2yz that
        suppressed it as in doubt)."""
        return self.code is not None and "in doubt" in self.text

    def label(self) -> str:
        if self.code is None:
            return f"no reply ({self.error})"
        return f"{self.code} {self.text[:90]}"


@dataclass
class ClientRecord:
    """One message as its client saw it: ``end`` is accepted (2yz), gave_up (5yz) or
    unfinished."""

    key: str
    rcpts: tuple[str, ...]
    replies: list[Reply] = field(default_factory=list)
    end: str = "unfinished"

    def fingerprints(self) -> list[Fingerprint]:
        return [(r.lower(), self.key) for r in self.rcpts]


@dataclass(frozen=True)
class Dot:
    """One final dot the smarthost received: for ``rcpts`` (those it accepted at RCPT),
    ``taken`` when it queued the message (whatever became of its reply), ``fate`` what it
    did (ok, temp_dot, hang, close, stall)."""

    t: float
    key: str
    rcpts: tuple[str, ...]
    fate: str
    taken: bool


@dataclass
class History:
    """Everything a run saw; ``records`` maps a fingerprint to its final store state
    (absent, pending, sending, sent, unknown); ``listed`` is what ``dedup-relay in-doubt``
    lists; ``resent`` the copies relays announced as sent again over a record in doubt;
    ``relayed`` the copies relays logged as relayed (the smarthost's 2yz read)."""

    clients: list[ClientRecord]
    dots: list[Dot]
    records: dict[Fingerprint, str] = field(default_factory=dict)
    listed: set[Fingerprint] = field(default_factory=set)
    resent: Counter[Fingerprint] = field(default_factory=Counter)
    relayed: Counter[Fingerprint] = field(default_factory=Counter)


@dataclass
class Counts:
    """The checker's result. ``keys``: fingerprints; ``duplicates``, ``lost``: breaks of the
    invariant; ``in_doubt``: the honest exception, counted; ``unlisted``: in doubt but not
    listed by ``dedup-relay in-doubt``; ``doubt_without_dot``: in doubt although the
    smarthost never received a dot for it; ``doubt_refused``: in doubt, no copy, and every dot
    it received for it refused; ``doubt_unexplained``: in doubt, no copy, and no attempt of its
    client could have left it so (:func:`unexplained_doubt`); ``unfinished``: no 2yz/5yz by
    the end; ``concerned``: the fingerprints of each count but ``keys`` and ``copies``."""

    keys: int = 0
    copies: int = 0
    duplicates: int = 0
    lost: int = 0
    in_doubt: int = 0
    unlisted: int = 0
    doubt_without_dot: int = 0
    doubt_refused: int = 0
    doubt_unexplained: int = 0
    unfinished: int = 0
    concerned: dict[str, list[Fingerprint]] = field(default_factory=dict)

    @property
    def broken(self) -> bool:
        """A duplicate or a loss: the run broke the invariant."""
        return bool(self.duplicates or self.lost)

    def _add(self, name: str, fp: Fingerprint) -> None:
        setattr(self, name, getattr(self, name) + 1)
        self.concerned.setdefault(name, []).append(fp)


def _dots_by_fingerprint(dots: Iterable[Dot]) -> tuple[Counter[Fingerprint], set[Fingerprint]]:
    """(copies taken, fingerprints that reached a dot at all)."""
    taken: Counter[Fingerprint] = Counter()
    seen: set[Fingerprint] = set()
    for dot in dots:
        for rcpt in dot.rcpts:
            fp = (rcpt.lower(), dot.key)
            seen.add(fp)
            taken[fp] += dot.taken
    return taken, seen


def check(history: History) -> Counts:
    """Count ``history`` by the rules of this module's docstring."""
    taken, seen = _dots_by_fingerprint(history.dots)
    c = Counts()
    for client in history.clients:
        for fp in client.fingerprints():
            c.keys += 1
            copies = taken[fp]
            c.copies += copies
            listed = fp in history.listed
            doubt = listed or history.records.get(fp, "absent") in IN_DOUBT_RECORDS
            if copies > 1 and (copies > 1 + history.resent[fp] or history.relayed[fp] > 1):
                c._add("duplicates", fp)
            if client.end == "accepted" and copies == 0 and not listed:
                c._add("lost", fp)
            if client.end == "unfinished":
                c._add("unfinished", fp)
            if doubt:
                c._add("in_doubt", fp)
                if not listed:
                    c._add("unlisted", fp)
                if copies == 0:
                    c._add("doubt_refused" if fp in seen else "doubt_without_dot", fp)
                if copies == 0 and unexplained_doubt(client):
                    c._add("doubt_unexplained", fp)
    return c


def unexplained_doubt(client: ClientRecord) -> bool:
    """Whether the client was told "in doubt" first by a 2yz, every attempt before it having
    had a definite reply. A record goes in doubt when a relay's dot got no reply (its client
    is told ``451 4.4.2``) or when a relay died after marking it SENDING (its client gets no
    reply, or gives up waiting); neither happened to this client's attempts (a connection
    refused reached no relay), so the relay lost what it knew (an owed release or SENT mark
    never landed). Each message is sent by one client here, so no other client's attempt
    can explain it."""
    for reply in client.replies:
        if reply.in_doubt:
            return reply.code is not None and reply.code < 400
        if reply.code is None and not reply.error.startswith("connect"):
            return False
    return False


def _hms(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).strftime("%H:%M:%S.%f")[:-3]


def timeline(history: History, fp: Fingerprint,
             relay_lines: Iterable[tuple[float, str]] = ()) -> list[str]:
    """What happened to ``fp``, in time order: the client's replies, the smarthost's dots,
    the relay log lines given (``(unix time, text)``), then its final record and listing."""
    rcpt, key = fp
    events: list[tuple[float, str]] = [*relay_lines]
    for client in history.clients:
        if client.key == key and rcpt in (r.lower() for r in client.rcpts):
            events += [(r.t, f"client <- relay :{r.port}: {r.label()}") for r in client.replies]
    for dot in history.dots:
        if dot.key == key and rcpt in dot.rcpts:
            state = "taken" if dot.taken else "refused"
            events.append((dot.t, f"smarthost dot ({dot.fate}): {state}"))
    lines = [f"  {_hms(t)} {text}" for t, text in sorted(events)]
    lines.append(f"  final record {history.records.get(fp, 'absent')}; "
                 f"{'listed' if fp in history.listed else 'not listed'} by in-doubt")
    return lines
