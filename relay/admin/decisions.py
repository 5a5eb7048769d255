"""An operator's release or mark-sent, audited: :func:`decide`, the one path of
``dedup-relay release | mark-sent`` and of the console's in-doubt page (design.md §6.5, §6.7).

The order is the rule: the audit ledger first (it must answer, its schema current, before the
store is touched: an operator's action is never left unrecorded for a ledger that was down;
else :class:`LedgerRefused`, nothing done), then the store (the compare-and-delete or
compare-and-set of :func:`relay.admin.records.release` / :func:`~relay.admin.records.mark_sent`,
with its ``relay.audit`` line), then the ledger row (:class:`relay.admin.records.OperatorRow`).
A row that fails to land after the store acted is reported in the :class:`Outcome`
(``unrecorded``), not raised: the action was done.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from relay.admin.lookup import Selection
from relay.admin.records import (
    OPERATOR,
    RECONCILER,
    OperatorRow,
    located,
    mark_sent,
    release,
)
from relay.core.errors import StoreError
from relay.core.interfaces import FingerprintStore, LedgerAction, LedgerEntry, Record, State
from relay.core.rules import reads_as
from relay.settings import Settings

if TYPE_CHECKING:  # the postgres extra: imported once a ledger is configured
    from relay.store.postgres.ledger import LedgerOptions


class AuditLedger(Protocol):
    """What an audited action needs of the ledger
    (:class:`relay.store.postgres.ledger_read.LedgerReader` is one)."""

    async def unresolved(self, store_key: str) -> bool:
        """Whether the ledger lists ``store_key`` in doubt, not resolved since."""

    async def write(self, entries: Sequence[LedgerEntry], options: LedgerOptions) -> None:
        """Write ``entries``; raises :class:`relay.core.errors.StoreError`."""


class LedgerRefused(Exception):
    """The audit ledger did not answer (or its schema is missing or old) before the store was
    touched: nothing was done."""


@dataclass(frozen=True)
class Decision:
    """One operator's release or mark-sent of the store key ``key``, with a ``reason``.

    ``who`` is named in the ledger row's reply; ``operator`` in the ``relay.audit`` line (None:
    the OS user) with the console ``role`` when given. ``force`` acts on a record in flight.
    Mark-sent only: ``window_s`` (None: ``dedup_window``) and ``keep_expiry`` (as
    :func:`relay.admin.records.mark_sent`). ``in_doubt_only``: act only on a record still in
    doubt (read as unknown in the store, or gone from it and listed unresolved in the
    ledger), else :class:`relay.admin.records.NotInDoubtError`. ``given``: the recipient,
    template and key the operator gave, for the row (a store key alone leaves them empty).
    ``previous_key``: the same fingerprint's key under the previous fingerprint secret
    (design.md §2.3): the action is on it when it holds a record and ``key`` holds none.
    ``action`` may be the reconciler's (``RECONCILED_SENT``, ``RECONCILED_RELEASED``: a
    mark-sent, a release on a smarthost's record, ``reason`` its evidence), whose row holds
    the in-doubt message's ``message_id`` and ``upstream``.
    """

    action: LedgerAction
    key: str
    reason: str
    who: str
    operator: str | None = None
    role: str | None = None
    force: bool = False
    window_s: float | None = None
    keep_expiry: bool = False
    in_doubt_only: bool = False
    given: Selection = field(default_factory=Selection)
    previous_key: str | None = None
    message_id: str = ""
    upstream: str = ""

    @property
    def releases(self) -> bool:
        """Whether it deletes the record (a release, the operator's or the reconciler's);
        else it marks it sent."""
        return self.action in (LedgerAction.RELEASE, LedgerAction.RECONCILED_RELEASED)

    @property
    def by(self) -> str:
        """Who decided, for the audit line and the store's reply."""
        return RECONCILER if self.action in (LedgerAction.RECONCILED_SENT,
                                             LedgerAction.RECONCILED_RELEASED) else OPERATOR


@dataclass(frozen=True)
class Outcome:
    """What :func:`decide` did: the record ``before`` it, whether it was ``done`` (deleted,
    marked), whether nothing was done because the record ``changed`` under the compare (a
    retry took the key over, another operator acted: :func:`relay.admin.records.changed_meanwhile`),
    the ledger row it called for (``entry``, None: none) and the error of that row's write
    (``unrecorded``, None: written, or no ledger); ``key``: the store key acted on (the
    decision's, or its ``previous_key``)."""

    before: Record
    done: bool
    changed: bool
    entry: LedgerEntry | None
    unrecorded: StoreError | None = None
    key: str = ""


async def decide(settings: Settings, decision: Decision, *,
                 store: AbstractAsyncContextManager[FingerprintStore],
                 ledger: AbstractAsyncContextManager[AuditLedger] | None,
                 instance: str) -> Outcome:
    """Do ``decision``: enter ``ledger`` (None: no ledger is configured; an opener that fails
    raises its own error, or :class:`LedgerRefused`), then ``store``, act, leave the store,
    then write the row as ``instance`` (``HOST/cli``, ``HOST/console``).

    Raises :class:`LedgerRefused` when the ledger fails before the store is touched,
    :class:`relay.admin.records.InFlightError` (nothing done: the record is in flight, or no
    longer in doubt) and :class:`relay.core.errors.StoreError` from the store.
    """
    async with contextlib.AsyncExitStack() as stack:
        reader = None if ledger is None else await stack.enter_async_context(ledger)
        listed = False
        if reader is not None and decision.in_doubt_only:
            try:
                listed = await reader.unresolved(decision.key)
            except StoreError as exc:
                raise LedgerRefused(str(exc)) from exc
        async with store as opened:
            if decision.previous_key is not None:
                key, _ = await located(opened, (decision.key, decision.previous_key))
                decision = dataclasses.replace(decision, key=key, previous_key=None)
            before, done = await _on_store(settings, opened, decision, listed)
        entry = _row(settings, decision, before, done)
        changed = not done and (not decision.releases or before.state is not State.ABSENT)
        if entry is None or reader is None:
            return Outcome(before, done, changed, entry, key=decision.key)
        options = settings.ledger_options(
            instance=instance, secret=settings.fingerprint_secret_bytes,
            local_part_case_sensitive=settings.local_part_case_sensitive)
        try:
            await reader.write([entry], options)
        except StoreError as exc:
            return Outcome(before, done, changed, entry, unrecorded=exc, key=decision.key)
        return Outcome(before, done, changed, entry, key=decision.key)


async def _on_store(settings: Settings, store: FingerprintStore, decision: Decision,
                    listed: bool) -> tuple[Record, bool]:
    """The store's half: (the record read, whether it was deleted or marked)."""
    only_if: Callable[[Record], bool] | None = None
    if decision.in_doubt_only:
        def only_if(record: Record) -> bool:
            return reads_as(record, settings.lease) is State.UNKNOWN or (
                listed and record.state is State.ABSENT)

    if decision.releases:
        return await release(store, decision.key, reason=decision.reason,
                             lease_s=settings.lease, force=decision.force,
                             operator=decision.operator, role=decision.role, only_if=only_if,
                             by=decision.by)
    window_s = settings.dedup_window if decision.window_s is None else decision.window_s
    return await mark_sent(store, decision.key, reason=decision.reason, lease_s=settings.lease,
                           window_s=window_s, force=decision.force,
                           operator=decision.operator, role=decision.role,
                           keep_expiry=decision.keep_expiry, only_if=only_if, by=decision.by)


def _row(settings: Settings, decision: Decision, before: Record, done: bool
         ) -> LedgerEntry | None:
    """The ledger row the action calls for (None: none, it did nothing to record)."""
    given = decision.given
    row = OperatorRow(settings, decision.action, decision.key, rcpt=given.rcpt,
                      templates=given.templates, keys=given.keys,
                      message_id=decision.message_id, upstream=decision.upstream)
    if decision.releases:
        return row.released(before, done, who=decision.who, reason=decision.reason)
    return row.marked_sent(who=decision.who, reason=decision.reason) if done else None


@contextlib.asynccontextmanager
async def open_ledger(settings: Settings) -> AsyncIterator[AuditLedger]:
    """A connection to the configured ledger (``settings.ledger``) for one action, closed
    after it. Raises :class:`LedgerRefused` when it does not answer within
    ``ledger_timeout`` or its schema is missing or old."""
    from relay.store.postgres.ledger_read import LedgerReader  # the postgres extra
    from relay.store.postgres.migrations import SchemaError

    assert settings.ledger is not None
    try:
        reader = await LedgerReader.open(settings.ledger, timeout_s=settings.ledger_timeout)
    except (StoreError, SchemaError) as exc:
        raise LedgerRefused(str(exc)) from exc
    async with reader:
        yield reader
