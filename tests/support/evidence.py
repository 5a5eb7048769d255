"""An evidence source whose answers a test sets (relay.reconcile.evidence.EvidenceSource): it
stands in for a smarthost's records in the reconciler's tests, where the loop, not the
reading of a log, is under test."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from relay.reconcile.evidence import Evidence, Query, Verdict


@dataclass
class SetAnswers:
    """Answers ``verdicts[message_id]`` (with ``detail``, a log line) about each query whose
    attempt is not older than ``logged_at`` (None: any), UNKNOWN for the others; ``broken``
    makes :meth:`look` raise OSError (a log that cannot be read); ``meanwhile`` is awaited
    before it answers (what happens while the source is read). ``asked`` holds every query
    asked, in order; ``closed`` counts :meth:`close` calls."""

    name: str
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    detail: str = "smarthost.test postfix/qmgr[41]: 4Xb2Lk1Zz9z3: from=<app@example.com>"
    logged_at: float | None = None
    broken: bool = False
    meanwhile: Callable[[], Awaitable[None]] | None = None
    asked: list[Query] = field(default_factory=list)
    closed: int = 0

    async def look(self, queries: Sequence[Query]) -> Mapping[Query, Evidence]:
        if self.broken:
            raise OSError("the log cannot be read")
        self.asked.extend(queries)
        if self.meanwhile is not None:
            await self.meanwhile()
        answers: dict[Query, Evidence] = {}
        for query in queries:
            verdict = self.verdicts.get(query.message_id, Verdict.UNKNOWN)
            if self.logged_at is not None and self.logged_at < query.attempt_at:
                verdict = Verdict.UNKNOWN  # logged before the attempt: not about it
            detail = "" if verdict is Verdict.UNKNOWN else f"{self.detail} {query.message_id}"
            answers[query] = Evidence(verdict, self.name, detail, self.logged_at)
        return answers

    async def close(self) -> None:
        self.closed += 1
