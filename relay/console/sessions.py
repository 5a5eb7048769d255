"""Who is signed in to the console: sessions and the sign-in check (design.md §6.9).

A session is a random 256-bit token in an HttpOnly, SameSite=Strict cookie (Secure over TLS);
the server keeps only its SHA-256, with the user, the role, the session's CSRF token and its
times. A session ends after ``idle_s`` seconds without a request or :data:`MAX_AGE_S` in all
(monotonic clock: a step of the wall clock ends none early), at sign-out, or when the process
stops (sessions live in its memory: one console per relay). At most :data:`MAX_SESSIONS` are
kept; the least recently used go first.

Sign-in is checked as SMTP AUTH is (:mod:`relay.credentials`): the same users file format with
a role, the same hash checks (an unknown user costs a dummy hash), the same guess budget per
client address (``auth_max_failures`` within ``auth_failure_window``, successes refunded), the
same failure delay (``auth_failure_delay`` x (1 + recent failures), at most 5 s) and the same
turns of one user name's checks (:mod:`relay.credentials.user_turns`). A reload ends the
sessions of a user whose line changed (:meth:`relay.credentials.CredentialFile.stamp`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from relay.credentials import AttemptResult, Attempts, CredentialFile

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
    form of this session carries, its times (monotonic seconds) and the ``stamp`` of the
    user's line it was opened under (:meth:`relay.credentials.CredentialFile.stamp`)."""

    user: str
    role: str
    csrf: str
    started: float
    seen: float
    stamp: bytes = b""

    def csrf_matches(self, given: str | None) -> bool:
        """Whether ``given`` is this session's CSRF token (constant-time)."""
        return given is not None and tokens_match(given, self.csrf)


def tokens_match(given: str, expected: str) -> bool:
    """Whether the token ``given`` is ``expected`` (constant-time; any text is compared)."""
    return hmac.compare_digest(given.encode("utf-8", "replace"),
                               expected.encode("utf-8", "replace"))


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

    def start(self, user: str, role: str, stamp: bytes = b"") -> tuple[str, Session]:
        """Open a session (``stamp``: of the user's line); returns (cookie token, session)."""
        token = secrets.token_urlsafe(32)
        now = self._clock()
        session = Session(user=user, role=role, csrf=secrets.token_urlsafe(32), started=now,
                          seen=now, stamp=stamp)
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
        """End every session for which ``still(session)`` is false (its user's line in the
        users file went or changed)."""
        for digest in [d for d, session in self._open.items() if not still(session)]:
            del self._open[digest]

    def __len__(self) -> int:
        return len(self._open)


class SignIns:
    """Checks sign-ins under ``attempts``: the console's users (a :class:`CredentialFile`
    loaded with roles) under SMTP AUTH's rule (:class:`relay.credentials.Attempts`: the
    budget per client address, the failure delay, the turns of a user name), as
    :meth:`relay.settings.access.AccessSettings.auth_attempts` builds it."""

    def __init__(self, attempts: Attempts) -> None:
        self.attempts = attempts

    @property
    def users(self) -> CredentialFile:
        """Who may sign in (:meth:`CredentialFile.replace_with` on reload)."""
        return self.attempts.credentials

    async def check(self, host: str, user: str, password: str
                    ) -> tuple[AttemptResult, str | None, bytes]:
        """(how it ended, the user's role and the stamp of their line when it succeeded). A
        password checked against a line that a reload changed meanwhile has failed."""
        stamp = self.users.stamp(user)
        result = await self.attempts.check(host, user, password)
        if result is AttemptResult.SUCCEEDED and self.users.stamp(user) != stamp:
            result = AttemptResult.FAILED
        if result is not AttemptResult.SUCCEEDED or stamp is None:
            return result, None, b""
        return result, self.users.role(user), stamp
