"""Who is signed in to the console: sessions and the sign-in check (design.md §6.9).

A session is a random 256-bit token in an HttpOnly, SameSite=Strict cookie (Secure over TLS);
the server keeps only its SHA-256, with the user, the role, the session's CSRF token and its
times. A session ends after ``idle_s`` seconds without a request or :data:`MAX_AGE_S` in all
(monotonic clock: a step of the wall clock ends none early), at sign-out, or when the process
stops (sessions live in its memory: one console per relay). At most :data:`MAX_SESSIONS` are
kept; the least recently used go first.

Sign-in is checked as SMTP AUTH is (:mod:`relay.smtp.auth`): the same users file format with a
role, the same hash checks (an unknown user costs a dummy hash), the same guess budget per
client address (``auth_max_failures`` within ``auth_failure_window``, successes refunded) and
the same failure delay (``auth_failure_delay`` x (1 + recent failures), at most 5 s).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from relay.smtp.auth import CredentialFile, GuessBudget, failure_floor_s

MAX_AGE_S = 12 * 3600.0
"""The longest a session lasts, however active (seconds)."""
MAX_SESSIONS = 10_000
"""Sessions kept at most; the least recently used are ended first."""
MAX_PER_USER = 20
"""Sessions one user keeps at most (their least recently used ends first): one user signing
in again and again cannot push everyone else's sessions out."""


@dataclass
class Session:
    """One signed-in user: ``role`` (``viewer`` or ``operator``), the ``csrf`` token every
    form of this session carries, and its times (monotonic seconds)."""

    user: str
    role: str
    csrf: str
    started: float
    seen: float

    def csrf_matches(self, given: str | None) -> bool:
        """Whether ``given`` is this session's CSRF token (constant-time)."""
        return given is not None and hmac.compare_digest(given.encode("utf-8", "replace"),
                                                         self.csrf.encode("ascii"))


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "replace")).digest()


class Sessions:
    """The open sessions by the SHA-256 of their cookie token."""

    def __init__(self, *, idle_s: float, clock: Callable[[], float] = time.monotonic,
                 max_sessions: int = MAX_SESSIONS) -> None:
        self._idle_s = idle_s
        self._clock = clock
        self._max = max_sessions
        self._open: OrderedDict[bytes, Session] = OrderedDict()

    def start(self, user: str, role: str) -> tuple[str, Session]:
        """Open a session; returns (cookie token, session)."""
        token = secrets.token_urlsafe(32)
        now = self._clock()
        session = Session(user=user, role=role, csrf=secrets.token_urlsafe(32), started=now,
                          seen=now)
        mine = [d for d, s in self._open.items() if s.user == user]
        for digest in mine[:max(0, len(mine) - MAX_PER_USER + 1)]:
            del self._open[digest]
        self._open[_digest(token)] = session
        while len(self._open) > self._max:
            self._open.popitem(last=False)
        return token, session

    def find(self, token: str | None) -> tuple[Session | None, bool]:
        """(the live session of cookie ``token`` or None, whether it was one that expired);
        a live session's idle time starts again."""
        if not token:
            return None, False
        digest = _digest(token)
        session = self._open.get(digest)
        if session is None:
            return None, False
        now = self._clock()
        if now - session.seen > self._idle_s or now - session.started > MAX_AGE_S:
            del self._open[digest]
            return None, True
        session.seen = now
        self._open.move_to_end(digest)
        return session, False

    def end(self, token: str | None) -> None:
        """End the session of cookie ``token`` (sign-out); nothing when there is none."""
        if token:
            self._open.pop(_digest(token), None)

    def keep_only(self, still: Callable[[Session], bool]) -> None:
        """End every session for which ``still(session)`` is false (its user was removed from
        the users file, or its role changed)."""
        for digest in [d for d, session in self._open.items() if not still(session)]:
            del self._open[digest]

    def __len__(self) -> int:
        return len(self._open)


class SignInResult(enum.StrEnum):
    """How a sign-in ended (the ``result`` label of ``relay_console_sign_ins_total``)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REFUSED = "refused"


class SignIns:
    """Checks sign-ins against ``users`` (a :class:`CredentialFile` loaded with roles)."""

    def __init__(self, users: CredentialFile, *, failure_delay_s: float, max_failures: int,
                 failure_window_s: float) -> None:
        self.users = users
        self._delay_s = failure_delay_s
        self._budget = GuessBudget(max_attempts=max_failures, window_s=failure_window_s)
        self._checking: dict[str, set[asyncio.Task[str | None]]] = {}  # by client address

    async def check(self, host: str, user: str, password: str
                    ) -> tuple[SignInResult, str | None]:
        """(how it ended, the user's role when it succeeded).

        An attempt from an address whose budget is held by attempts still being checked
        waits for them (parallel sign-ins with the right password are not refused for being
        parallel); from an address whose budget failures spent it is not checked
        (``refused``, after the failure delay). A failure is answered no sooner than its
        delay floor; a success at once, its charge refunded by the check itself."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        address = f"address:{host}"
        while self._budget.exhausted([address]):
            earlier = self._checking.get(host)
            if not earlier:
                await asyncio.sleep(self._delay_s)
                return SignInResult.REFUSED, None
            await asyncio.wait(earlier, return_when=asyncio.FIRST_COMPLETED)
        keys = [address] + ([f"user:{user}"] if user else [])
        prior = max(self._budget.spent(key) for key in keys)
        checking = asyncio.ensure_future(self._role(user, password, self._budget.charge(keys)))
        self._checking.setdefault(host, set()).add(checking)
        checking.add_done_callback(lambda done: self._checked(host, done))
        role = await asyncio.shield(checking)
        if role is not None:
            return SignInResult.SUCCEEDED, role
        floor_s = failure_floor_s(self._delay_s, prior)
        await asyncio.sleep(max(0.0, started + floor_s - loop.time()))
        return SignInResult.FAILED, None

    async def _role(self, user: str, password: str, token: tuple[float, tuple[str, ...]]
                    ) -> str | None:
        """``user``'s role when ``password`` is theirs (the attempt's charge, ``token``,
        given back), else None."""
        ok = bool(user and password) and await self.users.verify(user, password)
        role = self.users.role(user) if ok else None
        if role is not None:
            self._budget.refund(token)
        return role

    def _checked(self, host: str, done: asyncio.Task[str | None]) -> None:
        earlier = self._checking.get(host)
        if earlier is not None:
            earlier.discard(done)
            if not earlier:
                del self._checking[host]
