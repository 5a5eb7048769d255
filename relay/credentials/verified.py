"""Credentials verified recently: :class:`VerifiedCache`, so that a client opening a connection
per message pays one hash check (argon2id: 64 MiB, ~100 ms) per :data:`VERIFIED_TTL_S`, not
one per connection. Memory holds a keyed digest, never a password."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

VERIFIED_TTL_S = 300.0
"""How long a verified (user, password) is remembered (seconds)."""
_VERIFIED_MAX = 1024  # verified credentials remembered at most (the least recent go first)


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
