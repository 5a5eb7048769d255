"""The decision rules (relay/core/rules.py, docs/design.md §4), one row per rule.

The heartbeat rule (§3: how every store reads a SENDING record), then three tables, in the order
a message meets them: what the store held -> the action (§4.1, and §4.9: a record of other
content -> key_reuse, and what a reserve takes over; §2.3: a record under the previous
secret's key);
the upstream's result -> the settle and the outcome (§4.2); every outcome -> the one reply,
worst first (§4.3). Pure functions: no store, no upstream, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from relay.core import replies
from relay.core.interfaces import (
    Outcome,
    RcptResult,
    RcptStatus,
    Record,
    Reservation,
    Result,
    Settle,
    SmtpReply,
    State,
)
from relay.core.rules import (
    Action,
    Classification,
    DuplicateReply,
    KeyReuse,
    Ruling,
    StoreDownPolicy,
    UnknownPolicy,
    Verdict,
    after_cut,
    after_upstream,
    aggregate,
    classify,
    heartbeat_state,
    iso_utc,
    reads_as,
    reserve_failed,
    sending_record,
    shadowed,
    takes_over,
    through_previous,
)
from tests.support.heartbeat_rows import HEARTBEAT

LEASE_S = 30.0  # the reader's lease
AT = 1_767_225_600.0  # 2026-01-01T00:00:00Z: when the original was sent / the doubt began
KEY = "email:fp:0f"

# --------------------------------------------------------------------------------------------
# §4.1 what the store held -> the action
# --------------------------------------------------------------------------------------------

STORE_FAILED = "the reserve failed"


def held(state: State, *, at: float | None = AT, age_s: float | None = None,
         lease_s: float | None = None) -> Reservation:
    """Another attempt's record, as a reserve reports it (not reserved)."""
    return Reservation(KEY, reserved=False, found=Record(state, at=at, age_s=age_s,
                                                         lease_s=lease_s))


def answer(outcome: Outcome, reply: SmtpReply | None = None,
           at: float | None = None) -> Classification:
    return Classification(Action.ANSWER, Verdict(outcome, reply, at=at))


CLASSIFY = [
    pytest.param(Reservation(KEY, reserved=True), "suppress",
                 Classification(Action.SEND), id="absent-is-reserved-and-sent"),
    pytest.param(held(State.PENDING, at=None), "suppress",
                 answer(Outcome.INFLIGHT, replies.INFLIGHT),
                 id="pending-of-another-attempt-is-inflight-450"),
    pytest.param(held(State.SENDING, age_s=10.0, lease_s=30.0), "suppress",
                 answer(Outcome.INFLIGHT, replies.INFLIGHT),
                 id="sending-within-its-writers-lease-is-inflight-450"),
    pytest.param(held(State.SENDING, age_s=40.0, lease_s=60.0), "suppress",
                 answer(Outcome.INFLIGHT, replies.INFLIGHT),
                 id="sending-is-judged-by-its-writers-lease-not-the-readers"),
    pytest.param(held(State.SENDING, age_s=40.0, lease_s=30.0), "suppress",
                 answer(Outcome.SUPPRESSED_UNKNOWN, at=AT),
                 id="sending-past-its-writers-lease-is-in-doubt"),
    pytest.param(held(State.SENDING, age_s=40.0), "suppress",
                 answer(Outcome.SUPPRESSED_UNKNOWN, at=AT),
                 id="sending-without-a-lease-of-its-own-is-judged-by-the-readers"),
    pytest.param(held(State.SENT), "suppress", answer(Outcome.SUPPRESSED, at=AT),
                 id="sent-within-window-is-duplicate"),
    pytest.param(held(State.SENT, at=None), "suppress", answer(Outcome.SUPPRESSED),
                 id="foreign-value-is-duplicate"),
    pytest.param(held(State.UNKNOWN), "suppress", answer(Outcome.SUPPRESSED_UNKNOWN, at=AT),
                 id="in-doubt-under-suppress-is-suppressed-as-in-doubt"),
    pytest.param(held(State.UNKNOWN), "hold", answer(Outcome.HELD, replies.HELD_UNKNOWN),
                 id="in-doubt-under-hold-is-held-451"),
    pytest.param(held(State.SENDING, age_s=40.0, lease_s=30.0), "hold",
                 answer(Outcome.HELD, replies.HELD_UNKNOWN),
                 id="sending-past-its-lease-under-hold-is-held-451"),
    pytest.param(Reservation(KEY, reserved=True, found=Record(State.UNKNOWN, at=AT)), "send",
                 Classification(Action.RESEND_IN_DOUBT),
                 id="in-doubt-under-send-is-taken-over-and-sent-again"),
    pytest.param(STORE_FAILED, "fail_closed", answer(Outcome.STORE_DOWN, replies.STORE_DOWN),
                 id="store-down-under-fail-closed-is-451"),
    pytest.param(STORE_FAILED, "fail_open", Classification(Action.RELAY_WITHOUT_DEDUP),
                 id="store-down-under-fail-open-relays-without-dedup"),
]




@pytest.mark.parametrize(("age_s", "own_lease_s", "lease_s", "expected"), HEARTBEAT)
def test_the_heartbeat_decides_whether_sending_is_in_flight_or_in_doubt(
        age_s: float, own_lease_s: float | None, lease_s: float, expected: State) -> None:
    assert heartbeat_state(age_s, own_lease_s, lease_s) is expected
    assert reads_as(Record(State.SENDING, token="t", at=AT, age_s=age_s,
                           lease_s=own_lease_s), lease_s) is expected
    judged = sending_record(token="t", at=AT, ttl_s=None, age_s=age_s,
                            own_lease_s=own_lease_s, lease_s=lease_s)
    assert judged.state is expected
    assert (judged.token == "t") is (expected is State.PENDING)


def test_a_sending_record_read_for_inspection_stays_sending() -> None:
    """Without a reader's lease (``inspect``), or without a known age, SENDING is shown as
    such: no judgment."""
    for lease_s, age_s in ((None, 10_000.0), (900.0, None)):
        record = sending_record(token="t", at=AT, ttl_s=5.0, age_s=age_s, own_lease_s=None,
                                lease_s=lease_s)
        assert (record.state, record.token) == (State.SENDING, "t")


@pytest.mark.parametrize(("reserve", "policy", "expected"), CLASSIFY)
def test_what_the_store_held_decides_the_action(
        reserve: Reservation | str, policy: UnknownPolicy | StoreDownPolicy,
        expected: Classification) -> None:
    """``policy`` is ``unknown_policy`` for a reserve that answered, ``store_down`` for one
    that failed."""
    if isinstance(reserve, str):
        assert policy in ("fail_closed", "fail_open")
        got = reserve_failed(policy)
    else:
        assert policy in ("suppress", "hold", "send")
        got = classify(reserve, unknown_policy=policy, lease_s=LEASE_S)
    assert got == expected


# --------------------------------------------------------------------------------------------
# §4.9 a key's record of other content -> key_reuse
# --------------------------------------------------------------------------------------------

MINE, THEIRS = "mine000000", "theirs0000"  # stored content digests
REUSED = RcptResult(RcptStatus.REFUSED, replies.KEY_REUSED, from_upstream=False)


def of(state: State, digest: str | None, *, reserved: bool = False,
       age_s: float | None = None) -> Reservation:
    """A record written for the content ``digest`` (None: a record without one), as a reserve
    reports it."""
    return Reservation(KEY, reserved=reserved, found=Record(
        state, at=AT, age_s=age_s, token="t" if state is State.PENDING else None,
        content_digest=digest))


KEY_REUSE = [
    pytest.param(of(State.SENT, THEIRS), "suppress", "suppress",
                 Classification(Action.ANSWER, Verdict(Outcome.SUPPRESSED, at=AT,
                                                       reused=True)),
                 id="other-content-under-suppress-is-a-duplicate-marked-reused"),
    pytest.param(of(State.SENT, THEIRS), "suppress", "reject",
                 Classification(Action.ANSWER, Verdict(Outcome.REFUSED_PERM, replies.KEY_REUSED,
                                                       refusal=REUSED, reused=True)),
                 id="other-content-under-reject-is-550"),
    pytest.param(of(State.SENT, THEIRS, reserved=True), "suppress", "relay",
                 Classification(Action.RELAY_REUSED),
                 id="other-content-under-relay-was-taken-over-and-is-relayed"),
    pytest.param(of(State.SENT, MINE), "suppress", "reject",
                 answer(Outcome.SUPPRESSED, at=AT),
                 id="the-same-content-is-a-duplicate"),
    pytest.param(of(State.SENT, None), "suppress", "reject", answer(Outcome.SUPPRESSED, at=AT),
                 id="a-record-without-a-digest-is-never-reused"),
    pytest.param(of(State.UNKNOWN, THEIRS), "hold", "suppress",
                 Classification(Action.ANSWER, Verdict(Outcome.HELD, replies.HELD_UNKNOWN,
                                                       reused=True)),
                 id="other-content-in-doubt-under-suppress-follows-unknown-policy"),
    pytest.param(of(State.UNKNOWN, THEIRS), "suppress", "reject",
                 Classification(Action.ANSWER, Verdict(Outcome.REFUSED_PERM, replies.KEY_REUSED,
                                                       refusal=REUSED, reused=True)),
                 id="other-content-in-doubt-under-reject-is-550"),
    pytest.param(of(State.UNKNOWN, THEIRS, reserved=True), "send", "relay",
                 Classification(Action.RELAY_REUSED),
                 id="other-content-in-doubt-taken-over-is-reused-not-a-possible-duplicate"),
    pytest.param(of(State.PENDING, THEIRS), "suppress", "reject",
                 answer(Outcome.INFLIGHT, replies.INFLIGHT),
                 id="other-content-in-flight-is-in-flight"),
]


@pytest.mark.parametrize(("reserve", "unknown", "key_reuse", "expected"), KEY_REUSE)
def test_a_record_of_other_content_follows_key_reuse(
        reserve: Reservation, unknown: UnknownPolicy, key_reuse: KeyReuse,
        expected: Classification) -> None:
    got = classify(reserve, unknown_policy=unknown, lease_s=LEASE_S, content_digest=MINE,
                   key_reuse=key_reuse)
    assert got == expected


def test_a_message_without_a_digest_never_finds_a_key_reused() -> None:
    got = classify(of(State.SENT, THEIRS), unknown_policy="suppress", lease_s=LEASE_S,
                   content_digest="", key_reuse="reject")
    assert got == answer(Outcome.SUPPRESSED, at=AT)


# (the record found, resend_unknown, replace_other_content, taken over)
TAKES_OVER = [
    pytest.param(Record(State.UNKNOWN, at=AT), True, False, True, id="in-doubt-resent"),
    pytest.param(Record(State.SENDING, token="t", at=AT, age_s=40.0), True, False, True,
                 id="sending-past-the-lease-resent"),
    pytest.param(Record(State.SENDING, token="t", at=AT, age_s=10.0, content_digest=THEIRS),
                 True, True, False, id="sending-in-flight-never"),
    pytest.param(Record(State.UNKNOWN, at=AT), False, False, False, id="in-doubt-kept"),
    pytest.param(Record(State.SENT, at=AT, content_digest=THEIRS), False, True, True,
                 id="sent-of-other-content-replaced"),
    pytest.param(Record(State.UNKNOWN, at=AT, content_digest=THEIRS), False, True, True,
                 id="in-doubt-of-other-content-replaced"),
    pytest.param(Record(State.SENT, at=AT, content_digest=MINE), False, True, False,
                 id="sent-of-the-same-content-kept"),
    pytest.param(Record(State.SENT), True, True, False, id="a-foreign-value-kept"),
    pytest.param(Record(State.PENDING, token="t", content_digest=THEIRS), True, True, False,
                 id="pending-never"),
]


@pytest.mark.parametrize(("found", "resend_unknown", "replace", "expected"), TAKES_OVER)
def test_what_a_reserve_takes_over(found: Record, resend_unknown: bool, replace: bool,
                                   expected: bool) -> None:
    assert takes_over(found, lease_s=LEASE_S, content_digest=MINE,
                      resend_unknown=resend_unknown, replace_other_content=replace) is expected


# --------------------------------------------------------------------------------------------
# §2.3 a record under the previous secret's key counts as one under the current key
# --------------------------------------------------------------------------------------------

PREVIOUS_KEY = "email:fp:0e"
FRESH = Reservation(KEY, reserved=True)

# (what the reserve of the current key found, the previous key's record, resend_unknown,
# what is classified, whether this attempt's PENDING under the current key is released)
THROUGH_PREVIOUS = [
    pytest.param(FRESH, Record(State.ABSENT), False, FRESH, False,
                 id="nothing-under-either-key-is-sent"),
    pytest.param(FRESH, Record(State.SENT, at=AT), False,
                 Reservation(KEY, False, Record(State.SENT, at=AT), under=PREVIOUS_KEY), True,
                 id="sent-under-the-previous-key-is-a-duplicate"),
    pytest.param(FRESH, Record(State.PENDING, token="t"), False,
                 Reservation(KEY, False, Record(State.PENDING, token="t"), under=PREVIOUS_KEY),
                 True, id="pending-under-the-previous-key-is-in-flight"),
    pytest.param(FRESH, Record(State.UNKNOWN, at=AT), False,
                 Reservation(KEY, False, Record(State.UNKNOWN, at=AT), under=PREVIOUS_KEY),
                 True, id="in-doubt-under-the-previous-key-follows-unknown-policy"),
    pytest.param(FRESH, Record(State.UNKNOWN, at=AT), True,
                 Reservation(KEY, True, Record(State.UNKNOWN, at=AT), under=PREVIOUS_KEY),
                 False, id="in-doubt-under-send-keeps-the-current-reservation"),
    pytest.param(held(State.SENT), Record(State.UNKNOWN, at=AT), True, held(State.SENT), False,
                 id="a-record-under-the-current-key-wins"),
]


@pytest.mark.parametrize(("reserved", "previous", "resend", "counted", "released"),
                         THROUGH_PREVIOUS)
def test_a_record_under_the_previous_secrets_key_counts(
        reserved: Reservation, previous: Record, resend: bool, counted: Reservation,
        released: bool) -> None:
    got = through_previous(reserved, previous, PREVIOUS_KEY, lease_s=LEASE_S,
                           resend_unknown=resend)
    assert got == (counted, released)
    if counted.found is not None and counted.under is not None:  # classified as the current's
        assert classify(counted, unknown_policy="suppress", lease_s=LEASE_S) == classify(
            Reservation(KEY, counted.reserved, counted.found), unknown_policy="suppress",
            lease_s=LEASE_S)


@pytest.mark.parametrize(("verdict", "expected"), [
    pytest.param(Verdict(Outcome.SUPPRESSED), True, id="a-duplicate"),
    pytest.param(Verdict(Outcome.REFUSED_PERM, replies.KEY_REUSED, reused=True), True,
                 id="a-key-reused-and-rejected"),
    pytest.param(Verdict(Outcome.REFUSED_PERM, replies.OUTCOME_UNKNOWN), False,
                 id="an-upstream-refusal"),
    pytest.param(Verdict(Outcome.INFLIGHT, replies.INFLIGHT), False, id="in-flight"),
])
def test_what_shadow_mode_relays_anyway(verdict: Verdict, expected: bool) -> None:
    assert shadowed(verdict) is expected


# --------------------------------------------------------------------------------------------
# §4.2 the upstream's result -> the settle and the outcome
# --------------------------------------------------------------------------------------------

ACCEPTED = RcptResult(RcptStatus.ACCEPTED, SmtpReply(250, "2.0.0", "Ok: queued as A1"))
BUSY = RcptResult(RcptStatus.REFUSED, SmtpReply.parse(450, "4.2.1 Mailbox busy"))
CLOSING = RcptResult(RcptStatus.REFUSED, SmtpReply.parse(421, "4.3.2 Closing"))
NO_SUCH_USER = RcptResult(RcptStatus.REFUSED, SmtpReply.parse(550, "5.1.1 No such user"))
UNREACHABLE = RcptResult(RcptStatus.REFUSED, replies.UPSTREAM_UNREACHABLE, from_upstream=False)
LOST = RcptResult(RcptStatus.REFUSED, replies.UPSTREAM_LOST, from_upstream=False)
NO_SMTPUTF8 = RcptResult(RcptStatus.REFUSED, replies.UPSTREAM_NO_SMTPUTF8, from_upstream=False)
NO_REPLY_TO_DOT = RcptResult(RcptStatus.UNKNOWN, replies.OUTCOME_UNKNOWN, from_upstream=False)

CUT_BEFORE_DOT, CUT_AFTER_DOT = "cut before the final dot", "cut after the final dot"


@dataclass(frozen=True)
class How:
    """How the recipient went: ``relayed`` is its outcome when accepted (``no_key`` without
    dedup); a ``second_spelling`` of a mailbox the message names twice."""

    relayed: Outcome = Outcome.RELAYED
    second_spelling: bool = False


FIRST = How()

AFTER_UPSTREAM = [
    pytest.param(ACCEPTED, FIRST, Ruling(Settle.SENT, Verdict(Outcome.RELAYED)),
                 id="accepted-is-marked-sent-and-relayed"),
    pytest.param(ACCEPTED, How(relayed=Outcome.NO_KEY),
                 Ruling(Settle.SENT, Verdict(Outcome.NO_KEY)),
                 id="accepted-without-dedup-counts-as-no-key"),
    pytest.param(ACCEPTED, How(second_spelling=True),
                 Ruling(Settle.SENT, Verdict(Outcome.SUPPRESSED)),
                 id="second-spelling-of-an-accepted-mailbox-is-suppressed"),
    pytest.param(BUSY, FIRST, Ruling(Settle.RELEASE, Verdict(
        Outcome.REFUSED_TEMP, SmtpReply(450, "4.2.1", "upstream: Mailbox busy"))),
                 id="upstream-4yz-is-released-and-passed-through"),
    pytest.param(CLOSING, FIRST, Ruling(Settle.RELEASE, Verdict(
        Outcome.REFUSED_TEMP, SmtpReply(451, "4.3.2", "upstream: Closing"))),
                 id="upstream-421-is-released-and-told-as-451"),
    pytest.param(NO_SUCH_USER, FIRST, Ruling(Settle.RELEASE, Verdict(
        Outcome.REFUSED_PERM, SmtpReply(550, "5.1.1", "upstream: No such user"),
        refusal=NO_SUCH_USER)),
                 id="upstream-5yz-is-released-refused-perm-and-owed-a-notice"),
    pytest.param(NO_SUCH_USER, How(second_spelling=True), Ruling(Settle.RELEASE, Verdict(
        Outcome.REFUSED_PERM, SmtpReply(550, "5.1.1", "upstream: No such user"),
        refusal=NO_SUCH_USER)),
                 id="second-spelling-shares-the-refusal"),
    pytest.param(UNREACHABLE, FIRST, Ruling(Settle.RELEASE, Verdict(
        Outcome.REFUSED_TEMP, replies.UPSTREAM_UNREACHABLE)),
                 id="relays-own-4yz-is-released-and-told-as-is"),
    pytest.param(NO_SMTPUTF8, FIRST, Ruling(Settle.RELEASE, Verdict(
        Outcome.REFUSED_PERM, replies.UPSTREAM_NO_SMTPUTF8, refusal=NO_SMTPUTF8)),
                 id="relays-own-5yz-is-released-and-refused-perm"),
    pytest.param(LOST, FIRST, Ruling(Settle.RELEASE, Verdict(
        Outcome.REFUSED_TEMP, replies.UPSTREAM_LOST)),
                 id="lost-before-the-dot-is-released"),
    pytest.param(NO_REPLY_TO_DOT, FIRST, Ruling(Settle.UNKNOWN, Verdict(
        Outcome.UNKNOWN, replies.OUTCOME_UNKNOWN)),
                 id="no-reply-after-the-dot-is-marked-unknown"),
    pytest.param(CUT_BEFORE_DOT, FIRST, Ruling(Settle.RELEASE, Verdict(
        Outcome.REFUSED_TEMP, replies.CUT_BY_SHUTDOWN)),
                 id="shutdown-cut-before-the-dot-is-released"),
    pytest.param(CUT_AFTER_DOT, FIRST, Ruling(Settle.UNKNOWN, Verdict(
        Outcome.UNKNOWN, replies.OUTCOME_UNKNOWN)),
                 id="shutdown-cut-after-the-dot-is-marked-unknown"),
]


@pytest.mark.parametrize(("upstream", "how", "expected"), AFTER_UPSTREAM)
def test_the_upstream_result_decides_the_settle_and_the_outcome(
        upstream: RcptResult | str, how: How, expected: Ruling) -> None:
    if isinstance(upstream, str):
        got = after_cut(dot_written=upstream == CUT_AFTER_DOT)
    else:
        got = after_upstream(upstream, relayed=how.relayed,
                             second_spelling=how.second_spelling)
    assert got == expected


# --------------------------------------------------------------------------------------------
# §4.3 every outcome -> the one reply, worst first
# --------------------------------------------------------------------------------------------

Q = "q1"
RELAYED = Verdict(Outcome.RELAYED)
DUPLICATE = Verdict(Outcome.SUPPRESSED, at=AT + 60)
EARLIER_DUPLICATE = Verdict(Outcome.SUPPRESSED, at=AT)
IN_DOUBT = Verdict(Outcome.SUPPRESSED_UNKNOWN, at=AT)
SECOND_SPELLING = Verdict(Outcome.SUPPRESSED)
STORE_DOWN = Verdict(Outcome.STORE_DOWN, replies.STORE_DOWN)
UNKNOWN = Verdict(Outcome.UNKNOWN, replies.OUTCOME_UNKNOWN)
REFUSED_BUSY = Verdict(Outcome.REFUSED_TEMP, SmtpReply(450, "4.2.1", "upstream: Mailbox busy"))
REFUSED_LOST = Verdict(Outcome.REFUSED_TEMP, replies.UPSTREAM_LOST)
HELD = Verdict(Outcome.HELD, replies.HELD_UNKNOWN)
INFLIGHT = Verdict(Outcome.INFLIGHT, replies.INFLIGHT)
NO_USER = SmtpReply(550, "5.1.1", "upstream: No such user")
REFUSED_PERM = Verdict(Outcome.REFUSED_PERM, NO_USER)
OTHER_PERM = Verdict(Outcome.REFUSED_PERM, SmtpReply(552, "5.2.2", "upstream: Mailbox full"))

AGGREGATE = [
    pytest.param([RELAYED, RELAYED], Outcome.RELAYED,
                 (replies.accepted(2, 0, 0, Q), Result.RELAYED),
                 id="all-relayed-is-250-relayed"),
    pytest.param([RELAYED, REFUSED_BUSY], Outcome.RELAYED,
                 (REFUSED_BUSY.reply, Result.TEMPFAIL),
                 id="any-temporary-outcome-wins-over-relayed"),
    pytest.param([INFLIGHT, UNKNOWN, STORE_DOWN], Outcome.RELAYED,
                 (replies.STORE_DOWN, Result.TEMPFAIL),
                 id="store-down-is-the-worst"),
    pytest.param([REFUSED_BUSY, UNKNOWN], Outcome.RELAYED,
                 (replies.OUTCOME_UNKNOWN, Result.TEMPFAIL),
                 id="unknown-is-worse-than-refused-temp"),
    pytest.param([HELD, REFUSED_BUSY], Outcome.RELAYED,
                 (REFUSED_BUSY.reply, Result.TEMPFAIL),
                 id="refused-temp-is-worse-than-held"),
    pytest.param([INFLIGHT, HELD], Outcome.RELAYED,
                 (replies.HELD_UNKNOWN, Result.TEMPFAIL),
                 id="held-is-worse-than-inflight"),
    pytest.param([INFLIGHT, DUPLICATE], Outcome.RELAYED,
                 (replies.INFLIGHT, Result.TEMPFAIL),
                 id="inflight-beside-a-duplicate-is-450"),
    pytest.param([REFUSED_LOST, REFUSED_BUSY], Outcome.RELAYED,
                 (replies.UPSTREAM_LOST, Result.TEMPFAIL),
                 id="within-a-rank-the-first-recipients-reply"),
    pytest.param([REFUSED_PERM, OTHER_PERM], Outcome.RELAYED, (NO_USER, Result.PERMFAIL),
                 id="all-refused-perm-is-the-first-5yz"),
    pytest.param([REFUSED_PERM, DUPLICATE], Outcome.RELAYED, (NO_USER, Result.PERMFAIL),
                 id="refused-perm-and-nothing-relayed-is-the-5yz"),
    pytest.param([RELAYED, REFUSED_PERM], Outcome.RELAYED,
                 (replies.accepted(1, 0, 1, Q), Result.RELAYED),
                 id="refused-perm-beside-relayed-is-250-with-the-count"),
    pytest.param([RELAYED, DUPLICATE, IN_DOUBT, SECOND_SPELLING], Outcome.RELAYED,
                 (replies.accepted(1, 3, 0, Q, in_doubt=1), Result.RELAYED),
                 id="relayed-beside-duplicates-counts-them-and-those-in-doubt"),
    pytest.param([DUPLICATE, EARLIER_DUPLICATE], Outcome.RELAYED,
                 (replies.all_suppressed(2, iso_utc(AT), Q), Result.SUPPRESSED),
                 id="all-duplicates-is-250-naming-the-earliest-send"),
    pytest.param([DUPLICATE, IN_DOUBT], Outcome.RELAYED,
                 (replies.all_suppressed(2, iso_utc(AT), Q, in_doubt=1), Result.SUPPRESSED),
                 id="duplicates-in-doubt-say-in-doubt"),
    pytest.param([Verdict(Outcome.NO_KEY), REFUSED_PERM], Outcome.NO_KEY,
                 (replies.accepted(1, 0, 1, Q), Result.NO_KEY),
                 id="relayed-without-a-key-is-result-no-key"),
    pytest.param([Verdict(Outcome.STORE_DOWN)], Outcome.STORE_DOWN,
                 (replies.accepted(1, 0, 0, Q), Result.STORE_DOWN),
                 id="relayed-under-fail-open-is-result-store-down-not-a-tempfail"),
]


@pytest.mark.parametrize(("verdicts", "relayed", "expected"), AGGREGATE)
def test_the_reply_is_the_worst_outcome_first(
        verdicts: Sequence[Verdict], relayed: Outcome,
        expected: tuple[SmtpReply, Result]) -> None:
    assert aggregate(verdicts, queue_id=Q, relayed=relayed) == expected


SHADOW_COPY = Verdict(Outcome.WOULD_SUPPRESS)

DESIGN_4_6 = [
    pytest.param([SHADOW_COPY], "250", (replies.accepted(1, 0, 0, Q), Result.RELAYED),
                 id="a-shadow-copy-was-relayed"),
    pytest.param([SHADOW_COPY, REFUSED_PERM], "250",
                 (replies.accepted(1, 0, 1, Q), Result.RELAYED),
                 id="a-shadow-copy-beside-a-refusal-is-250-and-owes-a-notice"),
    pytest.param([DUPLICATE, EARLIER_DUPLICATE], "550",
                 (replies.duplicate_refused(2, iso_utc(AT), Q), Result.SUPPRESSED),
                 id="all-duplicates-with-duplicate-reply-550"),
    pytest.param([DUPLICATE, IN_DOUBT], "550",
                 (replies.duplicate_refused(2, iso_utc(AT), Q, in_doubt=1), Result.SUPPRESSED),
                 id="duplicates-in-doubt-with-550-say-in-doubt"),
    pytest.param([RELAYED, DUPLICATE], "550",
                 (replies.accepted(1, 1, 0, Q), Result.RELAYED),
                 id="a-relayed-recipient-makes-it-250-whatever-duplicate-reply-says"),
    pytest.param([INFLIGHT, DUPLICATE], "550", (replies.INFLIGHT, Result.TEMPFAIL),
                 id="a-temporary-outcome-beats-the-550"),
]


@pytest.mark.parametrize(("verdicts", "duplicate_reply", "expected"), DESIGN_4_6)
def test_shadow_copies_and_the_duplicate_reply(
        verdicts: Sequence[Verdict], duplicate_reply: DuplicateReply,
        expected: tuple[SmtpReply, Result]) -> None:
    assert aggregate(verdicts, queue_id=Q, duplicate_reply=duplicate_reply) == expected


def test_the_550_is_a_policy_refusal_after_data() -> None:
    """RFC 5321 section 4.3.2 (550 after DATA for policy reasons), RFC 3463 X.7.1."""
    reply = replies.duplicate_refused(1, None, Q)
    assert (reply.code, reply.enhanced) == (550, "5.7.1")
