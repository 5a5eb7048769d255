"""The reconciler's rule (relay/admin/reconcile_rule.py, docs/operating/reconciliation.md),
one row per rule: the evidence sources' answers about one in-doubt message and its age ->
the step and the evidence that decides it. A pure function: no store, no ledger, no clock."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from relay.admin.reconcile_rule import Step, next_step
from relay.reconcile.evidence import Evidence, Verdict

GIVE_UP_S = 86400.0
YOUNG_S = 120.0  # the attempt's age: well within the give-up bound


def said(verdict: Verdict, source: str = "mx1") -> Evidence:
    return Evidence(verdict, source, f"{source}: {verdict.value} line")


ACCEPTED, REFUSED, UNKNOWN = (said(Verdict.ACCEPTED), said(Verdict.REFUSED),
                              said(Verdict.UNKNOWN))

RULES = [
    pytest.param([ACCEPTED], YOUNG_S, Step.MARK_SENT, ACCEPTED, id="accepted-marks-sent"),
    pytest.param([REFUSED], YOUNG_S, Step.RELEASE, REFUSED, id="refused-releases"),
    pytest.param([UNKNOWN], YOUNG_S, Step.WAIT, None, id="unknown-waits"),
    pytest.param([], YOUNG_S, Step.WAIT, None, id="no-source-answered-waits"),
    pytest.param([UNKNOWN], GIVE_UP_S, Step.GIVE_UP, None, id="unknown-at-the-bound-gives-up"),
    pytest.param([], GIVE_UP_S + 1, Step.GIVE_UP, None, id="no-answer-past-the-bound-gives-up"),
    pytest.param([ACCEPTED], GIVE_UP_S * 2, Step.MARK_SENT, ACCEPTED,
                 id="evidence-past-the-bound-still-resolves"),
    pytest.param([REFUSED], GIVE_UP_S * 2, Step.RELEASE, REFUSED,
                 id="a-refusal-past-the-bound-still-releases"),
    pytest.param([UNKNOWN, said(Verdict.ACCEPTED, "mx2")], YOUNG_S, Step.MARK_SENT,
                 said(Verdict.ACCEPTED, "mx2"), id="a-later-source-with-evidence-decides"),
    pytest.param([said(Verdict.ACCEPTED), said(Verdict.ACCEPTED, "mx2")], YOUNG_S,
                 Step.MARK_SENT, said(Verdict.ACCEPTED), id="the-first-that-saw-it-decides"),
    pytest.param([ACCEPTED, said(Verdict.REFUSED, "mx2")], YOUNG_S, Step.CONFLICT, None,
                 id="accepted-and-refused-conflict"),
    pytest.param([REFUSED, UNKNOWN, said(Verdict.ACCEPTED, "mx2")], GIVE_UP_S * 2,
                 Step.CONFLICT, None, id="a-conflict-past-the-bound-is-not-given-up"),
]


@pytest.mark.parametrize(("answers", "age_s", "step", "evidence"), RULES)
def test_the_evidence_decides(answers: Sequence[Evidence], age_s: float, step: Step,
                              evidence: Evidence | None) -> None:
    assert next_step(answers, age_s=age_s, give_up_s=GIVE_UP_S) == (step, evidence)


def test_only_evidence_resolves() -> None:
    """No answer, at any age, ever releases or marks sent: it waits, then gives up."""
    for age_s in (0.0, YOUNG_S, GIVE_UP_S - 1, GIVE_UP_S, 10 * GIVE_UP_S):
        for answers in ([], [UNKNOWN], [UNKNOWN, said(Verdict.UNKNOWN, "mx2")]):
            step, evidence = next_step(answers, age_s=age_s, give_up_s=GIVE_UP_S)
            assert step in (Step.WAIT, Step.GIVE_UP) and evidence is None
