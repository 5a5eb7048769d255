"""Rules of relay/core/rules.py that tests/core/test_rules.py's table leaves to a default, a
helper it also uses for the expected value, or the clock: each test here kills a mutant of
rules.py that the table let through (tools/mutate.py relay/core/rules.py -t
tests/core/test_rules.py).

- ``after_upstream`` called as DedupCore calls it for a message relayed without dedup (no
  ``second_spelling``): an accepted recipient is ``no_key`` / ``relayed``, never a duplicate;
- a ``500`` (a 5yz, RFC 5321 section 4.2.1) is a permanent refusal;
- all duplicates: the reply names the earliest send as ISO 8601 UTC;
- ``reads_as`` for a SENDING record without a store age (the admin commands read Redis's
  records so): in flight while younger than its writer's lease by ``now`` (default: this
  host's clock), in doubt after it.
"""

from __future__ import annotations

import time

import pytest

from relay.core import replies
from relay.core.interfaces import (
    Outcome,
    RcptResult,
    RcptStatus,
    Record,
    Result,
    Settle,
    SmtpReply,
    State,
)
from relay.core.rules import Ruling, Verdict, after_upstream, aggregate, iso_utc, reads_as

AT = 1_767_225_600.0  # 2026-01-01T00:00:00Z
LEASE_S = 30.0
ACCEPTED = RcptResult(RcptStatus.ACCEPTED, SmtpReply(250, "2.0.0", "Ok: queued as A1"))


@pytest.mark.parametrize("relayed", [Outcome.RELAYED, Outcome.NO_KEY, Outcome.STORE_DOWN])
def test_an_accepted_recipient_is_relayed_unless_named_a_second_spelling(
        relayed: Outcome) -> None:
    """DedupCore._relay_plain calls ``after_upstream(result, relayed=...)``: the default is the
    first (only) spelling."""
    assert after_upstream(ACCEPTED, relayed=relayed) == Ruling(Settle.SENT, Verdict(relayed))
    if relayed is Outcome.RELAYED:
        assert after_upstream(ACCEPTED) == Ruling(Settle.SENT, Verdict(Outcome.RELAYED))


def test_a_500_from_the_upstream_is_a_permanent_refusal() -> None:
    syntax = RcptResult(RcptStatus.REFUSED, SmtpReply.parse(500, "5.5.2 Syntax error"))
    assert after_upstream(syntax) == Ruling(Settle.RELEASE, Verdict(
        Outcome.REFUSED_PERM, SmtpReply(500, "5.5.2", "upstream: Syntax error"),
        refusal=syntax))


def test_all_duplicates_name_the_earliest_send_in_utc() -> None:
    reply, result = aggregate([Verdict(Outcome.SUPPRESSED, at=AT + 3600),
                               Verdict(Outcome.SUPPRESSED, at=AT + 1.9)], queue_id="q1")
    assert result is Result.SUPPRESSED
    assert str(reply) == ("250 2.0.0 Ok: duplicate suppressed for 2 recipient(s); "
                          "original sent 2026-01-01T00:00:01Z; id=q1")
    assert reply == replies.all_suppressed(2, "2026-01-01T00:00:01Z", "q1")
    assert iso_utc(AT) == "2026-01-01T00:00:00Z"
    assert iso_utc(None) is None


SENDING_WITHOUT_AGE = [
    pytest.param(Record(State.SENDING, token="t", at=AT), AT + LEASE_S - 0.1, State.PENDING,
                 id="younger-than-the-lease-is-in-flight"),
    pytest.param(Record(State.SENDING, token="t", at=AT), AT + LEASE_S, State.UNKNOWN,
                 id="a-lease-old-is-in-doubt"),
    pytest.param(Record(State.SENDING, token="t", at=AT, lease_s=2 * LEASE_S),
                 AT + LEASE_S + 1, State.PENDING,
                 id="judged-by-its-writers-lease-not-the-readers"),
    pytest.param(Record(State.SENDING, token="t", at=AT, lease_s=LEASE_S / 2),
                 AT + LEASE_S / 2, State.UNKNOWN, id="its-writers-shorter-lease-counts-too"),
    pytest.param(Record(State.SENDING, token="t"), AT, State.PENDING,
                 id="without-a-heartbeat-time-is-in-flight"),
]


@pytest.mark.parametrize(("record", "now", "expected"), SENDING_WITHOUT_AGE)
def test_a_sending_record_without_a_store_age_is_judged_by_now(
        record: Record, now: float, expected: State) -> None:
    assert reads_as(record, LEASE_S, now=now) is expected


def test_without_now_a_sending_record_is_judged_by_this_hosts_clock() -> None:
    fresh = Record(State.SENDING, token="t", at=time.time() - 1)
    stale = Record(State.SENDING, token="t", at=time.time() - 3600)
    assert reads_as(fresh, LEASE_S) is State.PENDING
    assert reads_as(stale, LEASE_S) is State.UNKNOWN
