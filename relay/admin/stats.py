"""The store's records by state for an operator (``dedup-relay stats``, the console's stats
page): :func:`count_states`, and the count as JSON (:func:`stats_report`) or as a table for a
person (:func:`stats_table`)."""

from __future__ import annotations

from collections.abc import Callable

from relay.admin.records import iso_utc
from relay.core.interfaces import FingerprintStore, State, StateCounter, StateCounts
from relay.settings import Settings, redact_url


async def count_states(store: FingerprintStore, settings: Settings, *, older_than_h: float,
                       max_keys: int | None,
                       progress: Callable[[int], None] | None = None) -> StateCounts:
    """Count the records under the relay's ``store_prefix`` by state
    (:meth:`relay.core.interfaces.StateCounter.count_states`): SENDING is judged by the
    relay's ``lease`` when a record names no lease of its own; ``older_than_h`` hours is the
    age from which an in-doubt record counts in ``in_doubt_older``; ``max_keys`` caps a Redis
    scan. Raises :class:`relay.core.errors.StoreError`, and ``TypeError`` for a store that
    cannot count."""
    if not isinstance(store, StateCounter):
        raise TypeError(f"{type(store).__name__} cannot count its records")
    return await store.count_states(settings.store_prefix, lease_s=settings.lease,
                                    older_than_s=older_than_h * 3600, max_keys=max_keys,
                                    progress=progress)


def stats_report(settings: Settings, counts: StateCounts, older_than_h: float
                 ) -> dict[str, object]:
    """``counts`` as the JSON object ``dedup-relay stats --json`` prints: ``store`` (the URL,
    passwords masked), ``prefix``, ``scanned`` and ``complete``, ``states`` (always the four
    keys ``pending``, ``sending``, ``sent``, ``unknown``: records as stored), ``foreign`` (of
    ``sent``: values the relay did not write, read as SENT), ``sending_past_lease`` (of
    ``sending``: in doubt), ``in_doubt`` (``unknown`` + ``sending_past_lease``),
    ``oldest_in_doubt`` (ISO 8601 UTC or null) and its ``oldest_in_doubt_age_s`` (seconds),
    ``in_doubt_older_than`` (``{"hours": N, "count": M}``)."""
    age = counts.oldest_in_doubt_age_s
    return {
        "store": redact_url(settings.store),
        "prefix": settings.store_prefix,
        "scanned": counts.scanned,
        "complete": counts.complete,
        "states": {State.PENDING.value: counts.pending, State.SENDING.value: counts.sending,
                   State.SENT.value: counts.sent, State.UNKNOWN.value: counts.unknown},
        "foreign": counts.foreign,
        "sending_past_lease": counts.sending_past_lease,
        "in_doubt": counts.in_doubt,
        "oldest_in_doubt": iso_utc(counts.oldest_in_doubt_at),
        "oldest_in_doubt_age_s": None if age is None else round(age, 3),
        "in_doubt_older_than": {"hours": _number(older_than_h),
                                "count": counts.in_doubt_older},
    }


def stats_table(counts: StateCounts, older_than_h: float) -> str:
    """``counts`` for a person: one line per figure (the same as :func:`stats_report`'s)."""
    age = counts.oldest_in_doubt_age_s
    oldest = iso_utc(counts.oldest_in_doubt_at)
    rows = [
        ("pending", str(counts.pending)),
        ("sending", f"{counts.sending} ({counts.sending_past_lease} past its lease: in doubt)"),
        ("sent", f"{counts.sent} ({counts.foreign} foreign: not written by the relay)"),
        ("unknown", str(counts.unknown)),
        ("in doubt", f"{counts.in_doubt} (unknown + sending past its lease)"),
        ("oldest in doubt", "-" if oldest is None or age is None
         else f"{oldest} ({age:.0f} s ago)"),
        (f"in doubt >= {_number(older_than_h)} h", str(counts.in_doubt_older)),
        ("keys scanned", str(counts.scanned)
         + ("" if counts.complete else " (stopped at --max-keys: the counts are partial)")),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _number(value: float) -> float | int:
    return int(value) if value == int(value) else value
