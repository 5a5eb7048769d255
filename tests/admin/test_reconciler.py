"""The reconciler's loop (relay/admin/reconciler.py) on a real relay: SQLite store, PostgreSQL
ledger in a private schema, an upstream that hangs up after reading the final dot (the
message in doubt), and evidence sources whose answers the test sets (tests/support/evidence.py:
the smarthost's records stand-in; the reading of real logs is tested with the sources).

Accepted -> SENT and the retry is an ordinary duplicate; refused -> released and the retry is
relayed; nothing -> it stays, then is given up once at the bound and never asked about again;
resolved by an operator meanwhile -> the compare refuses, nothing done; sources that disagree
-> nothing; two relays reconciling one store at once -> one resolution."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from relay.admin import Decision, decide, open_ledger
from relay.admin.reconciler import Reconciler, RoundReport
from relay.app import Relay
from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import LedgerAction, State
from relay.core.recipients import normalize_recipient
from relay.ops.metrics import ReconcileMetrics
from relay.reconcile.evidence import Verdict
from relay.settings import ReconcileSource, Settings
from relay.settings.reconcile import AnsweringSource
from relay.store.postgres.ledger_read import InDoubtRow, LedgerReader
from tests.support.clients import message, send
from tests.support.evidence import SetAnswers
from tests.support.peers import DotSwallower, serve_peer
from tests.support.postgres import ledger_rows
from tests.support.relays import MakeRelay
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(120)

RCPT = "user@example.net"


@dataclass
class Rig:
    relay: Relay
    peer: DotSwallower
    ledger_url: str
    registry: CollectorRegistry
    metrics: ReconcileMetrics

    def key(self, dedupe_key: str) -> str:
        return store_key(self.relay.settings.store_prefix,
                         fingerprint(normalize_recipient(RCPT), "welcome", dedupe_key))

    def reconciler(self, *sources: SetAnswers, give_up_s: float = 86400.0,
                   upstreams: frozenset[str] | None = None) -> Reconciler:
        def settings() -> Settings:
            return self.relay.settings.model_copy(update={"reconcile_give_up": give_up_s})

        return Reconciler(settings, store=self.relay.store,
                          metrics=self.metrics,
                          instance="relay.test/reconciler",
                          sources=lambda _: [AnsweringSource(s, upstreams) for s in sources])

    async def in_doubt(self, dedupe_key: str) -> None:
        """Send a message whose dot the upstream swallows: in doubt in store and ledger."""
        self.peer.swallow = True
        got = await send(self.relay.port, [RCPT], _message(dedupe_key))
        assert got.code == 451, got
        assert (await self.relay.store.inspect(self.key(dedupe_key))).state is State.UNKNOWN
        await until(lambda: self._listed(self.key(dedupe_key)), what="the in-doubt row")

    async def _listed(self, key: str) -> bool:
        return key in [row.store_key for row in await self.listed()]

    async def listed(self) -> list[InDoubtRow]:
        async with await LedgerReader.open(self.ledger_url) as reader:
            return await reader.in_doubt(older_than_s=0, limit=100)

    async def unresolved(self) -> int:
        """What the in-doubt alert's gauge counts (relay_ledger_in_doubt_unresolved)."""
        async with await LedgerReader.open(self.ledger_url) as reader:
            return await reader.count_unresolved()

    async def rows(self, key: str) -> list[dict[str, Any]]:
        return [r for r in await ledger_rows(self.ledger_url) if r["store_key"] == key]

    def counted(self, source: str, result: str) -> float | None:
        return self.registry.get_sample_value(
            "relay_reconciled_total", {"source": source, "result": result})


def _message(dedupe_key: str) -> bytes:
    return message(key=dedupe_key, extra=f"Message-ID: <{dedupe_key}@app.test>\r\n")


@pytest.fixture
async def rig(make_relay: MakeRelay, ledger_url: str, tmp_path: Path) -> AsyncIterator[Rig]:
    async with serve_peer(DotSwallower()) as peer:
        relay = await make_relay(upstream=f"127.0.0.1:{peer.port}", ledger=ledger_url,
                                 store=f"sqlite:///{tmp_path / 'dedup.db'}")
        registry = CollectorRegistry()
        yield Rig(relay, peer, ledger_url, registry, ReconcileMetrics(registry=registry))


async def test_accepted_marks_sent_and_the_retry_is_an_ordinary_duplicate(rig: Rig) -> None:
    """The smarthost logged it accepted: one round marks the record SENT (its reply names
    the source and the line), writes one ``reconciled_sent`` row with the evidence, counts
    it; the in-doubt list no longer holds it; the application's retry is suppressed as a
    plain duplicate (not held in doubt) and never reaches the upstream."""
    await rig.in_doubt("K-acc")
    key = rig.key("K-acc")
    source = SetAnswers("mx1", {"<K-acc@app.test>": Verdict.ACCEPTED})
    reconciler = rig.reconciler(source)
    assert rig.counted("mx1", "sent") is None  # declared on the first round
    report = await reconciler.round()
    assert (report.looked, report.sent) == (1, 1), report
    assert [q.message_id for q in source.asked] == ["<K-acc@app.test>"]
    record = await rig.relay.store.inspect(key)
    assert record.state is State.SENT and "source mx1:" in (record.reply or "")
    rows = await rig.rows(key)
    assert [r["outcome"] for r in rows] == ["unknown", "reconciled_sent"]
    row = rows[-1]
    assert row["action"] == "reconciled_sent" and row["message_id"] == "<K-acc@app.test>"
    assert "postfix/qmgr" in row["reply"] and "source mx1" in row["reply"]
    assert rig.counted("mx1", "sent") == 1 and rig.counted("mx1", "released") == 0
    assert key not in [r.store_key for r in await rig.listed()]
    assert await rig.unresolved() == 0  # out of the in-doubt alert's gauge

    rig.peer.swallow = False
    retry = await send(rig.relay.port, [RCPT], _message("K-acc"))
    assert retry.code == 250 and rig.peer.received == 1, retry
    await until(lambda: _has_outcome(rig, key, "suppressed"), what="the retry's row")
    assert "suppressed_unknown" not in [r["outcome"] for r in await rig.rows(key)]
    assert (await reconciler.round()).looked == 0
    await reconciler.close()
    assert source.closed == 1


async def _has_outcome(rig: Rig, key: str, outcome: str) -> bool:
    return outcome in [r["outcome"] for r in await rig.rows(key)]


async def test_refused_releases_and_the_retry_is_relayed_once(rig: Rig) -> None:
    """The smarthost logged a refusal at end of data: the record is released
    (``reconciled_released`` row), and the retry goes to the upstream once and is SENT."""
    await rig.in_doubt("K-ref")
    key = rig.key("K-ref")
    reconciler = rig.reconciler(SetAnswers("mx1", {"<K-ref@app.test>": Verdict.REFUSED}))
    report = await reconciler.round()
    assert report.released == 1, report
    assert (await rig.relay.store.inspect(key)).state is State.ABSENT
    assert [r["outcome"] for r in await rig.rows(key)] == ["unknown", "reconciled_released"]
    assert rig.counted("mx1", "released") == 1

    rig.peer.swallow = False
    retry = await send(rig.relay.port, [RCPT], _message("K-ref"))
    assert retry.code == 250 and rig.peer.received == 2, retry
    assert (await rig.relay.store.inspect(key)).state is State.SENT
    again = await send(rig.relay.port, [RCPT], _message("K-ref"))
    assert again.code == 250 and rig.peer.received == 2, again
    await reconciler.close()


async def test_no_evidence_stays_then_is_given_up_once(rig: Rig) -> None:
    """Nothing in the smarthost's records: each round counts a look and changes nothing;
    once the attempt is older than reconcile_give_up, one ``reconcile_given_up`` row (the
    record still UNKNOWN, still listed for an operator), counted; no round asks again."""
    await rig.in_doubt("K-none")
    key = rig.key("K-none")
    source = SetAnswers("mx1")
    reconciler = rig.reconciler(source, give_up_s=3.0)
    first = await reconciler.round()
    assert (first.looked, first.waiting, first.given_up) == (1, 1, 0), first
    assert (await rig.listed())[0].reconcile_looks == 1

    reports: list[RoundReport] = []

    async def given_up() -> bool:
        reports.append(await reconciler.round())
        return reports[-1].given_up == 1

    await until(given_up, within_s=30, what="the give-up")
    assert all(r.sent == r.released == 0 for r in reports)
    assert (await rig.relay.store.inspect(key)).state is State.UNKNOWN
    rows = await rig.rows(key)
    assert [r["outcome"] for r in rows] == ["unknown", "reconcile_given_up"]
    assert "left to an operator" in rows[-1]["reply"] and "mx1" in rows[-1]["reply"]
    listed = await rig.listed()
    assert [r.store_key for r in listed] == [key] and listed[0].reconcile_given_up
    assert rig.counted("mx1", "given_up") == 1
    assert await rig.unresolved() == 1  # still counted for the in-doubt alert
    asked = len(source.asked)
    assert (await reconciler.round()).looked == 0 and len(source.asked) == asked
    await reconciler.close()


async def test_resolved_by_an_operator_meanwhile_the_compare_refuses(rig: Rig) -> None:
    """An operator releases the record while the source is being read: the reconciler's
    mark-sent finds it no longer in doubt and does nothing (no row, not counted); the
    record stays released."""
    await rig.in_doubt("K-op")
    key = rig.key("K-op")
    settings = rig.relay.settings

    async def operator_releases() -> None:
        outcome = await decide(
            settings, Decision(LedgerAction.RELEASE, key, "checked the log", who="ops"),
            store=contextlib.nullcontext(rig.relay.store), ledger=open_ledger(settings),
            instance="test/cli")
        assert outcome.done

    source = SetAnswers("mx1", {"<K-op@app.test>": Verdict.ACCEPTED},
                        meanwhile=operator_releases)
    report = await rig.reconciler(source).round()
    assert (report.sent, report.settled) == (0, 1), report
    assert (await rig.relay.store.inspect(key)).state is State.ABSENT
    assert [r["outcome"] for r in await rig.rows(key)] == ["unknown", "released"]
    assert rig.counted("mx1", "sent") == 0


async def test_sources_that_disagree_resolve_nothing(rig: Rig,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """One source saw it accepted, another refused: nothing done, an ERROR line naming
    both; the record stays in doubt and listed, its look counted."""
    await rig.in_doubt("K-both")
    key = rig.key("K-both")
    reconciler = rig.reconciler(SetAnswers("mx1", {"<K-both@app.test>": Verdict.ACCEPTED}),
                                SetAnswers("mx2", {"<K-both@app.test>": Verdict.REFUSED}))
    report = await reconciler.round()
    assert (report.conflicts, report.sent, report.released) == (1, 0, 0), report
    assert (await rig.relay.store.inspect(key)).state is State.UNKNOWN
    assert [r["outcome"] for r in await rig.rows(key)] == ["unknown"]
    assert any("disagree" in r.getMessage() and "mx1 accepted" in r.getMessage()
               and "mx2 refused" in r.getMessage() for r in caplog.records)
    listed = await rig.listed()
    assert listed[0].reconcile_looks == 1 and "conflict" in (listed[0].reconcile_answer or "")


async def test_a_source_asked_only_for_its_upstreams_and_one_that_cannot_be_read(
        rig: Rig) -> None:
    """A source that speaks for another upstream is not asked; one whose log cannot be read
    answered nothing: the record waits."""
    await rig.in_doubt("K-elsewhere")
    other = SetAnswers("mx-other", {"<K-elsewhere@app.test>": Verdict.ACCEPTED})
    report = await rig.reconciler(other, upstreams=frozenset({"elsewhere"})).round()
    assert (report.waiting, other.asked) == (1, []), report
    broken = SetAnswers("mx1", {"<K-elsewhere@app.test>": Verdict.ACCEPTED}, broken=True)
    assert (await rig.reconciler(broken).round()).waiting == 1
    assert (await rig.relay.store.inspect(rig.key("K-elsewhere"))).state is State.UNKNOWN


async def test_two_relays_reconciling_at_once_resolve_once(rig: Rig) -> None:
    """Two reconcilers (two relays sharing the store and ledger) in the same round: one marks
    the record sent, the other's compare finds it settled; one ``reconciled_sent`` row."""
    await rig.in_doubt("K-twice")
    key = rig.key("K-twice")
    answers: Callable[[], SetAnswers] = lambda: SetAnswers(  # noqa: E731
        "mx1", {"<K-twice@app.test>": Verdict.ACCEPTED})
    first, second = await asyncio.gather(rig.reconciler(answers()).round(),
                                         rig.reconciler(answers()).round())
    assert first.sent + second.sent == 1 and first.settled + second.settled == 1
    assert [r["outcome"] for r in await rig.rows(key)] == ["unknown", "reconciled_sent"]


async def test_a_reload_s_sources_are_asked_from_the_next_round(rig: Rig) -> None:
    """The reconciler reads the live settings each round: after a reload that replaces the
    source ``mx1`` (nothing to say) with ``mx2`` (saw it accepted), the old source is closed,
    the new one declared and asked, and the record marked sent; an unchanged list keeps its
    sources open."""
    await rig.in_doubt("K-reload")
    built = {"mx1": SetAnswers("mx1"),
             "mx2": SetAnswers("mx2", {"<K-reload@app.test>": Verdict.ACCEPTED})}
    live = {"settings": _with_sources(rig.relay.settings, "mx1")}
    reconciler = Reconciler(
        lambda: live["settings"], store=rig.relay.store, metrics=rig.metrics,
        instance="relay.test/reconciler",
        sources=lambda s: [AnsweringSource(built[e.name], None) for e in s.reconcile_source])
    assert (await reconciler.round()).waiting == 1
    assert (await reconciler.round()).waiting == 1 and built["mx1"].closed == 0
    assert rig.counted("mx2", "sent") is None

    live["settings"] = _with_sources(rig.relay.settings, "mx2")  # what a SIGHUP applies
    report = await reconciler.round()
    assert report.sent == 1 and built["mx1"].closed == 1, report
    assert len(built["mx1"].asked) == 2 and len(built["mx2"].asked) == 1
    assert rig.counted("mx2", "sent") == 1
    await reconciler.close()
    assert built["mx2"].closed == 1


def _with_sources(settings: Settings, *names: str) -> Settings:
    """``settings`` with a ``[[reconcile_source]]`` per name (a command: never run here)."""
    return settings.model_copy(update={"reconcile_source": tuple(
        ReconcileSource(name=name, command=("/bin/true",)) for name in names)})


async def test_a_bounded_round_reaches_every_record_in_turn(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """More records in doubt than a round takes: the next round takes those not looked at
    yet, then the least recently looked at, so none waits for the older ones' give-up."""
    import relay.admin.reconciler as reconciler_module

    for key in ("K-r1", "K-r2", "K-r3"):
        await rig.in_doubt(key)
    monkeypatch.setattr(reconciler_module, "ROUND_MAX", 2)
    source = SetAnswers("mx1")
    reconciler = rig.reconciler(source)
    for _ in range(3):
        assert (await reconciler.round()).looked == 2
    asked = [q.message_id.removeprefix("<K-").removesuffix("@app.test>")
             for q in source.asked]
    # round 1 the two oldest; round 2 the one not looked at, then the older of the two; round
    # 3 the one looked at longest ago, then the oldest of the others
    assert asked == ["r1", "r2", "r3", "r1", "r2", "r1"]
