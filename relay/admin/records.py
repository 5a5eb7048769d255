"""One fingerprint's record for an operator (design.md §6.5): compute its key, describe what
the store holds, release it or mark it sent (audit-logged), and the ledger row of such an
action.

They use the same settings as the relay (store URL, key prefix, fingerprint secret, local-part
case rule, scope), so the key they compute is the key the relay would use. A release or
mark-sent is written to the ``relay.audit`` log (one JSON line with ``--log-format json``):
when, who, why, which key and what it held, so an operator's decision about an in-doubt message
can be traced later. Both refuse a record that is in flight (PENDING, or SENDING within the
lease) unless forced: deleting it would let the retry go out while the first copy is still
being delivered. Both act only on the record the operator's read found (compare-and-delete,
compare-and-set in the store): when a retry or another operator changed it in between,
nothing is done and the refusal reads :func:`changed_meanwhile`. The command line and the
console call them through :func:`relay.admin.decisions.decide` (the ledger first, then the
store, then the row).
"""

from __future__ import annotations

import getpass
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from relay.core.address import mailbox_problem
from relay.core.errors import InvalidAddressError
from relay.core.interfaces import (
    FingerprintStore,
    LedgerAction,
    LedgerEntry,
    Record,
    State,
)
from relay.core.keys import KeyRules, RecipientKey, header_values, recipient_key
from relay.core.rules import reads_as
from relay.settings import Settings, redact_url

audit = logging.getLogger("relay.audit")

OPERATOR = "an operator"
RECONCILER = "the reconciler"
"""Who released or marked a record sent (the audit line, the store's reply, the row)."""
_EVENTS = {OPERATOR: ("admin_release", "admin_mark_sent"),
           RECONCILER: ("reconciled_released", "reconciled_sent")}


@dataclass(frozen=True)
class FingerprintInput:
    """One recipient's fingerprint inputs as given on the command line.

    ``templates`` and ``keys`` are header values as an application would write them (several
    occurrences allowed; RFC 2047 words are decoded, blanks collapsed, as the relay does).
    """

    rcpt: str
    templates: Sequence[str]
    keys: Sequence[str]
    auth_user: str | None = None  # the sender's AUTH identity, with scope_by_auth


def key_for(settings: Settings, given: FingerprintInput) -> tuple[str, str]:
    """(fingerprint hex, store key) the relay would use for ``given`` under ``settings``
    (:func:`recipient_key_for` has the previous secret's key too).

    Raises :class:`relay.core.errors.InvalidAddressError` for a recipient the relay refuses,
    :class:`relay.core.errors.InvalidDedupKeyError` for a key or template it refuses, and
    ``ValueError`` when no key is given (a message without one is never deduplicated) or
    when ``auth_user`` is given but ``scope_by_auth`` is off (it would change nothing).
    """
    derived = recipient_key_for(settings, given)
    return derived.fingerprint, derived.key


def recipient_key_for(settings: Settings, given: FingerprintInput) -> RecipientKey:
    """The recipient's fingerprint and store key the relay would use for ``given`` under
    ``settings``, with its store key under ``fingerprint_secret_previous`` when that is set
    (``previous``, design.md §2.3). Raises as :func:`key_for` does (and ConfigError for a
    secret's file that cannot be read)."""
    if given.auth_user and not settings.scope_by_auth:
        raise ValueError("scope_by_auth is off: the AUTH identity is not part of fingerprints")
    headers = header_values(given.keys, given.templates, max_chars=settings.max_key_chars)
    if headers.key is None:
        raise ValueError("a dedupe key is needed: a message without one is not deduplicated")
    rules = KeyRules(key_prefix=settings.store_prefix, secret=settings.fingerprint_secret_bytes,
                     previous_secret=settings.fingerprint_secret_previous_bytes,
                     local_part_case_sensitive=settings.local_part_case_sensitive,
                     scope_by_auth=settings.scope_by_auth,
                     key_format=settings.store_key_format)
    derived = recipient_key(given.rcpt, headers.template, headers.key, rules, given.auth_user)
    problem = mailbox_problem(derived.mailbox, postmaster_alone=True)  # source route dropped
    if problem is not None:  # the relay refuses such a RCPT: it has no fingerprint
        raise InvalidAddressError(f"recipient is not a mailbox ({problem})")
    return derived


async def located(store: FingerprintStore, keys: Sequence[str]) -> tuple[str, Record]:
    """The first of ``keys`` (a fingerprint's store key, then its key under the previous
    secret, design.md §2.3) that holds a record, with the record, in one round trip; the
    first key and ABSENT when none does. Raises :class:`relay.core.errors.StoreError`."""
    if len(keys) == 1:
        return keys[0], await store.inspect(keys[0])
    records = await store.inspect_many(keys)
    return next(((key, record) for key, record in zip(keys, records, strict=True)
                 if record.state is not State.ABSENT), (keys[0], records[0]))


def store_label(settings: Settings) -> str:
    """Which store the admin commands read, for the operator: the URL (passwords masked, a
    relative SQLite path made absolute), its kind, the key prefix and the key format, e.g.
    ``sqlite:////srv/relay/data/dedup-relay.db (embedded sqlite), prefix email:fp:, hex keys``.
    A relay on Redis answers nothing about keys in the quick start's SQLite file, nor a relay
    with compact keys about hex ones: this line tells them apart."""
    return (f"{redact_url(settings.store)} ({settings.store_kind}), "
            f"prefix {settings.store_prefix}, {settings.store_key_format} keys")


class InFlightError(Exception):
    """The record belongs to an attempt that may still be delivering (refused unless forced)."""


class NotInDoubtError(InFlightError):
    """The record is not the one the operator decided on: it no longer reads as in doubt
    (another operator or a retry settled it meanwhile), so nothing was done."""


def changed_meanwhile(done: str) -> str:
    """The refusal of an action (``done``: ``released`` or ``marked sent``) whose record
    changed between the read and the store's compare (a retry took the key over, another
    operator acted): one wording for the console and the command line."""
    return f"the record changed while it was being {done}; nothing was done. Look again."


def describe(key: str, record: Record, lease_s: float) -> dict[str, object]:
    """A record as plain data for printing: state, what a retry would read it as
    (``reads_as``), times as ISO 8601 UTC, TTL in seconds.

    The attempt token of PENDING/SENDING is left out (it is a capability to settle the key).
    """
    return {
        "key": key,
        "state": record.state.value,
        "reads_as": reads_as(record, lease_s).value,
        "at": iso_utc(record.at),
        "reply": record.reply,
        "ttl_s": None if record.ttl_s is None else round(record.ttl_s, 3),
    }


async def release(store: FingerprintStore, key: str, *, reason: str, lease_s: float,
                  force: bool = False, operator: str | None = None,
                  role: str | None = None,
                  only_if: Callable[[Record], bool] | None = None,
                  by: str = OPERATOR) -> tuple[Record, bool]:
    """Delete ``key``, but only while it still holds what was inspected (compare-and-delete: an
    attempt that took the key over in between is never wiped); return (what it held, whether
    something was deleted).

    Raises :class:`InFlightError` (nothing done) when the record is in flight and not
    ``force``, and :class:`NotInDoubtError` (nothing done) when ``only_if`` (a console's "still
    in doubt") is false for the record read. Writes one ``relay.audit`` line (WARNING) with
    the operator (default: the OS user) and the console ``role`` when given, the reason and
    the record released (``by``: :data:`RECONCILER` for the reconciler's, its event
    ``reconciled_released``). Raises :class:`relay.core.errors.StoreError`.
    """
    before = await _not_in_flight(store, key, lease_s, force, only_if)
    deleted = await store.force_release(key, expected=before)
    _audit(f"fingerprint released by {by}", _EVENTS[by][0], key, before, lease_s,
           reason, operator, role, released=deleted)
    return before, deleted


async def mark_sent(store: FingerprintStore, key: str, *, reason: str, lease_s: float,
                    window_s: float, force: bool = False, operator: str | None = None,
                    role: str | None = None, keep_expiry: bool = False,
                    only_if: Callable[[Record], bool] | None = None,
                    by: str = OPERATOR) -> tuple[Record, bool]:
    """Set ``key`` to SENT for the dedup window (``window_s`` seconds from now), but only
    while it still holds what was inspected (compare-and-set: a retry that took the key over
    in between keeps its record): the operator found the message delivered, so its retries
    are duplicates. Returns (what it held, whether it was marked).

    ``keep_expiry``: the key was given as a store key, so the template and its window are not
    known; a SENDING, SENT or UNKNOWN record (written with its message's window, counted from
    about the send) then keeps its own expiry when that is later than ``window_s`` from now: a
    template's longer window is never cut short.

    Raises :class:`InFlightError` and :class:`NotInDoubtError` as :func:`release`, and
    :class:`relay.core.errors.StoreError`. The ``relay.audit`` line says whether it was
    marked (``marked_sent``); ``by`` as :func:`release`'s (event ``reconciled_sent``).
    """
    before = await _not_in_flight(store, key, lease_s, force, only_if)
    if keep_expiry and before.ttl_s is not None and before.state in (
            State.SENDING, State.SENT, State.UNKNOWN):
        window_s = max(window_s, before.ttl_s)
    marked = await store.force_mark_sent(key, reply=f"marked sent by {by}: {reason}",
                                         window_s=window_s, expected=before)
    _audit(f"fingerprint marked sent by {by}" if marked else
           "mark-sent refused: " + changed_meanwhile("marked sent"), _EVENTS[by][1], key,
           before, lease_s, reason, operator, role, marked_sent=marked)
    return before, marked


async def _not_in_flight(store: FingerprintStore, key: str, lease_s: float,
                         force: bool, only_if: Callable[[Record], bool] | None = None
                         ) -> Record:
    before = await store.inspect(key)
    if only_if is not None and not only_if(before):
        raise NotInDoubtError(
            f"{key} is {reads_as(before, lease_s).value} now, no longer in doubt: it was "
            "settled meanwhile (by another operator, or a retry); nothing was done")
    if not force and reads_as(before, lease_s) is State.PENDING:
        raise InFlightError(
            f"{key} is {before.state.value}: an attempt may still be delivering it; wait for "
            "its lease to end, or force")
    return before


def _audit(message: str, event: str, key: str, before: Record, lease_s: float, reason: str,
           operator: str | None, role: str | None, **fields: object) -> None:
    audit.warning(message, extra={
        "event": event, "operator": operator or os_user(), "reason": reason,
        **({} if role is None else {"role": role}),
        **fields, "previous": describe(key, before, lease_s),
    })


_OUTCOMES = {LedgerAction.RELEASE: "released", LedgerAction.MARK_SENT: "marked_sent",
             LedgerAction.RECONCILED_SENT: "reconciled_sent",
             LedgerAction.RECONCILED_RELEASED: "reconciled_released",
             LedgerAction.RECONCILE_GIVEN_UP: "reconcile_given_up"}


class OperatorRow:
    """The ledger row of a release / mark-sent (design.md §6.7), an operator's or the
    reconciler's: the store key, the recipient when the operator gave it (else ""), the
    template and key as the relay normalizes them, the in-doubt message's ``message_id`` and
    ``upstream`` when known (the reconciler's); its time is taken when :meth:`entry` is called
    (after the action)."""

    def __init__(self, settings: Settings, action: LedgerAction, key: str, *,
                 rcpt: str | None = None, templates: Sequence[str] = (),
                 keys: Sequence[str] = (), message_id: str = "", upstream: str = "") -> None:
        headers = header_values(keys, templates, max_chars=settings.max_key_chars)
        self._by = RECONCILER if action in (LedgerAction.RECONCILED_SENT,
                                            LedgerAction.RECONCILED_RELEASED) else OPERATOR
        self._fields: dict[str, Any] = {
            "outcome": _OUTCOMES[action], "action": action, "recipient": rcpt or "",
            "store_key": key, "template": headers.template, "dedupe_key": headers.key,
            "message_id": message_id, "upstream": upstream}

    def entry(self, reply: str) -> LedgerEntry:
        """The row with ``reply``, decided now."""
        return LedgerEntry(decided_at=time.time(), reply=reply, **self._fields)

    def released(self, before: Record, deleted: bool, *, who: str, reason: str
                 ) -> LedgerEntry | None:
        """The row of a release by ``who``: written when it deleted the record, and when
        there was none (the decision settles an in-doubt row whose record already left the
        store: its window passed), else None (the record changed under the compare-and-delete:
        it may still be in doubt, nothing was settled)."""
        if deleted:
            return self.entry(f"released by {who}: {reason}")
        if before.state is State.ABSENT:
            return self.entry(f"nothing to release (no record: its window passed, or released "
                              f"before); settled by {who}: {reason}")
        return None

    def marked_sent(self, *, who: str, reason: str) -> LedgerEntry:
        """The row of a mark-sent by ``who`` (its reply: what the record now holds)."""
        return self.entry(f"marked sent by {self._by}: {reason} ({who})")


def os_user() -> str:
    """The OS user running the command (``unknown`` when the uid has no name)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for the uid (containers)
        return "unknown"


def iso_utc(at: float | None) -> str | None:
    """``at`` (Unix seconds) as ISO 8601 UTC to the microsecond, None for None."""
    if at is None:
        return None
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
