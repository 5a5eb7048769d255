"""How the console writes a time: one format on every page (:func:`when`), UTC to the second
with its age in words, the exact instant in the element's ``datetime`` and ``title`` (shown on
hover, kept on copy)."""

from __future__ import annotations

from datetime import UTC, datetime

from markupsafe import Markup, escape

_UNITS = ((86400, "day"), (3600, "hour"), (60, "minute"), (1, "second"))


def age_words(seconds: float) -> str:
    """``seconds`` back from now in words: ``just now`` (under 5 s), ``45 seconds ago``,
    ``1 minute ago``, ``3 hours ago``, ``2 days ago`` (the largest whole unit); a time ahead
    of now (another clock) reads ``in 2 minutes``."""
    ahead = seconds < 0
    left = abs(seconds)
    if left < 5:
        return "just now"
    for size, unit in _UNITS:
        if left >= size:
            count = int(left // size)
            words = f"{count} {unit}{'' if count == 1 else 's'}"
            return f"in {words}" if ahead else f"{words} ago"
    return "just now"  # unreachable: left >= 5 matched a unit


def utc_text(at: datetime) -> str:
    """``at`` as ``2026-12-05 14:30:00 UTC``."""
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso_exact(at: datetime) -> str:
    """``at`` as ISO 8601 UTC to the microsecond: ``2026-12-05T14:30:00.123456Z``."""
    return at.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def when(at: datetime | None, now: datetime | None = None) -> Markup:
    """``at`` as the console shows every time: ``<time>2026-12-05 14:30:00 UTC</time>
    <span class="age">(3 hours ago)</span>``, the exact instant in ``datetime`` and ``title``
    (the day and the clock in spans of their own: a narrow column breaks between them, never
    inside one); ``-`` for None. ``now`` (default: the clock) dates the age."""
    if at is None:
        return Markup("-")
    now = now or datetime.now(tz=UTC)
    exact = iso_exact(at)
    day, clock = utc_text(at).split(" ", 1)
    return Markup('<time datetime="{0}" title="{0}"><span>{1}</span> <span>{2}</span></time> '
                  '<span class="age">({3})</span>').format(
        exact, day, clock, escape(age_words((now - at).total_seconds())))
