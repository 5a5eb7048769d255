"""What support looks a message up by (design.md §6.7, §6.9): :func:`ledger_query`, the one
rule of the console's ``/history?rcpt=|message_id=|queue_id=|template=|since=|until=`` and of
``dedup-relay history --rcpt | --message-id | --queue-id | --since | --until``.

A :class:`Lookup` holds what a person typed; :func:`ledger_query` makes it the ledger's
:class:`relay.store.postgres.ledger_query.LedgerQuery` under the relay's settings: the
recipient normalized as the relay's fingerprints are and digested with its secret, and
during a rotation with the previous one too (the ledger keeps recipients masked: its
``recipient_digest`` column finds them), a Message-ID
with and without its angle brackets, a template as the relay normalizes ``X-Template``, and
the period (:data:`DEFAULT_DAYS` back when a recipient, a template or nothing else narrows
it). A refusal is a :class:`LookupRefused` naming its :class:`LookupProblem`, which each surface
words in its own terms.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from relay.core.errors import InvalidDedupKeyError
from relay.core.fingerprint import recipient_digest
from relay.core.keys import header_values
from relay.settings import Settings
from relay.store.postgres.ledger_query import LedgerQuery

DEFAULT_DAYS = 7
"""How far back a lookup by recipient, by template or by period alone reaches when no
``since`` is given (days); a Message-ID or a queue id names one message and reaches as far
as the ledger keeps rows."""


class LookupProblem(enum.Enum):
    """Why a lookup asks nothing the ledger can answer."""

    EMPTY = "empty"  # nothing given
    RECIPIENT = "recipient"  # a recipient the relay would refuse (it has no rows)
    TEMPLATE = "template"  # a template the relay would refuse
    TIME = "time"  # a since / until that is no time
    PERIOD = "period"  # until not after since


class LookupRefused(ValueError):
    """A lookup refused: ``problem``, ``field`` (the input it is about) and a sentence."""

    def __init__(self, problem: LookupProblem, field: str, message: str) -> None:
        super().__init__(message)
        self.problem = problem
        self.field = field


@dataclass(frozen=True)
class Lookup:
    """What a person typed (None or empty: not given): a recipient ``rcpt``, a Message-ID,
    the relay's or the smarthost's ``queue_id``, a ``template``, and the period's ``since`` /
    ``until`` as ISO 8601 texts (``2026-12-05``, ``2026-12-05T14:30``, a full time; UTC unless
    it names an offset)."""

    rcpt: str | None = None
    message_id: str | None = None
    queue_id: str | None = None
    template: str | None = None
    since: str | None = None
    until: str | None = None


def parse_instant(text: str, *, what: str) -> datetime:
    """``2026-12-05`` (midnight UTC), ``2026-12-05T14:30``, ``2026-12-05T14:30:00Z`` or any ISO
    8601 time (UTC when it names no offset) as a timezone-aware datetime. Raises
    :class:`LookupRefused` (``TIME``, naming ``what``)."""
    cleaned = text.strip()
    try:
        at = datetime.fromisoformat(cleaned)
    except ValueError:
        raise LookupRefused(LookupProblem.TIME, what,
                            f"{what}: {cleaned!r} is no date or time (2026-12-05 or "
                            "2026-12-05T14:30, UTC)") from None
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def message_ids(text: str) -> list[str]:
    """The spellings of a Message-ID the ledger may hold: as typed and with angle brackets
    added or taken off (a Message-ID field holds ``<id@host>``; a bounce or a person often
    quotes it bare)."""
    typed = text.strip()
    bare = typed[1:-1] if typed.startswith("<") and typed.endswith(">") else typed
    return list(dict.fromkeys((typed, f"<{bare}>", bare)))


def recipient_digests(settings: Settings, rcpt: str) -> tuple[str, ...]:
    """The digests the ledger's rows of ``rcpt`` hold (:func:`recipient_digest`): keyed by
    ``fingerprint_secret`` and, while ``fingerprint_secret_previous`` is set, by that secret
    too (the rows written before the rotation, design.md §2.3); empty for an address the
    relay refuses. Raises :class:`relay.core.errors.ConfigError` when a secret's file cannot
    be read."""
    secrets = [settings.fingerprint_secret_bytes]
    if (previous := settings.fingerprint_secret_previous_bytes) is not None:
        secrets.append(previous)
    found = (recipient_digest(rcpt, secret=secret,
                              local_part_case_sensitive=settings.local_part_case_sensitive)
             for secret in secrets)
    return tuple(digest for digest in found if digest is not None)


def ledger_query(settings: Settings, given: Lookup, *, now: datetime) -> LedgerQuery:
    """The ledger's query for ``given`` under ``settings``, newest first; ``now`` (timezone-
    aware) dates the default period. Raises :class:`LookupRefused`: ``EMPTY`` when nothing is
    given, ``RECIPIENT`` for an address the relay refuses, ``TEMPLATE``, ``TIME``, ``PERIOD``
    when ``until`` is not after ``since``."""
    rcpt, mid, queue_id, template = (None if v is None or not v.strip() else v.strip()
                                     for v in (given.rcpt, given.message_id, given.queue_id,
                                               given.template))
    since = parse_instant(given.since, what="since") if given.since and given.since.strip() \
        else None
    until = parse_instant(given.until, what="until") if given.until and given.until.strip() \
        else None
    if not any((rcpt, mid, queue_id, template, since, until)):
        raise LookupRefused(LookupProblem.EMPTY, "",
                            "give a recipient, a Message-ID, a queue id, a template or a "
                            "period")
    digests: tuple[str, ...] = ()
    if rcpt is not None:
        digests = recipient_digests(settings, rcpt)
        if not digests:
            raise LookupRefused(LookupProblem.RECIPIENT, "rcpt",
                                f"{rcpt!r} is no address the relay takes (no row can hold "
                                "it)")
    if template is not None:
        try:
            template = header_values([], [template], max_chars=settings.max_key_chars).template
        except InvalidDedupKeyError as exc:
            raise LookupRefused(LookupProblem.TEMPLATE, "template", str(exc)) from exc
    if since is None and not (mid or queue_id):
        since = (until or now) - timedelta(days=DEFAULT_DAYS)
    if since is not None and until is not None and until <= since:
        raise LookupRefused(LookupProblem.PERIOD, "until",
                            "the period is empty: 'until' must come after 'since'")
    return LedgerQuery(recipient_digests=digests, message_ids=message_ids(mid) if mid else (),
                       queue_id=queue_id, template=template, since=since, until=until)
