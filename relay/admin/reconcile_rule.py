"""The reconciler's rule (docs/operating/reconciliation.md, design.md "Reconciliation"): what
the evidence sources' answers about one in-doubt message, and its age, call for. A pure
function: no store, no ledger, no clock.

Only evidence resolves: a smarthost's record of the message accepted marks it SENT, one of
its refusal at end of data releases it; no answer (``unknown``, a source that could not be
read) changes nothing until the doubt is older than ``reconcile_give_up``, when it is left to
an operator, once. Two sources that disagree (one accepted, one refused) resolve nothing: the
conflict is for a person.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from relay.reconcile.evidence import Evidence, Verdict


class Step(enum.StrEnum):
    """What the reconciler does with one in-doubt record this round."""

    MARK_SENT = "mark_sent"  # a source saw it accepted: SENT, its retries are duplicates
    RELEASE = "release"  # a source saw it refused: released, the next retry is relayed
    GIVE_UP = "give_up"  # no evidence within reconcile_give_up: left to an operator
    CONFLICT = "conflict"  # sources disagree: nothing done, logged for a person
    WAIT = "wait"  # nothing yet: asked again next round


def next_step(answers: Sequence[Evidence], *, age_s: float, give_up_s: float
              ) -> tuple[Step, Evidence | None]:
    """The step for one in-doubt record and the evidence that decides it (None: none).

    ``answers``: the answers of the sources that speak for its upstream, in their configured
    order (empty: none does, or none could be read); ``age_s``: seconds since the in-doubt
    attempt's final dot; ``give_up_s``: ``reconcile_give_up``. The first source that saw the
    message accepted or refused decides, unless another saw the opposite.
    """
    accepted = next((a for a in answers if a.verdict is Verdict.ACCEPTED), None)
    refused = next((a for a in answers if a.verdict is Verdict.REFUSED), None)
    if accepted is not None and refused is not None:
        return Step.CONFLICT, None
    if accepted is not None:
        return Step.MARK_SENT, accepted
    if refused is not None:
        return Step.RELEASE, refused
    if age_s >= give_up_s:
        return Step.GIVE_UP, None
    return Step.WAIT, None
