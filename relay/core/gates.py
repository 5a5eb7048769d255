"""What may refuse a message before anything is reserved (design.md §4.7, §6.7): the
admissions, asked before its header fields are read (a required audit ledger that cannot take
rows: ``451 4.3.0``), and the rate limits, taken after what refuses the message anyway (an
invalid key) and before the reserve. :class:`Gates` holds both for the core."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from relay.core.interfaces import LimitVerdict, RateLimiter
from relay.core.limits import LimitSubject, RateRule, checks_for
from relay.core.message import Admission, InboundMessage


def _one_upstream() -> str:
    """The ``upstream`` scope's value when the relay names no upstream: one bucket."""
    return "upstream"


class RateLimits:
    """The ``[[rate_limit]]`` rules (:mod:`relay.core.limits`) counted on ``limiter`` (the
    store's counters, shared by every relay on it); ``upstream_name`` gives the upstream the
    relay would try first now, the value of the scope ``upstream``."""

    def __init__(self, limiter: RateLimiter, rules: Sequence[RateRule] = (),
                 upstream_name: Callable[[], str] = _one_upstream) -> None:
        self._limiter = limiter
        self._rules = tuple(rules)
        self._upstream_name = upstream_name

    @property
    def rules(self) -> tuple[RateRule, ...]:
        """The rules; setting them (a configuration reload) applies from the next message; the
        counters in the store stay (a rule keeps its buckets while its label stays)."""
        return self._rules

    @rules.setter
    def rules(self, rules: Sequence[RateRule]) -> None:
        self._rules = tuple(rules)

    async def acquire(self, msg: InboundMessage, templates: Sequence[str]) -> LimitVerdict | None:
        """Take ``msg``'s share of every rule that applies to it (``templates``: its
        normalized template values), in one store round trip, all or nothing
        (:class:`relay.core.interfaces.RateLimiter`); None when no rule applies. Raises
        :class:`relay.core.errors.StoreError` when the store fails the check."""
        if not self._rules:
            return None
        subject = LimitSubject(upstream=self._upstream_name(), auth_user=msg.auth_user,
                               mail_from=msg.mail_from, templates=templates,
                               recipients=len(set(msg.rcpt_tos)))
        checks = checks_for(self._rules, subject)
        if not checks:
            return None
        return await self._limiter.acquire(checks)


@dataclass(frozen=True)
class Gates:
    """The core's gates: ``admissions`` asked first, before the message's header fields are
    read, and its ``rate_limits`` (None: the store keeps no counters), taken before the
    reserve."""

    admissions: Sequence[Admission] = ()
    rate_limits: RateLimits | None = None

    def admit(self) -> bool:
        """Whether every admission takes the message now."""
        return all(gate.admits() for gate in self.admissions)
