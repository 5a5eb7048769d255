"""The users allowed to sign in, read from a users file: :class:`CredentialFile` (the SMTP AUTH
users, ``auth_file``; the console's with their roles, ``console_auth_file``).

The file holds one ``username:hash`` per line (``username:hash:role`` with roles), as
:func:`relay.credentials.entries.format_entry` writes them. Hash checks run in threads of their
own (:mod:`relay.credentials.hash_threads`; ~100 ms each), one at a time per file; an unknown
user is checked against a dummy hash of the same scheme and cost, so timing does not tell who
exists. Passwords and hashes are never logged or put in an exception.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt
from argon2 import PasswordHasher, extract_parameters
from argon2.exceptions import InvalidHashError, VerificationError

from relay.core.errors import ConfigError
from relay.credentials.entries import (
    BCRYPT_MAX_BYTES,
    Scheme,
    hash_problem,
    role_problem,
    scheme_of,
    username_problem,
)
from relay.credentials.hash_threads import in_hash_thread
from relay.credentials.verified import VerifiedCache

# hash checks at once per users file (the SMTP one, the console's: two per process at most,
# in threads of their own at a lower priority: relay.credentials.hash_threads), the others
# wait in line: argon2 defaults take 64 MiB and the cores for ~100 ms each, and sign-in
# guessing must not take the CPU relaying needs
_MAX_CONCURRENT_CHECKS = 1


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
            ok = bcrypt.checkpw(secret[:BCRYPT_MAX_BYTES], entry.password_hash.encode("ascii"))
        except ValueError:  # a hash bcrypt refuses: load() checks the format, so not expected
            return False
        return ok and len(secret) <= BCRYPT_MAX_BYTES
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
                username_problem(username) or hash_problem(password_hash)
                or role_problem(role, roles))
            if reason is None and username in entries:
                reason = f"duplicate user {username!r} (first on line {first_line[username]})"
            if reason is not None:
                raise ConfigError(f"{path}, line {number}: {reason}")
            scheme = scheme_of(password_hash)
            assert scheme is not None  # hash_problem() accepted it
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
