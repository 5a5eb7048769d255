"""Inbound SMTP AUTH: the credentials file and the SASL PLAIN and LOGIN mechanisms.

Sources: RFC 4954 (SMTP AUTH: ``334`` challenges with a mandatory space, ``*`` cancels,
``=`` is an empty initial response, ``501``/``535``/``235`` replies), RFC 4616 (PLAIN:
``[authzid] NUL authcid NUL passwd``, UTF-8), and draft-murchison-sasl-login-00 (LOGIN:
base64 ``Username:`` and ``Password:`` challenges). Client quirks it accepts: the mechanism
name in any case, ``AUTH PLAIN`` without an initial response (answered ``334 ``), LOGIN
prompts compared byte for byte by the client.

The credentials file holds one ``username:hash`` per line, the hash made by bcrypt
(``$2a$``/``$2b$``/``$2y$``) or argon2 (``$argon2id$``...); see :func:`hash_password` and
:func:`format_entry`. A file of users with roles (the console's) holds ``username:hash:role``
lines (neither hash form holds a ``:``). Hash checks run in threads of their own
(:mod:`relay.smtp.hash_threads`; ~100 ms each). Passwords, hashes and AUTH blobs are never
logged or put in an exception; the username is logged at DEBUG only. The authenticated
identity is part of the dedup fingerprint only with ``scope_by_auth``.

:class:`SaslMechanisms` plugs into aiosmtpd: the listener's handler exposes its ``auth_PLAIN``
and ``auth_LOGIN`` (aiosmtpd offers every handler method named ``auth_<MECH>``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import enum
import functools
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import bcrypt
from aiosmtpd.smtp import SMTP, AuthResult
from argon2 import PasswordHasher, extract_parameters
from argon2.exceptions import InvalidHashError, VerificationError

from relay.core import replies
from relay.core.errors import ConfigError
from relay.smtp.hash_threads import in_hash_thread
from relay.smtp.user_turns import UserTurns

log = logging.getLogger("relay.smtp.auth")

Scheme = Literal["argon2", "bcrypt"]

_BCRYPT_PREFIXES = ("$2a$", "$2b$", "$2y$")
_BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12]\d|3[01])\$[./A-Za-z0-9]{53}")
_ROLE = re.compile(r"[a-z][a-z_]*")
_BCRYPT_MAX_BYTES = 72  # bcrypt 5 refuses longer secrets instead of truncating them
_MAX_DELAY_S = 5.0  # cap of the growing delay before an AUTH attempt is answered
_MAX_BUDGET_KEYS = 10_000  # addresses and user names remembered by GuessBudget (oldest go)
# hash checks at once per users file (the SMTP one, the console's: two per process at most,
# in threads of their own at a lower priority: relay.smtp.hash_threads), the others wait in
# line: argon2 defaults take 64 MiB and the cores for ~100 ms each, and sign-in guessing must
# not take the CPU relaying needs
_MAX_CONCURRENT_CHECKS = 1
# a verified (user, password) is remembered this long, so a client that opens a connection per
# message pays one hash check (argon2id: 64 MiB, ~100 ms) per period, not per connection
VERIFIED_TTL_S = 300.0
_VERIFIED_MAX = 1024  # verified credentials remembered at most (the least recent go first)
_LOGIN_USERNAME = "Username:"  # exactly, without NUL: Go's net/smtp compares it
_LOGIN_PASSWORD = "Password:"  # noqa: S105  (the LOGIN prompt, not a password)


def hash_password(password: str, *, scheme: Scheme = "argon2") -> str:
    """Hash ``password`` (UTF-8) for the credentials file.

    ``argon2`` is argon2id with argon2-cffi's ``PasswordHasher`` defaults; ``bcrypt`` uses
    ``bcrypt.gensalt()`` (cost 12). Raises ValueError for an empty password (SASL PLAIN
    cannot carry one), for a bcrypt password longer than 72 UTF-8 bytes, or for an unknown
    ``scheme``.
    """
    if not password:
        raise ValueError("the password is empty")
    secret = password.encode("utf-8")
    if scheme == "argon2":
        return PasswordHasher().hash(secret)
    if scheme == "bcrypt":
        if len(secret) > _BCRYPT_MAX_BYTES:
            raise ValueError("bcrypt takes at most 72 UTF-8 bytes of password; use argon2")
        return bcrypt.hashpw(secret, bcrypt.gensalt()).decode("ascii")
    raise ValueError(f"unknown hash scheme {scheme!r} (argon2 or bcrypt)")


def format_entry(username: str, password_hash: str, role: str | None = None) -> str:
    """Return the credentials file line ``username:hash``, or ``username:hash:role`` with a
    ``role`` (without a newline).

    Raises ValueError when ``username`` is empty, starts with ``#``, or holds ``:``,
    whitespace or a control character, when ``password_hash`` is not a bcrypt or argon2
    hash, or when ``role`` is empty or not a lowercase word; the message never repeats the
    hash.
    """
    reason = _username_problem(username) or _hash_problem(password_hash)
    if reason is None and role is not None and not _ROLE.fullmatch(role):
        reason = f"the role {role!r} is not a lowercase word"
    if reason is not None:
        raise ValueError(reason)
    return f"{username}:{password_hash}" + ("" if role is None else f":{role}")


def failure_floor_s(delay_s: float, prior_failures: int) -> float:
    """Seconds a failed sign-in is answered after it was made: ``delay_s`` x (1 +
    ``prior_failures``, the attempts already in the window), at most 5 s."""
    return min(delay_s * (prior_failures + 1), _MAX_DELAY_S)


def _username_problem(username: str) -> str | None:
    """Why ``username`` cannot be a credentials file user, or None when it can."""
    if not username:
        return "the username is empty"
    if username.startswith("#"):
        return "the username starts with '#' (a comment)"
    if any(ch == ":" or ch.isspace() or not ch.isprintable() for ch in username):
        return "the username holds ':', whitespace or a control character"
    return None


def _scheme_of(password_hash: str) -> Scheme | None:
    if password_hash.startswith(_BCRYPT_PREFIXES):
        return "bcrypt"
    if password_hash.startswith("$argon2"):
        return "argon2"
    return None


def _hash_problem(password_hash: str) -> str | None:
    """Why ``password_hash`` is not a usable hash, or None; never quotes the hash."""
    scheme = _scheme_of(password_hash)
    if scheme is None:
        return "the password hash is neither bcrypt ($2a$, $2b$, $2y$) nor argon2 ($argon2)"
    if scheme == "bcrypt":
        if not _BCRYPT_HASH.fullmatch(password_hash):
            return "the bcrypt hash is malformed"
        return None
    try:
        extract_parameters(password_hash)
    except InvalidHashError:
        return "the argon2 hash is malformed"
    if any(ch.isspace() or not ch.isprintable() or ch == ":" for ch in password_hash):
        return "the argon2 hash is malformed"
    return None


@dataclass(frozen=True)
class _Entry:
    scheme: Scheme
    password_hash: str = field(repr=False)
    role: str | None = None


def _check_hash(entry: _Entry, secret: bytes) -> bool:
    """Blocking: True when ``secret`` matches ``entry`` (run in a worker thread)."""
    if entry.scheme == "bcrypt":
        try:
            # always hash, so that an over-long password costs the same time as any other
            ok = bcrypt.checkpw(secret[:_BCRYPT_MAX_BYTES], entry.password_hash.encode("ascii"))
        except ValueError:  # a hash bcrypt refuses: load() checks the format, so not expected
            return False
        return ok and len(secret) <= _BCRYPT_MAX_BYTES
    try:
        return PasswordHasher().verify(entry.password_hash, secret)
    except (VerificationError, InvalidHashError):  # VerifyMismatchError is a VerificationError
        return False


def _dummy_like(entry: _Entry | None) -> _Entry:
    """A hash of a random password with the scheme and cost of ``entry`` (argon2 defaults)."""
    secret = secrets.token_bytes(16)
    if entry is not None and entry.scheme == "bcrypt":
        rounds = int(entry.password_hash[4:6])
        return _Entry("bcrypt", bcrypt.hashpw(secret, bcrypt.gensalt(rounds)).decode("ascii"))
    hasher = PasswordHasher()
    if entry is not None:
        hasher = PasswordHasher.from_parameters(extract_parameters(entry.password_hash))
    return _Entry("argon2", hasher.hash(secret))


class VerifiedCache:
    """Credentials verified recently, by a keyed digest: HMAC-SHA-256 under a random key made
    per process of ``user NUL hash NUL password``, so memory never holds a password and a
    changed hash (a new password in the file) never matches. Entries live ``ttl_s`` seconds
    (monotonic ``clock``); at most ``max_entries`` are kept, the least recently verified go
    first. Only a successful check is remembered: a wrong password is always checked."""

    def __init__(self, *, ttl_s: float = VERIFIED_TTL_S, max_entries: int = _VERIFIED_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._key = secrets.token_bytes(32)
        self._ttl_s = ttl_s
        self._max = max_entries
        self._clock = clock
        self._until: OrderedDict[bytes, float] = OrderedDict()

    def digest(self, username: str, password_hash: str, secret: bytes) -> bytes:
        """The keyed digest (32 bytes) that stands for this user, hash and password."""
        material = b"\0".join((username.encode("utf-8", "surrogatepass"),
                                password_hash.encode("ascii"), secret))
        return hmac.new(self._key, material, hashlib.sha256).digest()

    def holds(self, username: str, password_hash: str, secret: bytes) -> bool:
        """True when this user, hash and password were verified within the last ``ttl_s``."""
        digest = self.digest(username, password_hash, secret)
        until = self._until.get(digest)
        if until is None:
            return False
        if until <= self._clock():
            del self._until[digest]
            return False
        return True

    def add(self, username: str, password_hash: str, secret: bytes) -> None:
        """Remember a successful check for ``ttl_s`` seconds."""
        digest = self.digest(username, password_hash, secret)
        self._until[digest] = self._clock() + self._ttl_s
        self._until.move_to_end(digest)
        while len(self._until) > self._max:
            self._until.popitem(last=False)

    def __len__(self) -> int:
        return len(self._until)


class CredentialFile:
    """The users allowed to AUTH, loaded from a ``username:hash`` file by :meth:`load`.
    Successful checks are remembered for :data:`VERIFIED_TTL_S` (:class:`VerifiedCache`);
    a reload of the file starts with none remembered."""

    def __init__(self, *, source: str, entries: dict[str, _Entry]) -> None:
        self.source = source
        self._entries = dict(entries)
        # unknown users are checked against this, so timing does not tell who exists; it
        # copies the first entry's scheme and cost (files are usually made by one tool)
        self._dummy = _dummy_like(next(iter(self._entries.values()), None))
        self._checks = asyncio.Semaphore(_MAX_CONCURRENT_CHECKS)
        self.verified = VerifiedCache()
        self._checking: dict[bytes, asyncio.Task[bool]] = {}  # by VerifiedCache.digest

    def __repr__(self) -> str:
        return f"<CredentialFile {self.source} users={len(self._entries)}>"

    def __len__(self) -> int:
        return len(self._entries)

    def role(self, username: str) -> str | None:
        """The role of ``username`` in a file loaded with roles; None for an unknown user (or
        a file without roles)."""
        entry = self._entries.get(username)
        return None if entry is None else entry.role

    def stamp(self, username: str) -> bytes | None:
        """What ``username``'s line holds, as a digest (SHA-256 of its hash and role): another
        stamp after a reload means a new password or role. None for an unknown user."""
        entry = self._entries.get(username)
        if entry is None:
            return None
        return hashlib.sha256(f"{entry.password_hash}\0{entry.role}".encode()).digest()

    def replace_with(self, other: CredentialFile) -> None:
        """Take the users of ``other`` (a configuration reload read the file again): the next
        AUTH is checked against them; an exchange already checking keeps the entry it read."""
        self.source = other.source
        self._entries = other._entries
        self._dummy = other._dummy
        self.verified = other.verified  # the new file's: nothing verified under the old one

    @classmethod
    def load(cls, path: Path, *, roles: tuple[str, ...] | None = None) -> CredentialFile:
        """Read the credentials file at ``path`` (UTF-8).

        One ``username:hash`` per line, or with ``roles`` one ``username:hash:role`` with a
        role of ``roles``; blank lines and lines starting with ``#`` are skipped.
        Raises :class:`relay.core.errors.ConfigError` naming the file (and line number) when it
        cannot be read, is not UTF-8, has a malformed line, a hash that is neither bcrypt
        nor argon2, a missing or unknown role, a duplicate user, or no user at all. The
        message never quotes a hash. Blocking (file read plus one hash to build the
        unknown-user dummy, ~100 ms).
        """
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the auth file ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: the auth file is not UTF-8") from None
        entries: dict[str, _Entry] = {}
        first_line: dict[str, int] = {}
        for number, raw in enumerate(text.split("\n"), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            username, colon, password_hash = line.partition(":")
            role = None
            if roles is not None:
                head, has_role, role = password_hash.rpartition(":")
                password_hash, role = (head, role) if has_role else (password_hash, "")
            reason = (
                "expected username:hash" + (":role" if roles is not None else "")
                if not colon or role == "" else
                _username_problem(username) or _hash_problem(password_hash)
                or _role_problem(role, roles))
            if reason is None and username in entries:
                reason = f"duplicate user {username!r} (first on line {first_line[username]})"
            if reason is not None:
                raise ConfigError(f"{path}, line {number}: {reason}")
            scheme = _scheme_of(password_hash)
            assert scheme is not None  # _hash_problem() accepted it
            entries[username] = _Entry(scheme, password_hash, role)
            first_line[username] = number
        if not entries:
            raise ConfigError(f"{path}: the auth file defines no user")
        return cls(source=str(path), entries=entries)

    async def verify(self, username: str, password: str) -> bool:
        """True when ``password`` (UTF-8) is the password of ``username`` (exact match).

        The hash check runs in a hash-check thread, one at a time per file (the others wait
        in line); credentials verified within :data:`VERIFIED_TTL_S` are answered from
        :attr:`verified` without one, and the same user and password asked again while their
        check runs wait for that check (the connections an application opens at once after a
        start pay one check, not one each).
        An unknown user is checked against a dummy hash, so both take about the same time.
        Never raises for bad input: a password that cannot match is simply False.
        """
        entry = self._entries.get(username)
        secret = password.encode("utf-8", "surrogatepass")
        if entry is None:
            await self._hash_check(self._dummy, secret)
            return False
        if self.remembered(username, password):
            return True
        digest = self.verified.digest(username, entry.password_hash, secret)
        checking = self._checking.get(digest)
        if checking is None:
            checking = asyncio.ensure_future(self._remembered_check(username, entry, secret))
            self._checking[digest] = checking
            checking.add_done_callback(lambda _: self._checking.pop(digest, None))
        return await asyncio.shield(checking)

    def remembered(self, username: str, password: str) -> bool:
        """Whether ``username`` and ``password`` were verified within :data:`VERIFIED_TTL_S`
        (:attr:`verified`): right, without a hash check."""
        entry = self._entries.get(username)
        return entry is not None and self.verified.holds(
            username, entry.password_hash, password.encode("utf-8", "surrogatepass"))

    async def _remembered_check(self, username: str, entry: _Entry, secret: bytes) -> bool:
        """The hash check of ``username``'s ``entry``; a success is remembered in
        :attr:`verified` (once, for every caller that shares this check)."""
        ok = await self._hash_check(entry, secret)
        if ok:
            self.verified.add(username, entry.password_hash, secret)
        return ok

    async def _hash_check(self, entry: _Entry, secret: bytes) -> bool:
        async with self._checks:
            return await in_hash_thread(_check_hash, entry, secret)


def _role_problem(role: str | None, roles: tuple[str, ...] | None) -> str | None:
    """Why ``role`` is not one of ``roles`` (None: a file without roles), or None."""
    if roles is None or role in roles:
        return None
    return f"unknown role {role!r} (one of {', '.join(roles)})"


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


class AttemptResult(enum.StrEnum):
    """How a password attempt ended (the console's ``relay_console_sign_ins_total`` label)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"  # checked and wrong (answered at its delay floor)
    REFUSED = "refused"  # not checked: the address's budget is spent by failures


class Attempts:
    """Password attempts against a :class:`CredentialFile` under a :class:`GuessBudget` per
    client address, the one rule of SMTP AUTH (:class:`SaslMechanisms`) and the console's
    sign-in.

    An attempt is charged when it is made (a guess whose client hangs up counts) and a success
    gives its charge back inside its own check, so the budget is never held by a check that is
    over. An attempt from an address whose budget is held by attempts still being checked
    waits for them (parallel logins with the right password are not refused for being
    parallel); from an address whose budget failures spent it is not checked: ``refused``,
    answered after ``failure_delay_s``. Failures at a user name are counted too, but only to
    slow them down: a user is never locked out. The checks of one user name, from whatever
    address, take turns (:class:`relay.smtp.user_turns.UserTurns`: one at a time, the next
    after a failure no sooner than its floor), so guesses at one user do not grow with the
    guesser's addresses; credentials verified recently skip the turn; an attempt whose caller
    left before its turn is not checked. A right password is answered as soon as it is
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


async def _first_response(server: SMTP, args: list[str], challenge: str | bytes, *,
                          encode_to_b64: bool = True) -> bytes | None:
    """The client's first SASL response: the AUTH line's initial response (RFC 4954 section
    4), else its answer to ``challenge``. ``None`` when the exchange is over: '*' or bad
    base64 to the challenge (aiosmtpd answered 501), or a bad initial response (answered
    here)."""
    if len(args) == 1:
        blob = await server.challenge_auth(challenge, encode_to_b64=encode_to_b64)
        return blob if isinstance(blob, bytes) else None
    decoded = _decode_initial_response(args[1])
    if decoded is None:
        await server.push(str(replies.AUTH_BAD_BASE64))
    return decoded


def _decode_initial_response(arg: str) -> bytes | None:
    """The initial response of ``AUTH <mech> <arg>``; ``=`` is empty (RFC 4954 section 4)."""
    if arg == "=":
        return b""
    try:
        return base64.b64decode(arg.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        return None


def _split_plain(message: bytes) -> tuple[str, str, str] | None:
    """``(authzid, authcid, passwd)`` of a PLAIN message (RFC 4616 section 2), or None."""
    parts = message.split(b"\x00")
    if len(parts) != 3:
        return None
    try:
        authzid, authcid, passwd = (part.decode("utf-8") for part in parts)
    except UnicodeDecodeError:
        return None
    return authzid, authcid, passwd


def _peer_host(server: SMTP) -> str:
    """The client's address: behind a PROXY balancer the one its header gave."""
    client = getattr(server, "client_host", None)
    if isinstance(client, str) and client:
        return client
    peer = server.session.peer if server.session is not None else None
    return str(peer[0]) if isinstance(peer, tuple) else str(peer)


class SaslMechanisms:
    """SASL PLAIN and LOGIN for aiosmtpd, checked against a :class:`CredentialFile` under
    :class:`Attempts`' rule (the guess budget per client address, across connections; the
    failure delay; a user never locked out).

    A right password is answered ``235`` as soon as it is verified; a failure ``535`` at its
    delay floor, or ``421 4.7.0`` with the connection closed when it spent the address's
    budget; an attempt from an address whose budget failures spent is not checked: it calls
    ``on_refused`` and is answered ``421 4.7.0``, the connection closed. Each failure calls
    ``on_failure`` (for a metric) once its check is done, also when the client hung up
    before the answer. A cancelled exchange (``*``) or bad base64 is answered ``501`` by
    aiosmtpd and is not counted. Raises ValueError as :class:`Attempts`.
    """

    def __init__(self, *, credentials: CredentialFile,
                 on_failure: Callable[[], None] | None = None,
                 on_refused: Callable[[], None] | None = None,
                 failure_delay_s: float = 1.0, max_failures: int = 5,
                 failure_window_s: float = 600.0) -> None:
        self.attempts = Attempts(credentials=credentials, failure_delay_s=failure_delay_s,
                                 max_failures=max_failures, failure_window_s=failure_window_s)
        self._on_failure = on_failure
        self._on_refused = on_refused

    @property
    def credentials(self) -> CredentialFile:
        """The users AUTH is checked against (:meth:`CredentialFile.replace_with` on reload)."""
        return self.attempts.credentials

    async def auth_PLAIN(self, server: SMTP, args: list[str]) -> AuthResult:
        """``AUTH PLAIN [initial-response]`` (RFC 4616); ``args`` is the AUTH line split.

        Without an initial response the challenge is ``334 `` (empty). An authzid other than
        the authcid is refused. Returns aiosmtpd's AuthResult; ``auth_data`` is the username.
        """
        message = await _first_response(server, args, b"", encode_to_b64=False)
        if message is None:
            return AuthResult(success=False, handled=True)
        parts = _split_plain(message)
        if parts is None:
            return await self._check(server, "PLAIN", None, None)
        authzid, username, password = parts
        if authzid not in ("", username):  # acting as another user is not offered
            return await self._check(server, "PLAIN", username, None)
        return await self._check(server, "PLAIN", username, password)

    async def auth_LOGIN(self, server: SMTP, args: list[str]) -> AuthResult:
        """``AUTH LOGIN [base64 username]`` (draft-murchison-sasl-login-00).

        Challenges are base64 ``Username:`` (unless the username came on the AUTH line) and
        ``Password:``, without NUL. Returns aiosmtpd's AuthResult; ``auth_data`` is the
        username.
        """
        username_bytes = await _first_response(server, args, _LOGIN_USERNAME)
        if username_bytes is None:
            return AuthResult(success=False, handled=True)
        password_blob = await server.challenge_auth(_LOGIN_PASSWORD)
        if not isinstance(password_blob, bytes):
            return AuthResult(success=False, handled=True)
        try:
            username = username_bytes.decode("utf-8")
            password = password_blob.decode("utf-8")
        except UnicodeDecodeError:
            return await self._check(server, "LOGIN", None, None)
        return await self._check(server, "LOGIN", username, password)

    async def _check(self, server: SMTP, mechanism: str, username: str | None,
                     password: str | None) -> AuthResult:
        """One attempt under :class:`Attempts`' rule: ``235`` at once when right; a failure
        ``535`` at its delay floor, or ``421`` and closed when it spent the budget; refused
        unchecked ``421`` and closed.

        ``username`` is None when the exchange named none that can be decoded, ``password``
        None when the attempt fails before its password matters.
        """
        host = _peer_host(server)
        result = await self.attempts.check(host, username, password, on_failure=functools.partial(
            self._failed, mechanism, host, username))
        if result is AttemptResult.SUCCEEDED:
            log.info("auth succeeded", extra={"mechanism": mechanism, "peer": host})
            log.debug("auth succeeded for user", extra={"username": username})
            return AuthResult(success=True, auth_data=username,
                              message=str(replies.AUTH_SUCCEEDED))
        if result is AttemptResult.REFUSED:
            if self._on_refused is not None:
                self._on_refused()
            log.warning("auth budget spent, attempt refused unchecked", extra={"peer": host})
            return await self._close(server)
        return await self._fail(server, host)

    def _failed(self, mechanism: str, host: str, username: str | None) -> None:
        """A failed check: counted (``on_failure``) and logged."""
        if self._on_failure is not None:
            self._on_failure()
        log.info("auth failed", extra={"mechanism": mechanism, "peer": host,
                                       "failures": self.attempts.spent(host)})
        if username is not None:
            log.debug("auth failed for user", extra={"username": username})

    async def _fail(self, server: SMTP, host: str) -> AuthResult:
        """Answer a failure: 535, or 421 and close when it spent the address's budget."""
        if not self.attempts.exhausted(host):
            return AuthResult(success=False, handled=False, message=str(replies.AUTH_FAILED))
        log.warning("too many auth failures, closing", extra={"peer": _peer_host(server)})
        return await self._close(server)

    @staticmethod
    async def _close(server: SMTP) -> AuthResult:
        """Answer ``421 4.7.0`` and close the connection."""
        await server.push(str(replies.AUTH_TOO_MANY_FAILURES))
        if server.transport is not None:
            server.transport.close()
        return AuthResult(success=False, handled=True)
