"""The turns of one user name's password checks, from whatever client address:
:class:`UserTurns` (used by :class:`relay.credentials.attempts.Attempts`, so by SMTP AUTH and
the console's sign-in alike).

The guess budget counts attempts per client address, so guesses at one user grow with the
addresses a guesser has (30 addresses made 150 guesses in 27 s). Here the checks of one user
name take turns: one at a time, in the order they came, and after a failure the next waits
:func:`relay.credentials.attempts.failure_floor_s` of the user's recent attempts
(``auth_failure_delay`` x (1 + those attempts), at most 5 s). So a name guessed at from any
number of addresses is checked about once per 5 s at most. Nobody is refused for a user's
failures (no lock-out): an attempt waits for its turn, and a password verified in the last
minutes is answered without one (:meth:`relay.credentials.users.CredentialFile.remembered`).

A user name is kept as a keyed digest (:meth:`UserTurns.key`), never in full: names are the
client's text, up to a line's length each, and thousands are remembered.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

_MAX_KEYS = 10_000  # users whose next turn is remembered (the oldest go first)


@dataclass
class _Turn:
    """The lock of one user's checks and how many attempts hold or wait for it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class UserTurns:
    """One check of a user at a time, the next after a failure no sooner than
    :meth:`failed` said. At most ``max_keys`` users' next turns are remembered. ``clock``
    gives seconds (monotonic)."""

    def __init__(self, *, max_keys: int = _MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._secret = secrets.token_bytes(32)
        self._max_keys = max_keys
        self._clock = clock
        self._turns: dict[str, _Turn] = {}
        self._not_before: OrderedDict[str, float] = OrderedDict()

    def key(self, username: str) -> str:
        """``user:`` and the keyed digest of ``username`` (BLAKE2b-128 under a key made per
        process, hex): 37 characters, whatever the name's length."""
        digest = hashlib.blake2b(username.encode("utf-8", "surrogatepass"), key=self._secret,
                                 digest_size=16)
        return "user:" + digest.hexdigest()

    @contextlib.asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        """Wait for the turn of the user ``key``: the attempts before it are over, and the
        wait after the last failure has passed."""
        held = self._turns.setdefault(key, _Turn())
        held.users += 1
        try:
            async with held.lock:
                wait_s = self._not_before.get(key, 0.0) - self._clock()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                yield
        finally:
            held.users -= 1
            if held.users == 0:
                del self._turns[key]

    def failed(self, key: str, wait_s: float) -> None:
        """A check of the user ``key`` failed: its next waits ``wait_s`` seconds from now."""
        now = self._clock()
        self._not_before[key] = now + wait_s
        self._not_before.move_to_end(key)
        while self._not_before and (len(self._not_before) > self._max_keys
                                    or next(iter(self._not_before.values())) <= now):
            self._not_before.popitem(last=False)
