"""The reconciler (docs/operating/reconciliation.md, design.md "Reconciliation"): one per relay
(in its supervisor, or in the relay's one process), every ``reconcile_interval`` seconds it
takes the audit ledger's unresolved in-doubt records (oldest first, at most
:data:`ROUND_MAX`), asks the evidence sources that speak for each record's upstream about its
Message-ID and attempt, and applies :func:`relay.admin.reconcile_rule.next_step`:

- a smarthost's record of the message accepted: :func:`relay.admin.decisions.decide` marks it
  SENT (the ledger first, then the store's compare-and-set on a record still in doubt, then the
  ``reconciled_sent`` row with the evidence), so the application's retry is an ordinary
  duplicate; a record of its refusal releases it (``reconciled_released``), so the retry is
  relayed;
- nothing: asked again next round, until ``reconcile_give_up`` after the attempt: one
  ``reconcile_given_up`` row (the store untouched), never asked about again;
- sources that disagree: nothing done, one ERROR line per round (for a person).

Every look is counted in the ledger (:meth:`relay.store.postgres.ledger_read.LedgerReader.
note_looks`: ``dedup-relay in-doubt`` and the console show it), every resolution in
``relay_reconciled_total{source,result}``. Two relays sharing a store both reconcile: every
action is a compare-and-set, so the second finds the record settled and does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from relay.admin.decisions import AuditLedger, Decision, LedgerRefused, decide, open_ledger
from relay.admin.reconcile_rule import Step, next_step
from relay.admin.records import InFlightError, OperatorRow
from relay.core.errors import ConfigError, StartupError, StoreError
from relay.core.interfaces import FingerprintStore, LedgerAction
from relay.ops.metrics import NO_SOURCE, ReconcileMetrics
from relay.reconcile.evidence import Evidence, Query
from relay.settings import ReconcileSource, Settings
from relay.settings.reconcile import AnsweringSource

if TYPE_CHECKING:
    from relay.store.postgres.ledger_read import InDoubtRow

log = logging.getLogger("relay.reconcile")
audit = logging.getLogger("relay.audit")

ROUND_MAX = 500
"""Most in-doubt records one round looks at (those not looked at yet first, then the least
recently looked at: every record is reached in turn)."""
FIRST_ROUND_S = 5.0
"""Seconds from start to the first round."""
IDLE_CHECK_S = 5.0
"""Seconds between looks at the settings while reconciling is off (a reload may turn it on)."""
SOURCE_BOUND_S = 60.0
"""Seconds one source may take to answer a round's questions; past them it answered nothing."""
LOOKS_KEPT_S = 7 * 86400.0
"""Seconds a record's count of looks is kept once no round looked at it (resolved, given up)."""


class ReconcileLedger(AuditLedger, Protocol):
    """What the reconciler needs of the ledger (:class:`relay.store.postgres.ledger_read.
    LedgerReader` is one)."""

    async def to_reconcile(self, *, limit: int) -> list[InDoubtRow]:
        """The in-doubt records not given up, oldest first."""

    async def note_looks(self, looks: Sequence[tuple[InDoubtRow, str]]) -> None:
        """Count one look at each (row, answer)."""

    async def forget_looks(self, *, older_than_s: float) -> None:
        """Delete the looks not renewed for ``older_than_s`` seconds."""


@dataclass
class RoundReport:
    """What one round did: records ``looked`` at, ``sent``, ``released``, ``given_up``,
    ``conflicts`` (left alone), ``settled`` meanwhile (the compare found them no longer in
    doubt: nothing done), ``waiting`` (no evidence yet), ``failed`` (the store failed)."""

    looked: int = 0
    sent: int = 0
    released: int = 0
    given_up: int = 0
    conflicts: int = 0
    settled: int = 0
    waiting: int = 0
    failed: int = 0


def attempt_age_s(row: InDoubtRow) -> float:
    """Seconds since the in-doubt attempt's final dot (:attr:`InDoubtRow.attempt_at`), by the
    database's clock."""
    return row.age_s + (row.decided_at - row.attempt_at).total_seconds()


def query_of(row: InDoubtRow) -> Query | None:
    """What the sources are asked about ``row`` (None: it has no Message-ID to ask about)."""
    if not row.message_id:
        return None
    return Query(row.message_id, row.attempt_at.timestamp())


class Reconciler:
    """The loop: ``await run()`` until cancelled, then ``await close()``; :meth:`round` is one
    round. ``settings``: the live settings (read each round: a reload's sources are taken at
    the next); ``store``: the relay's store (None: opened on the first round, closed by
    :meth:`close`); ``instance`` names it in its ledger rows (``HOST/reconciler``);
    ``ledger``: opens the ledger for a round (default: :func:`relay.admin.decisions.
    open_ledger`); ``sources``: builds the sources of the settings (default: their
    ``[[reconcile_source]]`` tables)."""

    def __init__(self, settings: Callable[[], Settings], *, store: FingerprintStore | None,
                 metrics: ReconcileMetrics, instance: str,
                 ledger: Callable[[Settings], AbstractAsyncContextManager[ReconcileLedger]]
                 | None = None,
                 sources: Callable[[Settings], list[AnsweringSource]] | None = None) -> None:
        self._settings = settings
        self._store = store
        self._own_store = store is None
        self._metrics = metrics
        self._instance = instance
        self._ledger = ledger if ledger is not None else _open_ledger
        self._build = sources if sources is not None else _configured_sources
        self._sources: list[AnsweringSource] = []
        self._built_from: tuple[ReconcileSource, ...] = ()

    async def run(self) -> None:
        """Rounds every ``reconcile_interval`` seconds (the first :data:`FIRST_ROUND_S` after
        start) while a source is configured, until cancelled; a round's unexpected error is
        logged, never ends the loop."""
        await asyncio.sleep(FIRST_ROUND_S)
        while True:
            s = self._settings()
            if s.reconciling:
                try:
                    await self.round()
                except Exception:
                    log.exception("reconciler: the round failed")
            await asyncio.sleep(s.reconcile_interval if s.reconciling else IDLE_CHECK_S)

    async def close(self) -> None:
        """Close the sources and the store it opened (never raises)."""
        await self._close_sources()
        if self._own_store and self._store is not None:
            with contextlib.suppress(Exception):
                await self._store.close()
            self._store = None

    async def round(self) -> RoundReport:
        """Look at the in-doubt records once (at most :data:`ROUND_MAX`) and apply the rule to
        each; the ledger failing ends the round (logged: tried again next round)."""
        s = self._settings()
        report = RoundReport()
        sources = await self._current_sources(s)
        if not sources:
            return report
        try:
            store = await self._the_store(s)
            async with self._ledger(s) as ledger:
                rows = await ledger.to_reconcile(limit=ROUND_MAX)
                answers = await _ask(sources, rows)
                looks: list[tuple[InDoubtRow, str]] = []
                for row in rows:
                    speaking = [src for src in sources if src.speaks_for(row.upstream)]
                    query = query_of(row)
                    found = [] if query is None else [
                        answers[(src.source.name, query)] for src in speaking
                        if (src.source.name, query) in answers]
                    step, evidence = next_step(found, age_s=attempt_age_s(row),
                                               give_up_s=s.reconcile_give_up)
                    await self._apply(s, store, ledger, row, step, evidence, speaking, found,
                                      report)
                    looks.append((row, _answer_text(step, evidence, found)))
                report.looked = len(rows)
                await ledger.note_looks(looks)
                await ledger.forget_looks(older_than_s=LOOKS_KEPT_S)
        except (LedgerRefused, StoreError, StartupError, ConfigError) as exc:
            log.warning("reconciler: %s; trying again next round", exc)
        return report

    async def _apply(self, s: Settings, store: FingerprintStore, ledger: ReconcileLedger,
                     row: InDoubtRow, step: Step, evidence: Evidence | None,
                     speaking: Sequence[AnsweringSource], found: Sequence[Evidence],
                     report: RoundReport) -> None:
        """Do ``step`` for ``row`` and count it in ``report`` and the metric."""
        if step is Step.WAIT:
            report.waiting += 1
        elif step is Step.CONFLICT:
            report.conflicts += 1
            log.error("reconciler: the evidence sources disagree about %s (Message-ID %s): "
                      "%s; nothing done, decide by hand (dedup-relay release | mark-sent)",
                      row.store_key, row.message_id,
                      "; ".join(f"{e.source} {e.verdict.value}: {e.detail}" for e in found))
        elif step is Step.GIVE_UP:
            await self._give_up(s, ledger, row, speaking)
            report.given_up += 1
        else:
            assert evidence is not None
            await self._resolve(s, store, ledger, row, step, evidence, report)

    async def _resolve(self, s: Settings, store: FingerprintStore, ledger: ReconcileLedger,
                       row: InDoubtRow, step: Step, evidence: Evidence,
                       report: RoundReport) -> None:
        """Mark ``row``'s record sent or release it through :func:`decide` (a compare-and-set
        on a record still in doubt)."""
        sent = step is Step.MARK_SENT
        assert row.store_key is not None
        decision = Decision(
            action=LedgerAction.RECONCILED_SENT if sent else LedgerAction.RECONCILED_RELEASED,
            key=row.store_key, reason=_evidence_text(evidence), who=self._instance,
            operator="reconciler", in_doubt_only=True, keep_expiry=True,
            window_s=max(1.0, s.dedup_window - attempt_age_s(row)),
            message_id=row.message_id, upstream=row.upstream)
        try:
            outcome = await decide(s, decision, store=contextlib.nullcontext(store),
                                   ledger=contextlib.nullcontext(ledger),
                                   instance=self._instance)
        except InFlightError as exc:  # a retry or an operator settled it meanwhile
            log.info("reconciler: %s", exc)
            report.settled += 1
            return
        except StoreError as exc:
            log.warning("reconciler: the store failed on %s: %s; trying again next round",
                        row.store_key, exc)
            report.failed += 1
            return
        if not outcome.done and outcome.changed:
            report.settled += 1
            return
        if outcome.unrecorded is not None:
            log.error("reconciler: %s was %s but its ledger row was not written: %s",
                      row.store_key, "marked sent" if sent else "released", outcome.unrecorded)
        if sent:
            report.sent += 1
        else:
            report.released += 1
        self._metrics.reconciled(evidence.source, "sent" if sent else "released")

    async def _give_up(self, s: Settings, ledger: ReconcileLedger, row: InDoubtRow,
                       speaking: Sequence[AnsweringSource]) -> None:
        """Write the ``reconcile_given_up`` row of ``row`` (the store untouched) and say so."""
        assert row.store_key is not None
        names = ", ".join(src.source.name for src in speaking) or "no source (none speaks for "\
            f"upstream {row.upstream or '(unknown)'})"
        why = ("no Message-ID to ask about" if not row.message_id else
               f"no evidence from {names}")
        entry = OperatorRow(s, LedgerAction.RECONCILE_GIVEN_UP, row.store_key,
                            message_id=row.message_id, upstream=row.upstream).entry(
            f"given up by the reconciler after {s.reconcile_give_up:g} s: {why}; left to an "
            "operator")
        options = s.ledger_options(instance=self._instance, secret=s.fingerprint_secret_bytes,
                                   local_part_case_sensitive=s.local_part_case_sensitive)
        await ledger.write([entry], options)
        audit.warning("in-doubt record given up by the reconciler", extra={
            "event": "reconcile_given_up", "operator": "reconciler", "key": row.store_key,
            "message_id": row.message_id, "reason": why})
        self._metrics.reconciled(speaking[0].source.name if speaking else NO_SOURCE,
                                 "given_up")

    async def _the_store(self, s: Settings) -> FingerprintStore:
        if self._store is None:
            self._store = await s.open_store(window_s=s.dedup_window)
        return self._store

    async def _current_sources(self, s: Settings) -> list[AnsweringSource]:
        """The sources of ``s``: the ones built before unless the list changed (a reload)."""
        if s.reconcile_source != self._built_from or not self._sources:
            await self._close_sources()
            self._sources = self._build(s)
            self._built_from = s.reconcile_source
            names = [src.source.name for src in self._sources]
            self._metrics.declare(names)
            if names:
                log.info("reconciler: asking %s every %g s", ", ".join(names),
                         s.reconcile_interval)
        return self._sources

    async def _close_sources(self) -> None:
        for src in self._sources:
            try:
                await src.source.close()
            except Exception:
                log.exception("reconciler: source %s did not close", src.source.name)
        self._sources = []
        self._built_from = ()


async def _ask(sources: Sequence[AnsweringSource], rows: Sequence[InDoubtRow]
               ) -> Mapping[tuple[str, Query], Evidence]:
    """Each source's answers about the rows it speaks for, by (source name, query); a source
    that cannot be read, or does not answer within :data:`SOURCE_BOUND_S`, answered nothing
    (logged)."""
    answers: dict[tuple[str, Query], Evidence] = {}
    for src in sources:
        queries = list(dict.fromkeys(
            q for row in rows if src.speaks_for(row.upstream)
            for q in [query_of(row)] if q is not None))
        if not queries:
            continue
        name = src.source.name
        try:
            async with asyncio.timeout(SOURCE_BOUND_S):
                found = await src.source.look(queries)
        except (OSError, TimeoutError) as exc:
            log.warning("reconciler: source %s could not be read: %s", name, exc)
            continue
        answers.update(((name, q), e) for q, e in found.items())
    return answers


def _evidence_text(evidence: Evidence) -> str:
    """The evidence as a row's reply holds it: ``source NAME: DETAIL`` (1 KiB at most)."""
    return f"source {evidence.source}: {evidence.detail}"[:1024]


def _answer_text(step: Step, evidence: Evidence | None, found: Sequence[Evidence]) -> str:
    """What one look found, for the looks' table: the step and the deciding evidence."""
    if evidence is not None:
        return f"{step.value}: {_evidence_text(evidence)}"
    return f"{step.value}: " + ("; ".join(f"{e.source} {e.verdict.value}" for e in found)
                                or "no source answered")


def _configured_sources(settings: Settings) -> list[AnsweringSource]:
    return settings.reconcile_sources()


@contextlib.asynccontextmanager
async def _open_ledger(settings: Settings) -> AsyncIterator[ReconcileLedger]:
    """The ledger for one round (:func:`open_ledger`)."""
    async with open_ledger(settings) as reader:
        yield cast("ReconcileLedger", reader)


class RunningReconciler:
    """A :class:`Reconciler`'s loop as a task: :func:`start_reconciler`, then :meth:`stop`."""

    def __init__(self, reconciler: Reconciler) -> None:
        self.reconciler = reconciler
        self._task = asyncio.create_task(reconciler.run())

    async def stop(self) -> None:
        """Cancel the loop (a round in progress ends where it is: every step is a compare and
        set, a row written or not) and close the sources and its store."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.reconciler.close()


def start_reconciler(settings: Callable[[], Settings], *, store: FingerprintStore | None,
                     metrics: Callable[[], ReconcileMetrics], instance: str
                     ) -> RunningReconciler | None:
    """The relay's one reconciler (its supervisor's, or its one process's) running on the live
    ``settings``, counted in what ``metrics`` makes (its registry: the process's metrics
    server's, :class:`ReconcileMetrics`); None without an audit ledger
    (nothing to reconcile: the in-doubt list is the ledger's). It idles while no source is
    configured or ``reconcile_interval`` is 0, so a reload may turn it on."""
    if settings().ledger is None:
        return None
    return RunningReconciler(Reconciler(settings, store=store, metrics=metrics(),
                                        instance=instance))
