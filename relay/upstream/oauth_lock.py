"""The lock the relay's workers take to refresh a shared OAuth2 refresh token one at a time:
``.<file>.lock`` beside ``oauth_refresh_token_file`` (an exclusive ``flock``).

The lock is a file of the relay's own: it is opened without following a symbolic link
(``O_NOFOLLOW``: a link planted there would make the relay truncate and write whatever it
points to), and it must be a regular file, owned by the relay's user, with no other hard link
(:func:`lock_problem`). A lock that is not usable (it cannot be made, or it is not such a
file) is never gone without while several workers share the token: their refreshes would race
and an endpoint with refresh-token reuse detection revokes the whole token family. That
refresh fails (:class:`LockError` ``lock``, a TokenError to the caller); a relay of one worker
(no other refresher) logs a WARNING and refreshes unlocked. :func:`check_lock` is
``check-config``'s look at it, with the same rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

log = logging.getLogger("relay.upstream.oauth")

LOCK_POLL_S = 0.02


class LockError(Exception):
    """No refresh now: ``kind`` ``busy`` (one holder kept the lock too long) or ``lock`` (the
    lock is not usable while workers share the token); ``reason`` in words safe to show a
    client."""

    def __init__(self, reason: str, kind: Literal["busy", "lock"]) -> None:
        super().__init__(reason)
        self.reason, self.kind = reason, kind


def lock_path(real_file: Path) -> Path:
    """The workers' lock of the refresh token file whose real path (no symbolic link: the
    lock is beside the file a link names) is ``real_file``: ``.<name>.lock``."""
    return real_file.with_name(f".{real_file.name}.lock")


def lock_problem(status: os.stat_result) -> str | None:
    """Why a lock file of this ``status`` (``lstat`` or ``fstat``) is not the relay's own
    lock, or None when it is: a regular file of this process's user with one link."""
    if stat.S_ISLNK(status.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISREG(status.st_mode):
        return "it is not a regular file"
    if status.st_uid != os.geteuid():
        return f"it is owned by uid {status.st_uid}, not by this user (uid {os.geteuid()})"
    if status.st_nlink != 1:
        return f"it has {status.st_nlink} hard links"
    return None


def check_lock(token_file: Path) -> str | None:
    """Why the workers could not lock ``token_file``'s lock (:func:`lock_problem`, or its
    folder not writable while it is missing), or None when they could. Makes nothing."""
    path = lock_path(Path(os.path.realpath(token_file)))
    try:
        problem = lock_problem(os.lstat(path))
    except FileNotFoundError:
        if os.access(path.parent, os.W_OK | os.X_OK):
            return None
        return f"{path} cannot be made: {path.parent} is not a folder this user can write"
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    return None if problem is None else f"{path}: {problem}"


def _open(path: Path) -> int:
    """The lock file ``path``, opened read-write (made, mode 0600, when missing) without
    following a link. Raises OSError (its ``strerror`` the reason) when it is not the relay's
    own lock."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "it is a symbolic link") from None
        raise
    problem = lock_problem(os.fstat(fd))
    if problem is not None:
        os.close(fd)
        raise OSError(errno.EPERM, problem)
    return fd


@contextlib.asynccontextmanager
async def exclusive(path: Path, *, wait_s: float, shared: bool) -> AsyncIterator[None]:
    """Hold an exclusive ``flock`` on the lock file ``path``, polled without blocking the
    loop. The holder writes its pid and start into the file; a waiter gives up when one holder
    kept it ``wait_s`` seconds (a queue of workers each refreshing in time is waited out).

    Raises :class:`LockError` ``busy`` past ``wait_s`` of one holder, and ``lock`` when the
    lock is not usable while ``shared`` (several workers refresh this token); alone, that is a
    WARNING and the body runs unlocked."""
    try:
        fd = _open(path)
    except OSError as exc:
        if shared:
            log.error("OAuth2: the refresh-token lock %s is not usable (%s): no refresh "
                      "while the workers cannot take turns (an endpoint that detects "
                      "refresh-token reuse would revoke the token)", path, exc.strerror)
            raise LockError("token refresh lock unusable", "lock") from None
        log.warning("OAuth2: the refresh-token lock %s is not usable (%s): this relay's only "
                    "worker refreshes unlocked", path, exc.strerror)
        yield
        return
    try:
        await _take(fd, path, wait_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.monotonic_ns()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


async def _take(fd: int, path: Path, wait_s: float) -> None:
    """Take the ``flock`` of ``fd``; LockError ``busy`` when one holder kept it ``wait_s``."""
    holder, deadline = b"", time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now_holding = os.pread(fd, 64, 0)
            if now_holding != holder:  # another holder: it gets its own wait_s
                holder, deadline = now_holding, time.monotonic() + wait_s
            elif time.monotonic() >= deadline:
                log.error("OAuth2: %s held by one refresh for %.0f s (%s)", path, wait_s,
                          holder.decode("ascii", "replace"))
                raise LockError("token refresh busy", "busy") from None
            await asyncio.sleep(LOCK_POLL_S)
