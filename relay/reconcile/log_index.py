"""What a log-reading source keeps between looks: the verdicts its log recorded per
Message-ID, with when they were logged, and the rule that picks the one about an attempt
(docs/operating/reconciliation.md, evidence sources)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from relay.reconcile.evidence import Evidence, Query, Verdict
from relay.reconcile.log_tail import LogTail

DETAIL_LIMIT = 1024  # bytes of an Evidence's detail (its docstring's bound)
DEFAULT_KEEP_S = 2 * 86400.0
DEFAULT_SKEW_S = 2.0
DEFAULT_MAX_VERDICTS = 200_000  # about 110 MB of verdicts (0.5 KiB each) at most
_TRIM_EVERY_S = 60.0


def id_key(message_id: str) -> str:
    """A Message-ID without its angle brackets and surrounding blanks (Exim logs it without
    them, Postfix with them)."""
    return message_id.strip().removeprefix("<").removesuffix(">").strip()


def clip(detail: str) -> str:
    """``detail`` cut to :data:`DETAIL_LIMIT` bytes of UTF-8."""
    raw = detail.encode()
    if len(raw) <= DETAIL_LIMIT:
        return detail
    return raw[:DETAIL_LIMIT - 3].decode("utf-8", "ignore") + "..."


@dataclass(frozen=True, slots=True)
class LoggedVerdict:
    """One verdict a log recorded: when (unix seconds), what, and the line(s) saying so."""

    logged_at: float
    verdict: Verdict
    detail: str


class VerdictIndex:
    """Verdicts per Message-ID (:func:`id_key`): those logged more than ``keep_s`` seconds
    ago dropped, and past ``max_verdicts`` the oldest (about 0.5 KiB each, most of it the
    log lines kept as the detail). A query is decided by the earliest verdict logged at or
    after its ``attempt_at - skew_s`` (the smarthost's clock and the relay's differ, and
    syslog stamps have 1 s resolution); an earlier one is about an earlier attempt with the
    same ID."""

    def __init__(self, keep_s: float = DEFAULT_KEEP_S, skew_s: float = DEFAULT_SKEW_S,
                 max_verdicts: int = DEFAULT_MAX_VERDICTS) -> None:
        self.keep_s = keep_s
        self.skew_s = skew_s
        self.max_verdicts = max_verdicts
        self._by_id: dict[str, list[LoggedVerdict]] = {}
        self._count = 0
        self._trimmed_at = 0.0

    def __len__(self) -> int:
        return self._count

    def add(self, message_id: str, logged: LoggedVerdict) -> None:
        """Record ``logged`` for ``message_id`` (the same verdict read twice, as from a
        rotated file read again, is kept once)."""
        entries = self._by_id.setdefault(id_key(message_id), [])
        if logged in entries:
            return
        entries.append(logged)
        self._count += 1
        if self._count > self.max_verdicts + self.max_verdicts // 10:
            stamps = sorted(e.logged_at for kept in self._by_id.values() for e in kept)
            self._drop_before(stamps[len(stamps) - self.max_verdicts])

    def trim(self, now: float) -> None:
        """Drop what was logged before ``now - keep_s`` (at most once a minute)."""
        if now - self._trimmed_at < _TRIM_EVERY_S:
            return
        self._trimmed_at = now
        self._drop_before(now - self.keep_s)

    def _drop_before(self, horizon: float) -> None:
        for key in list(self._by_id):
            entries = self._by_id[key]
            kept = [e for e in entries if e.logged_at >= horizon]
            self._count -= len(entries) - len(kept)
            if kept:
                self._by_id[key] = kept
            else:
                del self._by_id[key]

    def evidence(self, query: Query, source: str) -> Evidence:
        """The answer to ``query`` (UNKNOWN when no verdict fits)."""
        since = query.attempt_at - self.skew_s
        fitting = [e for e in self._by_id.get(id_key(query.message_id), ())
                   if e.logged_at >= since]
        if not fitting:
            return Evidence(Verdict.UNKNOWN, source)
        first = min(fitting, key=lambda e: e.logged_at)
        return Evidence(first.verdict, source, clip(first.detail), first.logged_at)


class LogSource:
    """The part every log-reading :class:`~relay.reconcile.evidence.EvidenceSource` shares:
    its tails are read (in a thread) at each look, their new lines handed to
    :meth:`_ingest`, then each query is answered from :attr:`index`. Raises OSError from
    look when a log cannot be read at all (one of ``optional`` may be missing)."""

    def __init__(self, name: str, paths: Sequence[Path], *, keep_s: float,
                 skew_s: float, max_verdicts: int = DEFAULT_MAX_VERDICTS,
                 optional: Sequence[Path] = ()) -> None:
        self._name = name
        self._tails = [LogTail(path, missing_ok=path in optional) for path in paths]
        self.index = VerdictIndex(keep_s, skew_s, max_verdicts)
        self._lock = asyncio.Lock()
        self._reading: asyncio.Future[None] | None = None

    @property
    def name(self) -> str:
        """The source's configured name."""
        return self._name

    @property
    def bytes_read(self) -> int:
        """Bytes read from its logs since it was made (a look reads only what is new)."""
        return sum(tail.bytes_read for tail in self._tails)

    async def look(self, queries: Sequence[Query]) -> Mapping[Query, Evidence]:
        """Read what the logs gained since the last look, then answer each query."""
        async with self._lock:
            # a look cancelled while its thread reads leaves the thread running: the next
            # look waits for that one instead of starting a second on the same files
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(asyncio.to_thread(self._read_all))
            await asyncio.shield(self._reading)
            return {query: self.index.evidence(query, self._name) for query in queries}

    async def close(self) -> None:
        """Close the log files held."""
        async with self._lock:
            for tail in self._tails:
                tail.close()

    def _read_all(self) -> None:
        for number, tail in enumerate(self._tails):
            self._ingest(number, tail.lines())
        self.index.trim(time.time())

    def _ingest(self, log: int, lines: Iterable[str]) -> None:
        """Take the new ``lines`` of the ``log``-th path given (subclasses)."""
        raise NotImplementedError
