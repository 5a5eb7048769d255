"""Password attempts against a users file under the guess rule: :class:`Attempts`, the one rule
of SMTP AUTH (:class:`relay.smtp.auth.SaslMechanisms`) and the console's sign-in.

Its parts: the guess budget per client address (:mod:`relay.credentials.budget`), the turns
of one user name's checks (:mod:`relay.credentials.user_turns`), the failure delay
(:func:`failure_floor_s`) and the users file's checks
(:class:`relay.credentials.users.CredentialFile`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from relay.credentials.budget import GuessBudget
from relay.credentials.user_turns import UserTurns
from relay.credentials.users import CredentialFile

_MAX_DELAY_S = 5.0  # cap of the growing delay before an attempt is answered


def failure_floor_s(delay_s: float, prior_failures: int) -> float:
    """Seconds a failed sign-in is answered after it was made: ``delay_s`` x (1 +
    ``prior_failures``, the attempts already in the window), at most 5 s."""
    return min(delay_s * (prior_failures + 1), _MAX_DELAY_S)


class AttemptResult(enum.StrEnum):
    """How a password attempt ended (the console's ``relay_console_sign_ins_total`` label)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"  # checked and wrong (answered at its delay floor)
    REFUSED = "refused"  # not checked: the address's budget is spent by failures


class Attempts:
    """Password attempts against a :class:`CredentialFile` under a :class:`GuessBudget` per
    client address, the one rule of SMTP AUTH (:class:`relay.smtp.auth.SaslMechanisms`) and
    the console's sign-in.

    An attempt is charged when it is made (a guess whose client hangs up counts) and a success
    gives its charge back inside its own check, so the budget is never held by a check that is
    over. An attempt from an address whose budget is held by attempts still being checked
    waits for them (parallel logins with the right password are not refused for being
    parallel); from an address whose budget failures spent it is not checked: ``refused``,
    answered after ``failure_delay_s``. Failures at a user name are counted too, but only to
    slow them down: a user is never locked out. The checks of one user name, from whatever
    address, take turns (:class:`relay.credentials.user_turns.UserTurns`: one at a time, the
    next after a failure no sooner than its floor), so guesses at one user do not grow with
    the guesser's addresses; credentials verified recently skip the turn; an attempt whose
    caller left before its turn is not checked. A right password is answered as soon as it is
    verified; a failure no sooner than ``failure_delay_s`` x (1 + the attempts already in the
    window of the address or of the user), at most 5 s. Raises ValueError for a negative
    delay, ``max_failures`` below 1 or a window <= 0.
    """

    def __init__(self, *, credentials: CredentialFile, failure_delay_s: float,
                 max_failures: int, failure_window_s: float) -> None:
        if failure_delay_s < 0:
            raise ValueError("failure_delay_s must be >= 0")
        self.credentials = credentials
        self._delay_s = failure_delay_s
        self._budget = GuessBudget(max_attempts=max_failures, window_s=failure_window_s)
        self._turns = UserTurns()
        # the checks running, by client address (their clients may have gone)
        self._checking: dict[str, set[asyncio.Task[bool]]] = {}

    def spent(self, host: str) -> int:
        """The attempts of client address ``host`` in the window."""
        return self._budget.spent(f"address:{host}")

    def exhausted(self, host: str) -> bool:
        """Whether client address ``host`` has no attempt left."""
        return self._budget.exhausted([f"address:{host}"])

    async def check(self, host: str, username: str | None, password: str | None, *,
                    on_failure: Callable[[], None] | None = None) -> AttemptResult:
        """Charge, check and time one attempt from client address ``host`` (``username`` None:
        the exchange named none that can be decoded; ``password`` None: it fails before its
        password matters; either empty fails, RFC 4616's 1*SAFE). ``on_failure`` is called
        once the check found it wrong, also when the caller was cancelled meanwhile."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        while self.exhausted(host):
            earlier = self._checking.get(host)
            if not earlier:
                await asyncio.sleep(self._delay_s)
                return AttemptResult.REFUSED
            await asyncio.wait(earlier, return_when=asyncio.FIRST_COMPLETED)
        user = self._turns.key(username) if username else None
        keys = [f"address:{host}"] + ([user] if user else [])
        prior = max(self._budget.spent(key) for key in keys)
        # the check, its refund or its failure run to the end even if the caller is cancelled
        attempt = _Attempt(username, password, user, self._budget.charge(keys), on_failure)
        checking = asyncio.ensure_future(self._verify(attempt))
        self._checking.setdefault(host, set()).add(checking)
        checking.add_done_callback(functools.partial(self._checked, host))
        try:
            ok = await asyncio.shield(checking)
        except asyncio.CancelledError:
            attempt.gone = True  # not checked if its turn has not come yet
            raise
        if ok:
            return AttemptResult.SUCCEEDED
        floor_s = failure_floor_s(self._delay_s, prior)
        await asyncio.sleep(max(0.0, started + floor_s - loop.time()))
        return AttemptResult.FAILED

    def _checked(self, host: str, checking: asyncio.Task[bool]) -> None:
        earlier = self._checking.get(host)
        if earlier is not None:
            earlier.discard(checking)
            if not earlier:
                del self._checking[host]

    async def _verify(self, attempt: _Attempt) -> bool:
        """Check ``attempt`` in its user's turn (unless its password was verified recently);
        refund a success, count a failure and space the user's next check after it."""
        username, password = attempt.username or "", attempt.password or ""
        if username and password and self.credentials.remembered(username, password):
            self._budget.refund(attempt.token)
            return True
        async with (self._turns.turn(attempt.user) if attempt.user is not None
                    else contextlib.nullcontext()):
            if attempt.gone:
                return False
            ok = bool(username and password) and await self.credentials.verify(username,
                                                                               password)
            if ok:
                self._budget.refund(attempt.token)
                return True
            if attempt.user is not None:
                tried = self._budget.spent(attempt.user) - 1  # the others in the window
                self._turns.failed(attempt.user, failure_floor_s(self._delay_s, tried))
        if attempt.on_failure is not None:
            attempt.on_failure()
        return False


@dataclass
class _Attempt:
    """One password attempt being checked: what it gave, its user's key
    (:meth:`UserTurns.key`, None without a user name), its budget charge, what to call when
    it fails, and whether its caller is ``gone`` (cancelled: a client that hung up)."""

    username: str | None
    password: str | None = field(repr=False)
    user: str | None
    token: tuple[float, tuple[str, ...]]
    on_failure: Callable[[], None] | None
    gone: bool = False
