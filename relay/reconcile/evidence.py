"""What a smarthost's own records say about one relayed message: the evidence an in-doubt
message is resolved by (docs/operating/reconciliation.md). Only evidence resolves: an
unknown answer never releases a record."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


class Verdict(enum.StrEnum):
    """What a source found for one message."""

    ACCEPTED = "accepted"  # the smarthost logged it queued / accepted at or after the attempt
    REFUSED = "refused"  # it logged a refusal of that message at end of data
    UNKNOWN = "unknown"  # nothing (yet)


@dataclass(frozen=True)
class Query:
    """One in-doubt attempt: ``message_id`` as in the header, angle brackets included
    (``<a@b>``); ``attempt_at``: unix seconds, when the relay's final dot of that attempt went
    out (an application may reuse a Message-ID across attempts: evidence logged before the
    attempt is not about it)."""

    message_id: str
    attempt_at: float


@dataclass(frozen=True)
class Evidence:
    """A source's answer for one query: ``detail`` is the log line(s) or the command's answer
    that decided it (at most 1 KiB), ``logged_at`` when the smarthost logged it (unix
    seconds, None when not known)."""

    verdict: Verdict
    source: str
    detail: str = ""
    logged_at: float | None = None


class EvidenceSource(Protocol):
    """One configured ``[[reconcile_source]]``."""

    @property
    def name(self) -> str:
        """The source's configured name (the ``source`` label of relay_reconciled_total)."""

    async def look(self, queries: Sequence[Query]) -> Mapping[Query, Evidence]:
        """The evidence for each query (every query has an answer, UNKNOWN when nothing is
        known); bounded in time; raises OSError only when the source cannot be read at all."""

    async def close(self) -> None:
        """Release what the source holds (open files, a running command)."""
