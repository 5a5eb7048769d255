"""A Postfix smarthost's mail log as evidence (docs/operating/reconciliation.md).

cleanup's ``QID: message-id=<...>`` joins a Message-ID to its queue id; then for that queue
id ``qmgr: QID: from=<...>, size=N, nrcpt=N (queue active)`` (or cleanup's ``hold:`` /
``discard:``, a 250 the smarthost answered too) is ACCEPTED, and a ``QID: reject:`` /
``milter-reject:`` / ``proxy-reject:`` of the content (``header``, ``body``,
``END-OF-MESSAGE``: header_checks, body_checks, smtpd_end_of_data_restrictions, a milter, a
before-queue content filter) is REFUSED. A header_checks REJECT
that fires on a header above the Message-ID leaves no ``message-id=`` line: that refusal
cannot be joined and stays UNKNOWN. Lines in either syslog timestamp form
(:mod:`relay.reconcile.stamps`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from relay.reconcile.evidence import Verdict
from relay.reconcile.log_index import (
    DEFAULT_KEEP_S,
    DEFAULT_MAX_VERDICTS,
    DEFAULT_SKEW_S,
    LoggedVerdict,
    LogSource,
)
from relay.reconcile.stamps import SyslogClock

# after the timestamp: host, program/daemon[pid]: QID: text
_LINE = re.compile(r"\S+ [^\s\[:]+/[^\s\[:]+(?:\[\d+\])?: ([0-9A-Za-z]{6,}): (.*)")
_ACCEPTED = re.compile(r"from=<.*>, size=\d+, nrcpt=\d+ \(queue active\)$"
                       r"|(?:milter-)?(?:hold|discard): (?:header|body|END-OF-MESSAGE)\b")
# cleanup's header/body checks, smtpd's end-of-data restrictions and milters, a before-queue
# content filter (smtpd_proxy_filter)
_REFUSED = re.compile(r"(?:milter-|proxy-)?reject: (?:header|body|content|END-OF-MESSAGE)\b")


class PostfixLog(LogSource):
    """The Postfix log at ``path`` (rotated copies included), read incrementally; verdicts
    kept ``keep_s`` seconds, at most ``max_verdicts`` of them (the oldest dropped first);
    ``skew_s``: how far before the attempt a verdict's stamp may be and still be about it."""

    def __init__(self, name: str, path: Path, *, keep_s: float = DEFAULT_KEEP_S,
                 skew_s: float = DEFAULT_SKEW_S,
                 max_verdicts: int = DEFAULT_MAX_VERDICTS) -> None:
        super().__init__(name, [path], keep_s=keep_s, skew_s=skew_s, max_verdicts=max_verdicts)
        # queue id -> (Message-ID, cleanup's line, when): until qmgr's "removed" or keep_s
        self._queued: dict[str, tuple[str, str, float]] = {}

    def _ingest(self, log: int, lines: Iterable[str]) -> None:
        clock = SyslogClock()
        latest = 0.0
        for line in lines:
            stamp = clock.parse(line)
            if stamp is None:
                continue
            logged_at, start = stamp
            latest = max(latest, logged_at)
            match = _LINE.match(line, start)
            if match is not None:
                self._event(match.group(1), match.group(2), line, logged_at)
        self._forget_older_than(latest - self.index.keep_s)

    def _event(self, queue_id: str, text: str, line: str, logged_at: float) -> None:
        if text.startswith("message-id="):
            self._queued[queue_id] = (text.removeprefix("message-id="), line, logged_at)
            return
        if text == "removed":
            self._queued.pop(queue_id, None)
            return
        joined = self._queued.get(queue_id)
        if joined is None:
            return
        if _ACCEPTED.match(text):
            verdict = Verdict.ACCEPTED
        elif _REFUSED.match(text):
            verdict = Verdict.REFUSED
        else:
            return
        message_id, id_line, _ = joined
        self.index.add(message_id, LoggedVerdict(logged_at, verdict, f"{id_line}\n{line}"))

    def _forget_older_than(self, horizon: float) -> None:
        for queue_id in [q for q, (_, _, at) in self._queued.items() if at < horizon]:
            del self._queued[queue_id]
