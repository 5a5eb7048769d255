"""Reserving while a previous fingerprint secret's records still count (design.md §2.3,
``fingerprint_secret_previous``).

After ``fingerprint_secret`` changes, every recipient's store key changes with it: the records
an earlier attempt wrote are under the keys of the previous secret. While that secret is set,
each reserve also reads the recipient's key under it, in the same moment (the reserve and one
:meth:`relay.core.interfaces.FingerprintStore.inspect_many` call, side by side), and the record
found there counts exactly as one under the current key (:func:`relay.core.rules.through_previous`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from relay.core.interfaces import FingerprintStore, Reservation
from relay.core.rules import through_previous

log = logging.getLogger("relay.core.rotation")


@dataclass(frozen=True)
class Claim:
    """What a reserve writes and may replace: its ``token``, its lease (seconds), the
    message's stored ``content_digest`` and which records it takes over."""

    token: str
    lease_s: float
    content_digest: str = ""
    resend_unknown: bool = False
    replace_other_content: bool = False


async def reserve(store: FingerprintStore, keys: Sequence[str], claim: Claim,
                  previous: Mapping[str, str]) -> tuple[list[Reservation], list[str]]:
    """Reserve ``keys`` for ``claim``; with ``previous`` (a current key -> its key under the
    previous secret) read those keys side by side with the reserve, and let their records
    count. Returns one :class:`Reservation` per key, in order (``under`` naming a previous
    key whose record was found), and the keys this attempt reserved that it must release
    (their previous key's record answers for them). Both calls run to their end; the first
    failure is raised then (:class:`relay.core.errors.StoreError`), and whatever of the
    reserve landed is the caller's to release."""
    reserving = store.reserve(keys, token=claim.token, lease_s=claim.lease_s,
                              resend_unknown=claim.resend_unknown,
                              content_digest=claim.content_digest,
                              replace_other_content=claim.replace_other_content)
    asked = [key for key in keys if key in previous]
    if not asked:
        return await reserving, []
    done = await asyncio.gather(reserving, store.inspect_many([previous[k] for k in asked]),
                                return_exceptions=True)
    for outcome in done:
        if isinstance(outcome, BaseException):
            raise outcome
    reservations, records = done
    assert isinstance(reservations, list) and isinstance(records, list)
    found = dict(zip(asked, records, strict=True))
    out: list[Reservation] = []
    release: list[str] = []
    for reservation in reservations:
        record = found.get(reservation.key)
        if record is None:
            out.append(reservation)
            continue
        counted, released = through_previous(
            reservation, record, previous[reservation.key], lease_s=claim.lease_s,
            content_digest=claim.content_digest, resend_unknown=claim.resend_unknown,
            replace_other_content=claim.replace_other_content)
        out.append(counted)
        if counted.under is not None:
            log.info("the record under the previous fingerprint secret's key counts (%s)",
                     record.state.value, extra={"key": reservation.key,
                                                "previous_key": counted.under})
        if released:
            release.append(reservation.key)
    return out, release
