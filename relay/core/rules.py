"""The decision rules of docs/design.md §4 as pure, synchronous functions.

Three tables, read in the order a message meets them:

1. :func:`classify` (and :func:`reserve_failed`): what the store held for one recipient's key
   -> send it, or answer for it without sending (§4.1; a record of other content,
   :func:`other_content`, follows ``key_reuse``: §4.9); which records a reserve takes over
   (:func:`takes_over`, the rule every store follows), and a record under the previous
   fingerprint secret's key counted as one under the current key (:func:`through_previous`,
   §2.3);
2. :func:`after_upstream` (and :func:`after_cut`): one recipient's upstream result -> how its
   reservation is settled and its outcome (§4.2);
3. :func:`aggregate`: every recipient's outcome -> the one reply to the final dot and the
   message's result, worst first (§4.3).

No I/O, no clock (but :func:`reads_as` for a record without a store age), no logging:
:class:`relay.core.dedup.DedupCore` runs them and does the rest. ``tests/core/test_rules.py``
holds one row per rule.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

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

# the policy knobs, typed once: relay.settings's settings and relay.core.dedup.Policy use these
MissingKeyPolicy = Literal["relay", "reject"]
UnknownPolicy = Literal["suppress", "hold", "send"]
StoreDownPolicy = Literal["fail_closed", "fail_open"]
Mode = Literal["enforce", "shadow"]  # shadow: decide as enforce does, deliver duplicates anyway
DuplicateReply = Literal["250", "550"]  # the reply to a message whose recipients are all copies
KeyReuse = Literal["suppress", "reject", "relay"]  # a key's record of other content (§4.9)


class Action(enum.Enum):
    """What to do with one recipient's fingerprint once the reserve answered (§4.1)."""

    SEND = "send"  # this attempt reserved it: relay it
    RESEND_IN_DOUBT = "resend_in_doubt"  # reserved over a record in doubt (unknown_policy =
    # send): relay it, a possible duplicate (counted and logged)
    RELAY_REUSED = "relay_reused"  # reserved over a record of other content (key_reuse =
    # relay): relay it, the key reused (counted and logged)
    ANSWER = "answer"  # do not relay: the verdict answers for it
    RELAY_WITHOUT_DEDUP = "relay_without_dedup"  # the store failed, store_down = fail_open


@dataclass(frozen=True)
class Verdict:
    """One recipient's outcome, with what the client reply needs of it.

    ``reply`` is the reply of a refusal or a temporary outcome as the client gets it; ``at``
    (unix seconds) when the original of a suppressed duplicate was sent, or when the attempt
    in doubt was; ``refusal`` the upstream result of a permanent refusal, which an RFC 3464
    notice quotes when the message is answered ``250``; ``reused``: the recipient's key held
    a record of other content (§4.9).
    """

    outcome: Outcome
    reply: SmtpReply | None = None
    at: float | None = None
    refusal: RcptResult | None = None
    reused: bool = False


@dataclass(frozen=True)
class Classification:
    """What :func:`classify` decided for one recipient: the ``action``, and for
    :attr:`Action.ANSWER` the ``verdict`` (``None`` otherwise: the upstream decides)."""

    action: Action
    verdict: Verdict | None = None


@dataclass(frozen=True)
class Ruling:
    """One recipient's upstream result as the core acts on it: ``settle`` is what its
    reservation becomes (a key is settled once: two spellings of one mailbox share it) and
    ``verdict`` its outcome."""

    settle: Settle
    verdict: Verdict


# --------------------------------------------------------------------------------------------
# §4.1 what the store held -> the action
# --------------------------------------------------------------------------------------------


def heartbeat_state(age_s: float, own_lease_s: float | None, lease_s: float) -> State:
    """What a SENDING record whose last heartbeat is ``age_s`` seconds old is (§3, "SENDING and
    the heartbeat"): PENDING (its attempt is still at work) while the heartbeat is younger
    than the lease of the attempt that wrote it (``own_lease_s``; the reader's ``lease_s``
    for a record that names none), UNKNOWN (its relay died after the final dot) from then on.
    Every store's decoder and :func:`reads_as` judge by this rule alone."""
    return State.PENDING if age_s < (own_lease_s if own_lease_s is not None else lease_s) \
        else State.UNKNOWN


def sending_record(*, token: str, at: float, ttl_s: float | None, age_s: float | None,
                   own_lease_s: float | None, lease_s: float | None) -> Record:
    """A decoded SENDING row as its reader sees it: as such for an inspection (``lease_s``
    None, or its age unknown), else judged by :func:`heartbeat_state` (a reserve: PENDING with
    its token, or UNKNOWN). ``at`` is its last heartbeat (unix seconds), ``age_s`` that
    heartbeat's age by the store's clock, ``own_lease_s`` the writer's lease (seconds, None:
    not kept), ``ttl_s`` the row's remaining life."""
    if lease_s is None or age_s is None:
        return Record(State.SENDING, token=token, at=at, ttl_s=ttl_s, age_s=age_s,
                      lease_s=own_lease_s)
    if heartbeat_state(age_s, own_lease_s, lease_s) is State.PENDING:
        return Record(State.PENDING, token=token, at=at, ttl_s=ttl_s, age_s=age_s,
                      lease_s=own_lease_s)
    return Record(State.UNKNOWN, at=at, ttl_s=ttl_s, age_s=age_s, lease_s=own_lease_s)


def same_record(now: Record, seen: Record) -> bool:
    """Whether ``now``, what a store holds, is still the record ``seen`` an operator looked at
    (§3: no unconditional delete of a live record): the same state, attempt, time and reply.
    Its remaining life, its age and the writer's lease are not compared: they move on their
    own. The compare of a release or mark-sent with ``expected`` in a store that decodes its
    rows (SQLite, PostgreSQL; Redis compares the stored value)."""
    return (now.state, now.token, now.at, now.reply) == (seen.state, seen.token, seen.at,
                                                         seen.reply)


def reads_as(record: Record, lease_s: float, now: float | None = None) -> State:
    """The state a new attempt reads ``record`` as (§3, "SENDING and the heartbeat").

    SENDING is judged by :func:`heartbeat_state` with the writer's lease (``record.lease_s``;
    ``lease_s`` seconds for a record without one). The age is the store's (``record.age_s``)
    when it reported one; ``now`` (unix seconds, default this host's clock) only for a record
    without. Every other state reads as itself.
    """
    if record.state is not State.SENDING:
        return record.state
    age_s = record.age_s
    if age_s is None:
        now = time.time() if now is None else now
        age_s = now - (record.at if record.at is not None else now)
    return heartbeat_state(age_s, record.lease_s, lease_s)


def other_content(found: Record | None, content_digest: str) -> bool:
    """Whether ``found`` was written for other content than a message whose stored digest
    is ``content_digest`` (§4.9): both digests known and different. A record without one (of
    an earlier version, a foreign value, an operator's mark-sent) never is, nor is any
    record to a message without one."""
    return (found is not None and bool(content_digest) and found.content_digest is not None
            and found.content_digest != content_digest)


def takes_over(found: Record, *, lease_s: float, content_digest: str = "",
               resend_unknown: bool = False, replace_other_content: bool = False) -> bool:
    """Whether a reserve replaces ``found``, a live record another attempt wrote, with its own
    PENDING in the same atomic step (§3, §4.1, §4.9): a record in doubt (UNKNOWN, or
    SENDING past its writer's lease, judged with ``lease_s`` for one that names none) under
    ``resend_unknown`` (``unknown_policy = send``); a SENT or in-doubt record of other
    content (:func:`other_content` with the message's ``content_digest``) under
    ``replace_other_content`` (``key_reuse = relay``). A record in flight never. The stores
    decide by this rule (SQLite calls it; the Redis script and the PostgreSQL statement are
    its twins, checked against it by the store contract's table)."""
    state = reads_as(found, lease_s)
    if resend_unknown and state is State.UNKNOWN:
        return True
    return (replace_other_content and state in (State.SENT, State.UNKNOWN)
            and other_content(found, content_digest))


def through_previous(reservation: Reservation, previous: Record, under: str, *,
                     lease_s: float, content_digest: str = "", resend_unknown: bool = False,
                     replace_other_content: bool = False) -> tuple[Reservation, bool]:
    """What a reserve found for a recipient once the record under its previous secret's key
    ``under`` (``previous``, as :meth:`FingerprintStore.inspect_many` read it) counts
    exactly as one under its current key (§2.3): a duplicate, in flight, or in doubt. Only
    when the current key held nothing (this attempt reserved it, finding no record): a
    record under the current key always wins. Returns the reservation to classify
    (``under`` naming the previous key when its record is the one found) and whether this
    attempt's new PENDING under the current key must be released: kept when the reserve
    would have taken the previous record over (:func:`takes_over`: in doubt under
    ``resend_unknown``, of other content under ``replace_other_content``), released when the
    previous record answers for the recipient."""
    if not reservation.reserved or reservation.found is not None \
            or previous.state is State.ABSENT:
        return reservation, False
    kept = takes_over(previous, lease_s=lease_s, content_digest=content_digest,
                      resend_unknown=resend_unknown,
                      replace_other_content=replace_other_content)
    return Reservation(reservation.key, reserved=kept, found=previous, under=under), not kept


def classify(reservation: Reservation, *, unknown_policy: UnknownPolicy,
             lease_s: float, content_digest: str = "",
             key_reuse: KeyReuse = "suppress") -> Classification:
    """Decide for one recipient from what its reserve found (§4.1, §4.9).

    ``lease_s`` (seconds) judges a SENDING record without a lease of its own (the stores
    report SENDING to a reserve already judged, as PENDING or UNKNOWN). A record that is
    neither in flight nor in doubt (SENT, or a foreign value) is a duplicate. One of other
    content than the message's (:func:`other_content` with ``content_digest``) follows
    ``key_reuse``: ``reject`` refuses it (``550 5.7.1``), ``suppress`` answers it as any
    duplicate or copy in doubt, both marked ``reused``; under ``relay`` the store replaced
    it (:func:`takes_over`): :attr:`Action.RELAY_REUSED`. A record in flight is in flight
    whatever its content.
    """
    found = reservation.found
    state = reads_as(found, lease_s) if found is not None else State.ABSENT
    reused = state is not State.PENDING and other_content(found, content_digest)
    if reservation.reserved:
        if reused:  # the store replaced it: key_reuse = relay
            return Classification(Action.RELAY_REUSED)
        if state is State.UNKNOWN:  # the store replaced it: unknown_policy = send
            return Classification(Action.RESEND_IN_DOUBT)
        return Classification(Action.SEND)
    if state is State.PENDING:
        return _answer(Outcome.INFLIGHT, replies.INFLIGHT)
    if reused and key_reuse == "reject":
        refusal = RcptResult(RcptStatus.REFUSED, replies.KEY_REUSED, from_upstream=False)
        return Classification(Action.ANSWER, Verdict(
            Outcome.REFUSED_PERM, replies.KEY_REUSED, refusal=refusal, reused=True))
    at = found.at if found is not None else None
    if state is State.UNKNOWN:
        if unknown_policy == "hold":
            return Classification(Action.ANSWER, Verdict(
                Outcome.HELD, replies.HELD_UNKNOWN, reused=reused))
        return Classification(Action.ANSWER, Verdict(Outcome.SUPPRESSED_UNKNOWN, at=at,
                                                     reused=reused))
    return Classification(Action.ANSWER, Verdict(Outcome.SUPPRESSED, at=at, reused=reused))


def reserve_failed(store_down: StoreDownPolicy) -> Classification:
    """Decide for every recipient of a message whose reserve failed or timed out (§4.1)."""
    if store_down == "fail_open":
        return Classification(Action.RELAY_WITHOUT_DEDUP)
    return _answer(Outcome.STORE_DOWN, replies.STORE_DOWN)


def _answer(outcome: Outcome, reply: SmtpReply) -> Classification:
    return Classification(Action.ANSWER, Verdict(outcome, reply))


# --------------------------------------------------------------------------------------------
# §4.2 the upstream's result -> the settle and the outcome
# --------------------------------------------------------------------------------------------


def after_upstream(result: RcptResult, *, relayed: Outcome = Outcome.RELAYED,
                   second_spelling: bool = False) -> Ruling:
    """Settle and outcome of one recipient from its upstream ``result`` (§4.2).

    ``relayed`` is the outcome of an accepted recipient (``no_key`` / ``store_down`` when the
    message went without dedup: then the settle is not used). A ``second_spelling`` of a
    mailbox the message names twice shares the first spelling's copy and key: ``suppressed``
    when it was accepted (two ``relayed`` would claim two copies), the same refusal
    otherwise. An upstream
    refusal reaches the client through :func:`relay.core.replies.pass_through`; the relay's
    own (``from_upstream`` False) as it is.
    """
    own = _SETTLE[result.status]
    if result.status is RcptStatus.ACCEPTED:
        return Ruling(own, Verdict(Outcome.SUPPRESSED if second_spelling else relayed))
    if result.status is RcptStatus.UNKNOWN:
        return Ruling(own, Verdict(Outcome.UNKNOWN, replies.OUTCOME_UNKNOWN))
    reply = replies.pass_through(result.reply) if result.from_upstream else result.reply
    if result.reply.code >= 500:
        return Ruling(own, Verdict(Outcome.REFUSED_PERM, reply, refusal=result))
    return Ruling(own, Verdict(Outcome.REFUSED_TEMP, reply))


_SETTLE = {RcptStatus.ACCEPTED: Settle.SENT, RcptStatus.UNKNOWN: Settle.UNKNOWN,
           RcptStatus.REFUSED: Settle.RELEASE}


def after_cut(dot_written: bool) -> Ruling:
    """Settle and outcome of a recipient whose transaction shutdown cut (past its grace):
    before the final dot nothing can have been delivered (release, try again); after it the
    outcome is unknown (RFC 1047)."""
    if dot_written:
        return Ruling(Settle.UNKNOWN, Verdict(Outcome.UNKNOWN, replies.OUTCOME_UNKNOWN))
    return Ruling(Settle.RELEASE, Verdict(Outcome.REFUSED_TEMP, replies.CUT_BY_SHUTDOWN))


# --------------------------------------------------------------------------------------------
# §4.3 every outcome -> the one reply, worst first
# --------------------------------------------------------------------------------------------

# temporary outcomes, worst first: the worst one's reply is the message's
WORST_FIRST = (Outcome.STORE_DOWN, Outcome.UNKNOWN, Outcome.REFUSED_TEMP, Outcome.HELD,
               Outcome.INFLIGHT)
_RELAYED_RESULT = {Outcome.RELAYED: Result.RELAYED, Outcome.NO_KEY: Result.NO_KEY,
                   Outcome.STORE_DOWN: Result.STORE_DOWN, Outcome.EXEMPT: Result.EXEMPT}
# what enforce keeps back for good and shadow mode relays anyway (counted would_suppress): a
# duplicate, and a copy of a message in doubt (suppressed or held). Not a copy in flight: that
# one's 450 holds nothing back (the client retries once the first attempt settled), and relaying
# it unreserved would leave no record of it if the first attempt then failed (design.md §4.6)
SHADOWED = frozenset({Outcome.SUPPRESSED, Outcome.SUPPRESSED_UNKNOWN, Outcome.HELD})


def shadowed(verdict: Verdict) -> bool:
    """Whether shadow mode relays a recipient enforce answers with ``verdict`` (§4.6): one
    enforce keeps back for good (:data:`SHADOWED`), and one refused for a key reused for other
    content (``key_reuse = reject``, §4.9)."""
    return verdict.outcome in SHADOWED or (verdict.reused
                                           and verdict.outcome is Outcome.REFUSED_PERM)


def aggregate(verdicts: Iterable[Verdict], *, queue_id: str,
              relayed: Outcome = Outcome.RELAYED,
              duplicate_reply: DuplicateReply = "250") -> tuple[SmtpReply, Result]:
    """Fold the recipients' verdicts (in recipient order) into the reply to the final dot
    and the message's result (§4.3).

    ``relayed`` names the outcome of a relayed recipient: ``no_key`` / ``store_down`` /
    ``exempt`` for a message relayed without dedup (then ``store_down`` is not a temporary
    outcome); a ``would_suppress`` recipient (shadow mode) was relayed too. A message whose
    every recipient is a duplicate is answered ``250``, or ``550 5.7.1`` when
    ``duplicate_reply`` is ``"550"`` (§4.6). Raises
    ``KeyError`` for a ``relayed`` outcome that is not a way to relay, ``ValueError`` for a
    temporary or refused verdict without its reply.
    """
    result_if_relayed = _RELAYED_RESULT[relayed]
    verdicts = list(verdicts)
    temporary = [v for v in verdicts if v.outcome in WORST_FIRST and v.outcome is not relayed]
    if temporary:  # min() keeps the first of equal rank: the first recipient's reply
        worst = min(temporary, key=lambda v: WORST_FIRST.index(v.outcome))
        return _reply_of(worst), Result.TEMPFAIL
    counts = Counter(v.outcome for v in verdicts)
    in_doubt = counts[Outcome.SUPPRESSED_UNKNOWN]
    suppressed = counts[Outcome.SUPPRESSED] + in_doubt
    refused = [v for v in verdicts if v.outcome is Outcome.REFUSED_PERM]
    sent = counts[relayed] + counts[Outcome.WOULD_SUPPRESS]  # a shadow copy went upstream too
    if refused and not sent:
        return _reply_of(refused[0]), Result.PERMFAIL
    if sent:
        return (replies.accepted(sent, suppressed, len(refused), queue_id, in_doubt),
                result_if_relayed)
    sent_at = [v.at for v in verdicts if v.at is not None]
    first = iso_utc(min(sent_at)) if sent_at else None
    if duplicate_reply == "550":
        return (replies.duplicate_refused(suppressed, first, queue_id, in_doubt),
                Result.SUPPRESSED)
    return replies.all_suppressed(suppressed, first, queue_id, in_doubt), Result.SUPPRESSED


def _reply_of(verdict: Verdict) -> SmtpReply:
    if verdict.reply is None:  # a temporary outcome or a refusal always says why
        raise ValueError(f"{verdict.outcome} verdict without its reply")
    return verdict.reply


def iso_utc(at: float | None) -> str | None:
    """Unix seconds as ISO 8601 UTC to the second (``2026-01-02T03:04:05Z``); None for None."""
    if at is None:
        return None
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
