"""Password attempts per key within a sliding window: :class:`GuessBudget` (a key is a client
address, ``address:HOST``, or a user name's digest:
:meth:`relay.credentials.user_turns.UserTurns.key`)."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

_MAX_BUDGET_KEYS = 10_000  # addresses and user names remembered by GuessBudget (oldest go)


class GuessBudget:
    """AUTH attempts per key (a client address, a user name's digest) within a sliding window.

    An attempt is charged when it is made, before its password is checked, so a guess whose
    client hangs up is counted and parallel connections share one budget; a successful
    attempt is refunded. At most ``max_keys`` keys are kept (the least recently charged are
    forgotten first), so memory stays bounded under a spray of addresses. ``clock`` gives
    seconds (monotonic). Raises ValueError for ``max_attempts`` below 1 or a window <= 0.
    """

    def __init__(self, *, max_attempts: int, window_s: float,
                 max_keys: int = _MAX_BUDGET_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_attempts < 1:
            raise ValueError("max_failures must be >= 1")
        if window_s <= 0:
            raise ValueError("failure_window_s must be > 0")
        self._max = max_attempts
        self._window_s = window_s
        self._max_keys = max_keys
        self._clock = clock
        self._charges: OrderedDict[str, deque[float]] = OrderedDict()

    def spent(self, key: str) -> int:
        """How many attempts ``key`` made within the window (refunded ones not counted)."""
        charges = self._charges.get(key)
        if charges is None:
            return 0
        horizon = self._clock() - self._window_s
        while charges and charges[0] <= horizon:
            charges.popleft()
        return len(charges)

    def exhausted(self, keys: Iterable[str]) -> bool:
        """True when any of ``keys`` has no attempt left."""
        return any(self.spent(key) >= self._max for key in keys)

    def charge(self, keys: Iterable[str]) -> tuple[float, tuple[str, ...]]:
        """Count one attempt for each key; the token :meth:`refund` takes back."""
        stamp, charged = self._clock(), tuple(keys)
        for key in charged:
            self._charges.setdefault(key, deque()).append(stamp)
            self._charges.move_to_end(key)
        while len(self._charges) > self._max_keys:
            self._charges.popitem(last=False)
        return stamp, charged

    def refund(self, token: tuple[float, tuple[str, ...]]) -> None:
        """Take back an attempt :meth:`charge` counted (it succeeded)."""
        stamp, keys = token
        for key in keys:
            charges = self._charges.get(key)
            if charges is not None and stamp in charges:
                charges.remove(stamp)
