"""An Exim smarthost's logs as evidence (docs/operating/reconciliation.md).

The main log's ``EXIMID <= sender ... id=MESSAGE-ID`` (Exim logs the Message-ID without its
angle brackets) is ACCEPTED. A rejection after DATA (an ``acl_smtp_data`` deny, or a defer)
logs ``EXIMID H=... rejected after DATA: ...`` in the main log without the Message-ID; the
reject log next to it repeats that line followed by the message's headers (each behind a
one-letter flag, ``I`` for the Message-ID), so the reject log's entry is what makes it
REFUSED. Needs ``log_reject_target`` to include ``reject`` (Exim's default)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from relay.reconcile.evidence import Verdict
from relay.reconcile.log_index import (
    DEFAULT_KEEP_S,
    DEFAULT_MAX_VERDICTS,
    DEFAULT_SKEW_S,
    LoggedVerdict,
    LogSource,
)
from relay.reconcile.stamps import exim_stamp

# after the timestamp: an optional [pid] (log_selector +pid), the message's id (4.96's
# 1xafsX-0003Ak-1k or 4.97's longer 1xafsX-00000003Ak-1k0), "<= sender ...", id=
_RECEIVED = re.compile(r"(?:\[\d+\] )?([0-9A-Za-z]{6}-[0-9A-Za-z]{6,11}-[0-9A-Za-z]{2,4}) <= "
                       r"\S*.*? id=(\S+)")
_DATA_REJECTED = re.compile(r"(?:\[\d+\] )?([0-9A-Za-z]{6}-[0-9A-Za-z]{6,11}-[0-9A-Za-z]{2,4})"
                            r" .*rejected after DATA")
_MESSAGE_ID_HEADER = re.compile(r"[A-Za-z* ] message-id:(.*)", re.IGNORECASE)


def exim_reject_log(main_log: Path) -> Path | None:
    """The reject log next to ``main_log`` (``log_file_path = .../%slog``: ``mainlog`` ->
    ``rejectlog``, ``main.log`` -> ``reject.log``), or None when the name has no ``main``."""
    if "main" not in main_log.name:
        return None
    return main_log.with_name(main_log.name.replace("main", "reject", 1))


@dataclass
class _Rejection:
    """The reject log entry being read: its first line and stamp, the Message-ID header's
    value when found (possibly on the next, folded line)."""

    line: str
    logged_at: float
    header_line: str = ""
    want_fold: bool = False


class EximLog(LogSource):
    """Exim's main log at ``path`` and its reject log (``reject_path``, by default
    :func:`exim_reject_log`; without one no refusal is found), rotated copies included,
    read incrementally; ``keep_s``, ``skew_s`` and ``max_verdicts`` as for
    :class:`relay.reconcile.postfix.PostfixLog`."""

    def __init__(self, name: str, path: Path, reject_path: Path | None = None, *,
                 keep_s: float = DEFAULT_KEEP_S, skew_s: float = DEFAULT_SKEW_S,
                 max_verdicts: int = DEFAULT_MAX_VERDICTS) -> None:
        reject = reject_path if reject_path is not None else exim_reject_log(path)
        logs = [path] if reject is None else [path, reject]
        # Exim makes its reject log at the first rejection
        super().__init__(name, logs, keep_s=keep_s, skew_s=skew_s, max_verdicts=max_verdicts,
                         optional=logs[1:])
        self._rejection: _Rejection | None = None

    def _ingest(self, log: int, lines: Iterable[str]) -> None:
        if log == 0:
            self._main(lines)
        else:
            self._rejects(lines)

    def _main(self, lines: Iterable[str]) -> None:
        for line in lines:
            stamp = exim_stamp(line)
            if stamp is None:
                continue
            match = _RECEIVED.match(line, stamp[1])
            if match is not None:
                self.index.add(match.group(2), LoggedVerdict(stamp[0], Verdict.ACCEPTED, line))

    def _rejects(self, lines: Iterable[str]) -> None:
        for line in lines:
            stamp = exim_stamp(line)
            if stamp is not None:  # a new entry
                rejected = _DATA_REJECTED.match(line, stamp[1]) is not None
                self._rejection = _Rejection(line, stamp[0]) if rejected else None
                continue
            rejection = self._rejection
            if rejection is None:
                continue
            if rejection.want_fold:
                self._found(rejection, line.strip(), f"{rejection.header_line}\n{line}")
                continue
            header = _MESSAGE_ID_HEADER.match(line)
            if header is None:
                continue
            value = header.group(1).strip()
            if value:
                self._found(rejection, value, line)
            else:
                rejection.header_line, rejection.want_fold = line, True

    def _found(self, rejection: _Rejection, message_id: str, header: str) -> None:
        self._rejection = None  # the first Message-ID header is the message's
        if message_id:
            self.index.add(message_id, LoggedVerdict(
                rejection.logged_at, Verdict.REFUSED, f"{rejection.line}\n{header}"))
