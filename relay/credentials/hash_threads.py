"""The threads password hash checks run in: :func:`in_hash_thread`.

An argon2id check (argon2-cffi's defaults: 64 MiB, four lanes, each lane a thread of
libargon2's) keeps both cores of a small host busy for about 100 ms. Run beside the event
loop at the same priority, sign-in guessing raised the SMTP median from 5 to 45-70 ms even one
check at a time. So checks run in a pool of the process's own, :data:`HASH_THREADS` threads
(one per users file: the SMTP one and the console's), each at a lower scheduling priority
(nice :data:`NICENESS` on Linux; libargon2's lane threads inherit it): when the CPU is short,
the relaying goes first and a check waits. The pool is not the default executor, so checks
never take the threads other adapters (the SQLite store) use.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_T = TypeVar("_T")

HASH_THREADS = 2
"""Threads of the pool: hash checks running at once in a process, at most."""
NICENESS = 10
"""How much lower than the process a check thread is scheduled (Linux nice increment)."""

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def _lower_priority() -> None:
    """Run by each pool thread as it starts: lower its own priority (Linux: a thread's nice
    value is its own; elsewhere nothing, as PRIO_PROCESS there names the whole process)."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           os.getpriority(os.PRIO_PROCESS, 0) + NICENESS)


def _threads() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():  # none yet, or a forked child's copy
        _pool = ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="hash-check",
                                   initializer=_lower_priority)
        _pool_pid = os.getpid()
    return _pool


async def in_hash_thread(check: Callable[..., _T], *args: object) -> _T:
    """``check(*args)`` run in a hash-check thread; its result (its exception raised)."""
    return await asyncio.get_running_loop().run_in_executor(_threads(), check, *args)
