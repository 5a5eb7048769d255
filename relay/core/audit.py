"""The audit ledger's rows of one message (design.md §6.7), as pure functions.

:func:`entries_for` turns what the core decided for a message into one
:class:`relay.core.interfaces.LedgerEntry` per envelope recipient, with the smarthost's queue id
(:func:`relay.core.queue_id.upstream_queue_id`) so that an operator can find an in-doubt or
disputed message in the smarthost's log. No I/O: the ledger adapter
(:mod:`relay.store.postgres.ledger`) masks, hashes and writes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

from relay.core.interfaces import LedgerEntry, Outcome, RcptResult, SmtpReply
from relay.core.queue_id import upstream_queue_id

__all__ = ["entries_for"]

def entries_for(*, now: float, rcpt_tos: Sequence[str], outcomes: Mapping[str, Outcome],
                keys: Mapping[str, str], template: str, dedupe_key: str | None,
                rcpt_results: Mapping[str, RcptResult], final_reply: SmtpReply | None,
                client_reply: SmtpReply, upstream: str, message_id: str,
                queue_id: str, key_source: str = "", reused: Set[str] = frozenset(),
                received_at: float | None = None,
                sending_at: float | None = None) -> list[LedgerEntry]:
    """One row per distinct recipient of a message the core decided on.

    ``now`` is the relay's clock (unix seconds); ``outcomes`` recipient -> outcome;
    ``keys`` recipient -> store key (empty: no fingerprint); ``rcpt_results`` the upstream
    transaction's result of each recipient in it (its reply, when the upstream sent one, is the
    row's: a refusal at RCPT, or the reply to the final dot, whose queue id goes into the row
    of a recipient it accepted: a recipient of a further transaction, past the smarthost's
    recipient limit, has its own); ``final_reply`` the first transaction's reply to the final
    dot, the queue id of an accepted recipient whose reply names none; ``upstream`` the
    name of the upstream of the transaction, named in the rows of the recipients in it (an
    in-doubt recipient has no reply, and its row must still say where the final dot went).
    A recipient without an outcome (the message was refused before a decision per recipient)
    gets none: the caller passes one for every recipient. ``key_source``: where the key came
    from (``header``, ``rule:NAME``; ``""``: none); ``reused``: the recipients whose key held
    a record of other content (their rows say ``key_reused``, design.md §4.9). ``received_at``
    (when the message came in) and ``sending_at`` (when its records were marked SENDING before
    the final dot; None: not sent with a reservation) go into every row, the second only into
    the rows of recipients in the upstream transaction.
    """
    queue = upstream_queue_id(final_reply)
    out: list[LedgerEntry] = []
    for rcpt in dict.fromkeys(rcpt_tos):
        outcome = outcomes.get(rcpt)
        if outcome is None:
            continue
        result = rcpt_results.get(rcpt)
        reply = result.reply if result is not None and result.from_upstream else None
        accepted = reply is not None and 200 <= reply.code < 300
        out.append(LedgerEntry(
            decided_at=now, outcome=outcome.value, recipient=rcpt, store_key=keys.get(rcpt),
            template=template, dedupe_key=dedupe_key,
            reply=str(reply) if reply is not None else "",
            upstream_queue_id=(upstream_queue_id(reply) or queue) if accepted else "",
            upstream=upstream if result is not None else "",
            message_id=message_id,
            queue_id=queue_id, client_reply=str(client_reply), key_source=key_source,
            key_reused=rcpt in reused, received_at=received_at,
            sending_at=sending_at if result is not None else None))
    return out
