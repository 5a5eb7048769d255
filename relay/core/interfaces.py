"""Protocols and frozen value types shared by the dedup core and its adapters.

The core (:mod:`relay.core.dedup`) depends only on what is defined here; the concrete stores
(:mod:`relay.store.redis.store`, :mod:`relay.store.sqlite.store`,
:mod:`relay.store.postgres.store`), upstream (:mod:`relay.upstream.smtp`,
:mod:`relay.upstream.maildir`) and metrics (:mod:`relay.ops.metrics`) implement these Protocols and
are wired together in :mod:`relay.app` only.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# --------------------------------------------------------------------------------------------
# Store
# --------------------------------------------------------------------------------------------


class State(enum.Enum):
    """State of one fingerprint in the store (design.md §3)."""

    ABSENT = "absent"
    PENDING = "pending"
    SENDING = "sending"  # final dot going out: outlives a crash of its attempt as UNKNOWN
    SENT = "sent"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Record:
    """What the store holds for one key.

    ``token`` is set for PENDING and SENDING only. ``at`` is the unix time in seconds of the send
    (SENT), of the in-doubt attempt (UNKNOWN) or of the final dot going out (SENDING); ``None``
    when unknown (a foreign value such as ``1``, which counts as SENT). ``reply`` is the
    upstream's reply text kept with SENT. ``ttl_s`` is the remaining lifetime in seconds,
    ``None`` when the store cannot tell; ``age_s`` how long ago ``at`` was by the store's own
    clock (what decides whether a SENDING record is in doubt), ``None`` when not known.
    ``lease_s`` is, for SENDING, the lease of the attempt that wrote it: the record is in doubt
    once that long passed without a heartbeat, whatever lease the reader is configured with
    (relays with different leases may share a store during a configuration change).
    ``content_digest`` is the stored digest of the content of the message whose attempt
    wrote the record (:meth:`relay.core.keys.DerivedKey.content_digest`, kept from its
    reserve through every state), None when the record has none.
    """

    state: State
    token: str | None = None
    at: float | None = None
    reply: str | None = None
    ttl_s: float | None = None
    age_s: float | None = None  # seconds since ``at`` by the store's clock when it was read
    lease_s: float | None = None  # SENDING: the lease of the attempt that wrote it
    # the value as stored, for a compare-and-delete (None where the store has no single value)
    raw: bytes | None = field(default=None, compare=False, repr=False)
    # the stored digest of the content of the message that wrote it (design.md §2.2); None:
    # not known (a record of an earlier version, a foreign value, an operator's mark-sent)
    content_digest: str | None = None


@dataclass(frozen=True)
class Reservation:
    """Result of reserving one store key.

    ``reserved`` is True when this attempt created ``PENDING(token)``; otherwise ``found`` is the
    record that was already there (PENDING of another attempt, SENT or UNKNOWN). Both are set
    when a reserve with ``resend_unknown`` replaced a record in doubt (``found`` is UNKNOWN),
    and when one with ``replace_other_content`` replaced a record of other content (``found``
    is that SENT or UNKNOWN record, with its ``content_digest``).
    A SENDING record is reported as PENDING while its last heartbeat (the SENDING mark or a
    renewal, by the store's clock) is younger than the lease (its attempt is waiting for the
    upstream's reply) and as UNKNOWN after that (its attempt died after the final dot).
    ``under`` names the key ``found`` is under when it is not ``key``: the previous
    fingerprint secret's key of the same recipient (design.md §2.3), whose record counts as
    one under ``key``.
    """

    key: str
    reserved: bool
    found: Record | None = None
    under: str | None = None


class Settle(enum.Enum):
    """How to settle a reservation after the upstream transaction (design.md §4.2)."""

    SENDING = "sending"  # PENDING(token) -> SENDING(token, now), TTL = dedup window
    SENT = "sent"  # PENDING|SENDING(token) -> SENT(now, reply), TTL = dedup window
    UNKNOWN = "unknown"  # PENDING|SENDING(token) -> UNKNOWN(now), TTL = dedup window
    RELEASE = "release"  # PENDING|SENDING(token) -> absent


@dataclass(frozen=True)
class SettleOp:
    """One settlement: ``key`` is the full store key, ``reply`` the upstream reply for SENT."""

    key: str
    action: Settle
    reply: str = ""
    lease_s: float = 0.0  # SENDING only: the attempt's lease, kept in the record (see Record);
    # 0: none kept, readers judge the record by their own lease
    window_s: float = 0.0  # the dedup window of its message's policy (seconds; the TTL of SENT,
    # SENDING and UNKNOWN); 0: the relay's dedup_window


class SettleWatch(Protocol):
    """The settles of some keys, watched (:meth:`FingerprintStore.watch_settles`)."""

    async def settled(self, key: str) -> None:
        """Return once a settle that ended another attempt's hold on ``key`` (SENT, UNKNOWN,
        a release, an operator's release or mark-sent) was announced since the watch began.
        Never raises; waits for ever when none comes (the caller bounds the wait)."""
        ...


class FingerprintStore(Protocol):
    """Atomic per-key state machine: absent -> PENDING -> SENT | UNKNOWN | absent.

    Every transition is atomic on one key and compares the attempt's token first, so a
    reservation whose lease ran out and was taken by another attempt is never overwritten.
    All methods raise :class:`relay.core.errors.StoreError` on any failure or timeout.
    """

    async def reserve(
        self, keys: Sequence[str], *, token: str, lease_s: float, resend_unknown: bool = False,
        content_digest: str = "", replace_other_content: bool = False,
    ) -> list[Reservation]:
        """Create ``PENDING(token)`` with TTL ``lease_s`` seconds for every absent key.

        All keys go in one round trip; the result has one :class:`Reservation` per key, in order.
        A value the store does not recognise is reported as SENT. ``content_digest`` (the
        message's, ``[A-Za-z0-9_-]``; ``""``: none) is kept in the record through every state
        it takes, and each ``found`` record carries its own. A record is replaced by
        ``PENDING(token)`` in the same atomic step (``reserved=True``, ``found`` the record
        replaced) when :func:`relay.core.rules.takes_over` says so: with ``resend_unknown``
        (``unknown_policy = send``) a record in doubt (UNKNOWN, or SENDING older than the
        lease); with ``replace_other_content`` (``key_reuse = relay``) a SENT or in-doubt
        record of other content. Raises :class:`relay.core.errors.StoreError`.
        """
        ...

    async def settle(
        self, ops: Sequence[SettleOp], *, token: str, window_s: float
    ) -> list[bool]:
        """Apply every settlement in one round trip, each only if the key holds ``PENDING(token)``
        or ``SENDING(token)`` (a SENDING action on SENDING(token) is a retry: applied again).

        ``window_s`` is the dedup window in seconds (TTL of SENT and UNKNOWN). Every time
        recorded (SENDING, SENT, UNKNOWN) is the store's own clock, never the relay's, so that
        relays whose clocks disagree still agree on a record's age. Returns, per op, whether
        the token matched and the transition was applied.
        """
        ...

    async def renew(self, keys: Sequence[str], *, token: str, lease_s: float,
                    window_s: float = 0.0) -> list[bool]:
        """Keep an attempt that is still working alive, in one round trip: ``PENDING(token)``
        lives ``lease_s`` seconds from now again; ``SENDING(token)`` gets the store's now as
        its heartbeat (a SENDING record not renewed for a lease reads as in doubt) and, when
        ``window_s`` > 0, lives at least ``window_s`` seconds from it (a transfer longer than
        the dedup window must not outlive its record). Returns, per key, whether it was still
        this attempt's. Raises :class:`relay.core.errors.StoreError`.
        """
        ...

    async def inspect(self, key: str) -> Record:
        """Return the record under ``key`` (``State.ABSENT`` when there is none)."""
        ...

    async def inspect_many(self, keys: Sequence[str]) -> list[Record]:
        """Return the record under each of ``keys``, in order, read as :meth:`inspect` reads
        one, in one round trip (a Redis Cluster: one per node, in parallel). Raises
        :class:`relay.core.errors.StoreError`."""
        ...

    async def force_release(self, key: str, *, expected: Record | None = None) -> bool:
        """Delete ``key`` (operator action); True when something was deleted.

        With ``expected`` (what :meth:`inspect` returned) only while the key still holds that
        record, in one atomic step: an attempt that took the key over since the operator looked
        is never wiped (design.md §3: no unconditional delete of a live record).
        """
        ...

    async def force_mark_sent(self, key: str, *, reply: str, window_s: float,
                              expected: Record | None = None) -> bool:
        """Set ``key`` to SENT(the store's now, ``reply``) for ``window_s`` seconds (operator
        action: an in-doubt message the upstream's log shows delivered); True when written.

        With ``expected`` (what :meth:`inspect` returned) only while the key still holds that
        record (for ABSENT: holds none), in one atomic step, as :meth:`force_release`: a
        retry that took the key over since the operator looked keeps its record, and the
        call answers False. Without it, whatever the key holds. Raises
        :class:`relay.core.errors.StoreError`."""
        ...

    def watch_settles(self, keys: Sequence[str]) -> AbstractAsyncContextManager[SettleWatch]:
        """Watch the settles of ``keys`` (design.md §4.8): once entered, every settle of one
        of them by any relay on this store is seen by the watch, so a caller that reads the
        record after entering misses none. Shared by every watcher of the process: what it
        costs the store does not grow with the number of watchers. Entering raises
        :class:`relay.core.errors.StoreError` when the store cannot watch now."""
        ...

    async def ping(self) -> None:
        """Check that the store answers; raise StoreError when it does not."""
        ...

    async def identity(self) -> str:
        """A name of the data this store holds that does not depend on how its URL is
        spelled (the settle journal's lines are owed to it, design.md §3): the same for every
        URL that reaches the same data, another for other data. Raises
        :class:`relay.core.errors.StoreError` when the store does not answer."""
        ...

    async def close(self) -> None:
        """Release connections and file handles."""
        ...


class SettleLog(Protocol):
    """Where the settles a relay owes are kept from before the client's reply until they land,
    so that a crash loses none (the settle journal, :class:`relay.store.journal.SettleJournal`;
    design.md §3). Owed settles are ``(token, op)`` pairs."""

    async def owe(self, owed: Sequence[tuple[str, SettleOp]]) -> bool:
        """Write ``owed`` durably; True once they are on disk, False when they could not be
        written (logged; they are then kept in memory only). Never raises."""
        ...

    def landed(self, paid: Sequence[tuple[str, SettleOp]]) -> None:
        """``paid`` landed in the store, or were given up: drop them (soon, in the order of
        the calls). Never raises."""
        ...

    async def unpaid(self, keys: Sequence[str]) -> list[tuple[str, SettleOp]]:
        """Before a reserve of ``keys``: the settles an earlier run owed to this store that
        the caller does not hold yet, to apply first; [] when no such settle can touch
        ``keys``. Raises :class:`relay.core.errors.StoreError` when one may touch them and
        the store cannot say yet whether it is its own."""
        ...


@dataclass(frozen=True)
class StateCounts:
    """How many fingerprint records one key prefix holds, by state (``dedup-relay stats``).

    ``pending``, ``sending``, ``sent`` and ``unknown`` count the records as stored (a SENDING
    record is counted as ``sending`` whatever its age). ``sent`` includes ``foreign``: keys
    under the prefix holding a value the relay did not write (another application's value, or
    another Redis type), which the store reads as SENT (design.md §3), as every reserve does.
    ``sending_past_lease`` is the part of ``sending`` whose last heartbeat is older than its
    attempt's lease (the reader's lease for a record that names none): a reserve reads it as
    UNKNOWN, so it is in doubt (:attr:`in_doubt`). ``oldest_in_doubt_at`` is the unix time in
    seconds of the oldest in-doubt record (UNKNOWN: since when; SENDING: its last heartbeat),
    ``oldest_in_doubt_age_s`` its age by the store's clock; both ``None`` when none is in doubt
    or its time is unknown. ``in_doubt_older`` counts the in-doubt records at least the
    ``older_than_s`` asked for old. ``scanned`` is how many keys were looked at (a Redis key
    that expired between SCAN and GET counts here and in no state); ``complete`` is False when
    the count stopped at its ``max_keys`` cap before the end of the keyspace.
    """

    pending: int = 0
    sending: int = 0
    sent: int = 0
    unknown: int = 0
    foreign: int = 0
    sending_past_lease: int = 0
    scanned: int = 0
    complete: bool = True
    oldest_in_doubt_at: float | None = None
    oldest_in_doubt_age_s: float | None = None
    in_doubt_older: int = 0

    @property
    def in_doubt(self) -> int:
        """Records in doubt: UNKNOWN, plus SENDING past its lease (read as UNKNOWN)."""
        return self.unknown + self.sending_past_lease


@runtime_checkable
class StateCounter(Protocol):
    """A store that can count its records by state (an admin command's, not the relay's hot
    path: a Redis store scans its keyspace)."""

    async def count_states(self, prefix: str, *, lease_s: float, older_than_s: float,
                           max_keys: int | None = None,
                           progress: Callable[[int], None] | None = None) -> StateCounts:
        """Count the records whose key starts with ``prefix``.

        ``lease_s`` (seconds) judges a SENDING record that names no lease of its own;
        ``older_than_s`` (seconds) is the age from which an in-doubt record counts in
        ``in_doubt_older``. ``max_keys`` caps the keys looked at (None: no cap; a store that
        counts in one query ignores it). ``progress(scanned)`` is called after each batch of
        keys, with the number looked at so far. Raises :class:`relay.core.errors.StoreError`.
        """
        ...


# --------------------------------------------------------------------------------------------
# Rate limits
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LimitCheck:
    """One limit that applies to a message: at most ``limit`` units per ``per_s`` seconds
    (a sliding window) in the bucket ``bucket``, of which the message takes ``cost`` (1 for a
    ``messages`` limit, its recipient count for a ``recipients`` one).

    ``label`` names the configured limit (the ``limit`` label of
    ``relay_rate_limited_total``, and the reply's text); ``kind`` is ``messages`` or
    ``recipients``; ``bucket`` names the counter (``<label>:<m|r>:<scope>:<value>``; the store
    hashes it into a key, so a domain or user name never appears in the keyspace).
    """

    label: str
    kind: str  # "messages" | "recipients"
    bucket: str
    limit: int
    per_s: float
    cost: int = 1


@dataclass(frozen=True)
class LimitVerdict:
    """What :meth:`RateLimiter.acquire` decided: ``allowed`` (every check took its cost), or
    the first check that refused (``refused``) and in how many seconds its window has room
    again (``retry_after_s``; ``None`` when the cost exceeds the limit itself: never)."""

    allowed: bool
    refused: LimitCheck | None = None
    retry_after_s: float | None = None


class RateLimiter(Protocol):
    """Sliding-window limits shared by every relay on one store (design.md §4.7).

    Raises :class:`relay.core.errors.StoreError` on any failure or timeout.
    """

    async def acquire(self, checks: Sequence[LimitCheck]) -> LimitVerdict:
        """Take every check's cost at once, or none: when one check has no room (the units
        taken in its bucket over the last ``per_s`` seconds plus ``cost`` exceed ``limit``),
        nothing is taken from any bucket and the verdict names it. Times are the store's
        clock, never the relay's. One round trip (one transaction)."""
        ...


# --------------------------------------------------------------------------------------------
# Upstream
# --------------------------------------------------------------------------------------------


# RFC 3463 section 2: class "." subject "." detail; in a reply it is followed by SP (RFC 2034)
_ENHANCED = re.compile(r"[245]\.\d{1,3}\.\d{1,3}")
_ENHANCED_PREFIX = re.compile(f"({_ENHANCED.pattern})" + r"(?: |\Z|(?=\n\Z))")
_ENHANCED_BEFORE_BLANK = re.compile(f"({_ENHANCED.pattern})" + r"(?=\s|\Z)")


@dataclass(frozen=True)
class SmtpReply:
    """An SMTP reply: three-digit ``code`` (RFC 5321 section 4.2), the RFC 3463 ``enhanced``
    status code (``"4.2.0"``; ``None`` for replies that carry none, RFC 2034 section 3: the
    greeting, ``334``, ``354``, or an upstream that sent none) and the human-readable ``detail``.

    On the wire it is ``code SP enhanced SP detail`` (:meth:`__str__`); :attr:`text` is what
    follows the code. A reply read off the wire is built with :meth:`parse`. Raises
    ``ValueError`` for an ``enhanced`` that is not ``class.subject.detail``.
    """

    code: int
    enhanced: str | None
    detail: str

    def __post_init__(self) -> None:
        if self.enhanced is not None and _ENHANCED.fullmatch(self.enhanced) is None:
            raise ValueError(f"not an RFC 3463 enhanced status code: {self.enhanced!r}")

    @classmethod
    def parse(cls, code: int, text: str) -> SmtpReply:
        """The reply ``code text`` as an SMTP server sent it: a leading enhanced status code
        followed by a space (or ending the text) is taken off ``text`` into ``enhanced``, so
        ``str()`` gives back ``f"{code} {text}"`` (trailing blanks aside)."""
        match = _ENHANCED_PREFIX.match(text)
        if match is None:
            return cls(code, None, text)
        return cls(code, match.group(1), text[match.end():])

    @property
    def text(self) -> str:
        """What follows the code on the wire: the enhanced code, a space and the detail."""
        if self.enhanced is None:
            return self.detail
        return f"{self.enhanced} {self.detail}" if self.detail else self.enhanced

    @property
    def stated_enhanced(self) -> str | None:
        """The enhanced status code the reply states: :attr:`enhanced`, or one leading the
        text followed by a tab or a line break (an upstream's ``5.1.1<TAB>User unknown`` or
        multi-line reply, which :meth:`parse` leaves in the text to keep it byte-exact)."""
        if self.enhanced is not None:
            return self.enhanced
        found = _ENHANCED_BEFORE_BLANK.match(self.detail)
        return found.group(1) if found is not None else None

    def __str__(self) -> str:
        return f"{self.code} {self.text}".rstrip()


@dataclass(frozen=True)
class OutboundMessage:
    """One upstream transaction.

    ``mail_from`` is the reverse path without angle brackets (``""`` for the null sender);
    ``rcpt_tos`` the forward paths to send to, each without brackets; ``content`` the message as
    received after one dot-unstuffing, CRLF line ends, with the relay's ``Received:`` header
    prepended (bytes, never re-encoded). ``smtputf8`` is True when an address is not ASCII or
    the client declared SMTPUTF8 for a message whose header section is not ASCII (RFC 6531);
    ``utf8_headers`` when the header section holds UTF-8 that only SMTPUTF8 carries (no
    downgrade then); ``eight_bit`` when the content holds a byte >= 0x80 (RFC 6152).
    """

    mail_from: str
    rcpt_tos: Sequence[str]
    content: bytes
    smtputf8: bool = False
    eight_bit: bool = False
    utf8_headers: bool = False


class RcptStatus(enum.Enum):
    """Per-recipient outcome of one upstream transaction."""

    ACCEPTED = "accepted"  # RCPT accepted and the final dot answered 2yz
    REFUSED = "refused"  # refused at RCPT, or the transaction failed before/at the final dot
    UNKNOWN = "unknown"  # the final dot was written and no reply came (RFC 1047)


@dataclass(frozen=True)
class RcptResult:
    """Outcome for one recipient plus the reply that decided it.

    ``from_upstream`` is False when the relay synthesized ``reply`` (connection failure,
    timeout, missing extension): such a reply is already worded for the client.
    """

    status: RcptStatus
    reply: SmtpReply
    from_upstream: bool = True


@dataclass
class DeliveryProgress:
    """The core's hook into a running transaction, and what the upstream reports back.

    ``before_dot`` (optional) is started by the upstream once the recipients are accepted,
    with the recipients the upstream accepted; it may run while DATA is answered and the
    message goes out, and the final dot is written only once it returned True; it returns
    False to abort (no dot is sent, every recipient is refused temporarily with
    ``abort_reply``, set by the hook; the store's-unavailable reply when it is None). The
    core uses it to mark those reservations SENDING, so that a relay killed while waiting for
    the reply leaves them in doubt instead of lapsing into a duplicate.
    ``dot_written`` turns True once the message and its final dot were handed to the network
    (after that, cutting the transaction leaves its outcome unknown, RFC 1047), and back to
    False when the upstream, given no reply, reset the connection while bytes of the message
    were still unsent in the kernel (the dot can then never arrive).
    """

    before_dot: Callable[[Sequence[str]], Awaitable[bool]] | None = None
    dot_written: bool = False
    abort_reply: SmtpReply | None = None  # why ``before_dot`` said no, as the client is told


@dataclass(frozen=True)
class DeliveryResult:
    """Outcome of one upstream transaction: one :class:`RcptResult` per recipient sent."""

    recipients: Mapping[str, RcptResult]
    final_reply: SmtpReply | None = None  # the reply to the final dot, when one came
    replies: Sequence[SmtpReply] = field(default_factory=tuple)  # every upstream reply seen
    # True when the transaction failed definitely before any recipient was accepted and before
    # DATA (connect refused or timed out; greeting, EHLO, TLS or AUTH failure; 421; a 4yz to
    # MAIL): another upstream may take the message with no risk of a duplicate
    failover: bool = False
    upstream: str = ""  # the configured name of the upstream that gave this result ("": unnamed)


class Upstream(Protocol):
    """Where relayed mail goes: an SMTP smarthost, or a local Maildir for staging.

    ``deliver`` never raises for a failure of the transaction: connection failures, refusals,
    timeouts and lost connections are reported per recipient in the result, and a recipient is
    UNKNOWN only when the final dot was fully written and no reply came.
    """

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        """Run one transaction for ``message`` and report every recipient's outcome.

        ``progress.dot_written`` is set once the final dot is out, so that a caller that
        cancels the transaction (shutdown past its grace) knows whether to release or to mark
        the reservations UNKNOWN.
        """
        ...

    async def ping(self) -> None:
        """Check that the upstream answers; raise :class:`ConnectionError` when it does not."""
        ...

    async def close(self) -> None:
        """Close pooled connections."""
        ...


# --------------------------------------------------------------------------------------------
# Notices to the sender
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NonDelivery:
    """A message answered ``250`` of which some recipients were refused permanently.

    RFC 5321 sections 4.2.5 and 6.1: having accepted it, the relay owes the envelope sender a
    non-delivery notification. ``mail_from`` is the original reverse path (``""`` for the null
    sender); ``failures`` maps each refused recipient (as the client spelled it) to the result
    that refused it; ``content`` is the message as relayed (the relay's ``Received:`` header
    first, CRLF line ends; only its header section is quoted back); ``queue_id`` names it in logs.
    """

    mail_from: str
    failures: Mapping[str, RcptResult]
    content: bytes
    queue_id: str = ""
    # the offset after ``content``'s header section when the caller located it (None: the
    # notifier locates it)
    header_end: int | None = None


class Notifier(Protocol):
    """Tells senders what became of mail the relay accepted (RFC 3464 delivery status)."""

    def non_delivery(self, notice: NonDelivery) -> None:
        """Owe ``notice.mail_from`` a notice; returns at once (the send runs in the background)
        and never raises. The notifier decides whether a notice is due (none to the null
        sender, RFC 5321 section 4.5.5)."""
        ...


# --------------------------------------------------------------------------------------------
# Audit ledger
# --------------------------------------------------------------------------------------------


class LedgerAction(enum.StrEnum):
    """What wrote a ledger row: the relay deciding for a recipient, or an operator's command."""

    RELAY = "relay"  # a recipient decision of the relay (its outcome: an :class:`Outcome`)
    RELEASE = "release"  # `dedup-relay release` deleted the record (outcome ``released``)
    MARK_SENT = "mark_sent"  # `dedup-relay mark-sent` set it SENT (outcome ``marked_sent``)
    # the reconciler (docs/operating/reconciliation.md), on a smarthost's own record of an
    # in-doubt message: its outcome is the action's name
    RECONCILED_SENT = "reconciled_sent"  # it logged the message accepted: the record SENT
    RECONCILED_RELEASED = "reconciled_released"  # it logged a refusal: the record released
    RECONCILE_GIVEN_UP = "reconcile_given_up"  # no evidence within reconcile_give_up: left


@dataclass(frozen=True)
class LedgerEntry:
    """One audit row (design.md §6.7), as the core or an admin command made it.

    ``recipient`` and ``dedupe_key`` are as the client sent them: the ledger masks the
    recipient and hashes the key per its settings before they leave the process. ``store_key``
    is ``None`` for a decision without a fingerprint (no key, an exempt template, a message
    refused before one was derived). ``outcome`` is an :class:`Outcome` value for
    :attr:`LedgerAction.RELAY`, ``released`` or ``marked_sent`` for an operator's row, the
    action's own name for the reconciler's (``reconciled_sent`` ...).
    ``reply`` is the upstream's reply that decided the recipient (``""``: none came, or the
    relay answered without relaying), ``upstream_queue_id`` the queue id read off it,
    ``client_reply`` what the client was told for the message; ``decided_at`` the relay's
    clock (unix seconds) when it answered; ``key_source`` where the key came from
    (``header``, ``rule:NAME``); ``key_reused``: the recipient's key held a record of other
    content (design.md §4.9). ``received_at``: the relay's clock when the message's final
    dot came in from the client; ``sending_at``: when the relay marked its records SENDING,
    right before its own final dot went upstream (None: not known, or nothing was sent with
    a reservation).
    """

    decided_at: float
    outcome: str
    recipient: str
    store_key: str | None = None
    template: str = ""
    dedupe_key: str | None = None
    reply: str = ""
    upstream_queue_id: str = ""
    upstream: str = ""
    message_id: str = ""
    queue_id: str = ""
    client_reply: str = ""
    action: LedgerAction = LedgerAction.RELAY
    key_source: str = ""  # where the key came from: header, rule:NAME ("": none, an operator)
    key_reused: bool = False
    received_at: float | None = None
    sending_at: float | None = None


class AuditLedger(Protocol):
    """Where the core hands its recipient decisions, off the hot path (a bounded queue written
    in batches by the adapter, :mod:`relay.store.postgres.ledger`)."""

    def record(self, entries: Sequence[LedgerEntry], *, admitted: bool = True) -> None:
        """Queue ``entries``; returns at once and never raises. A full queue drops them
        (counted in ``relay_ledger_dropped_total``) unless the ledger is required and they
        are the rows of a message it ``admitted`` (:meth:`admits` said yes for it); the rows
        of a message refused because the ledger could not take rows are kept only while
        there is room."""
        ...

    def admits(self) -> bool:
        """Whether a new message may be taken: always True unless ``ledger_required`` is set;
        then False while the ledger is failing or its queue is full (the core answers 451)."""
        ...


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


class Outcome(enum.StrEnum):
    """What became of one envelope recipient: the ``outcome`` label of
    ``relay_recipients_total`` (docs/design.md §4; dashboards and alert rules name these
    strings, so a value is never renamed)."""

    RELAYED = "relayed"  # the upstream accepted it
    SUPPRESSED = "suppressed"  # a duplicate: SENT within the dedup window, not relayed again
    SUPPRESSED_UNKNOWN = "suppressed_unknown"  # an earlier attempt is in doubt (policy suppress)
    INFLIGHT = "inflight"  # another attempt holds the reservation: 450, retry
    HELD = "held"  # an earlier attempt is in doubt (unknown_policy = hold): 451
    REFUSED_TEMP = "refused_temp"  # refused temporarily (upstream 4yz, or the relay's own)
    REFUSED_PERM = "refused_perm"  # refused permanently (upstream 5yz, or the relay's own)
    UNKNOWN = "unknown"  # the final dot was written and no reply came (RFC 1047)
    NO_KEY = "no_key"  # relayed without dedup: the message has no dedupe key
    STORE_DOWN = "store_down"  # the store failed: 451 (fail_closed), or relayed (fail_open)
    EXEMPT = "exempt"  # relayed without dedup: its template's policy says dedup = false
    WOULD_SUPPRESS = "would_suppress"  # shadow mode: enforce would not have relayed it (a
    # duplicate, in doubt, in flight or held), relayed anyway and accepted


class Result(enum.StrEnum):
    """What the client was told for one message: the ``result`` label of
    ``relay_messages_total`` (the strings are kept: dashboards and alert rules use them)."""

    RELAYED = "relayed"  # 250, at least one recipient relayed
    SUPPRESSED = "suppressed"  # 250 (or 550 5.7.1 with duplicate_reply = "550"), every
    # recipient a duplicate (or in doubt, suppressed)
    EXEMPT = "exempt"  # 250, relayed without dedup: its template's policy says dedup = false
    NO_KEY = "no_key"  # 250, relayed without dedup: the message has no dedupe key
    STORE_DOWN = "store_down"  # 250, relayed without dedup: store down, store_down = fail_open
    TEMPFAIL = "tempfail"  # 4yz
    PERMFAIL = "permfail"  # 5yz from the upstream for every recipient
    INVALID = "invalid"  # the relay refused the input (key, address, size, line, ...)


class DsnResult(enum.StrEnum):
    """The ``result`` label of ``relay_dsn_total``: whether an RFC 3464 notice went out."""

    SENT = "sent"
    FAILED = "failed"


class Metrics(Protocol):
    """What the core and the adapters report; implemented with prometheus-client."""

    def message(self, result: Result) -> None:
        """Count one message by its ``result``."""
        ...

    def recipients(self, outcome: Outcome, count: int = 1) -> None:
        """Count ``count`` recipients by ``outcome``."""
        ...

    def store_call(self, op: str, seconds: float, ok: bool) -> None:
        """Record one store operation's latency in seconds, and an error when not ``ok``."""
        ...

    def upstream_call(self, seconds: float, code: int | None, upstream: str = "") -> None:
        """Record one upstream transaction's latency and its deciding reply code (None: none);
        ``upstream`` is the configured name of the upstream that decided it ("": unnamed)."""
        ...

    def message_bytes(self, size: int) -> None:
        """Record one received message's size in bytes."""
        ...

    def mark_sent_failed(self, count: int = 1) -> None:
        """Count an upstream-accepted message whose SENT mark had not landed by the lease end."""
        ...

    def unknown_resent(self, count: int = 1) -> None:
        """Count recipients sent again while an earlier attempt is in doubt (possible copies)."""
        ...

    def session(self, delta: int) -> None:
        """Add ``delta`` (+1 or -1) to the number of open client sessions."""
        ...

    def in_progress(self, delta: int) -> None:
        """Add ``delta`` (+1 or -1) to the number of messages between final dot and reply."""
        ...

    def component_up(self, component: str, up: bool) -> None:
        """Record the last readiness probe of ``component`` (``store`` or ``upstream``)."""
        ...

    def dsn(self, result: DsnResult) -> None:
        """Count one delivery status notification by ``result`` (``sent`` or ``failed``)."""
        ...

    def rate_limited(self, label: str) -> None:
        """Count one message refused by the rate limit ``label`` (a configured limit's)."""
        ...

    def tls_handshake_failed(self, listener: str) -> None:
        """Count one failed client TLS handshake on ``listener`` (``starttls``, ``implicit``)."""
        ...

    def key_rule_miss(self, rule: str) -> None:
        """Count one message the key rule ``rule`` matched but derived no key for (relayed
        without dedup; a configured rule's name, so the label set stays bounded)."""
        ...

    def key_reused(self, template: str, count: int = 1) -> None:
        """Count ``count`` recipients of a message of ``template`` (its normalized template
        value, ``""`` for none) whose key held a record of other content (design.md §4.9)."""
        ...
