"""What a password guesser can cost the relay (relay.credentials and its user_turns,
behind SMTP AUTH and the console's sign-in): hash checks run one at a time per users file,
in threads of their own at a lower priority, the checks of one user name take turns whatever
the client address, and what the guess budget keeps of a user name is a short digest."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import bcrypt
import pytest

from relay.credentials import AttemptResult, Attempts, CredentialFile, VerifiedCache, format_entry
from relay.credentials import users as users_file

pytestmark = pytest.mark.timeout(60)

USER, PASSWORD = "ops@example.com", "right-password"


@pytest.fixture
def credentials(tmp_path: Path) -> CredentialFile:
    """A users file of one bcrypt user (cost 4: a check takes a millisecond or two)."""
    path = tmp_path / "users"
    path.write_text(format_entry(USER, bcrypt.hashpw(PASSWORD.encode(),
                                                     bcrypt.gensalt(4)).decode()) + "\n")
    return CredentialFile.load(path)


class HashChecks:
    """The real hash check, timed: when each started, and the most running at once (each
    held 50 ms longer, so that checks allowed to overlap do)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started: list[float] = []
        self.most = 0
        self._running = 0
        self._lock = threading.Lock()
        real = users_file._check_hash

        def timed(entry: Any, secret: bytes) -> bool:
            with self._lock:
                self.started.append(time.monotonic())
                self._running += 1
                self.most = max(self.most, self._running)
            try:
                time.sleep(0.05)
                return real(entry, secret)
            finally:
                with self._lock:
                    self._running -= 1

        monkeypatch.setattr(users_file, "_check_hash", timed)


async def test_hash_checks_of_one_users_file_run_one_at_a_time(
        credentials: CredentialFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight checks asked at once (other users, other passwords) run one after the other,
    each in its turn: none is dropped."""
    checks = HashChecks(monkeypatch)
    results = await asyncio.gather(*(credentials.verify(f"user{i}", "guess")
                                     for i in range(7)), credentials.verify(USER, PASSWORD))
    assert results == [False] * 7 + [True]
    assert (len(checks.started), checks.most) == (8, 1)


async def test_guesses_at_one_user_from_many_addresses_take_turns(
        credentials: CredentialFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five addresses guessing at one user at once: the checks run one by one, each failure
    spacing the next by the failure delay x (1 + the user's other attempts); a password
    verified before is answered at once meanwhile, and the right one from a sixth address is
    accepted once its turn comes (no lock-out)."""
    attempts = Attempts(credentials=credentials, failure_delay_s=0.1, max_failures=5,
                        failure_window_s=600)
    assert await attempts.check("127.0.0.9", USER, PASSWORD) is AttemptResult.SUCCEEDED
    checks = HashChecks(monkeypatch)
    guesses = [asyncio.create_task(attempts.check(f"127.0.0.{i}", USER, f"guess-{i}"))
               for i in range(1, 6)]
    await asyncio.sleep(0.2)
    started = time.monotonic()
    assert await attempts.check("127.0.0.10", USER, PASSWORD) is AttemptResult.SUCCEEDED
    assert time.monotonic() - started < 0.3  # verified before: no turn to wait for
    assert await asyncio.gather(*guesses) == [AttemptResult.FAILED] * 5
    gaps = [b - a for a, b in zip(checks.started, checks.started[1:], strict=False)]
    assert len(gaps) == 4 and all(gap >= 0.05 + 0.1 * 5 * 0.9 for gap in gaps), gaps
    attempts.credentials.verified = VerifiedCache()  # forget the right password
    assert await attempts.check("127.0.0.11", USER, PASSWORD) is AttemptResult.SUCCEEDED


async def test_an_attempt_whose_caller_left_before_its_turn_is_not_checked(
        credentials: CredentialFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three guesses at one user at once; the third's caller is cancelled (its client hung
    up) while the first two are checked: two checks run, and its charge stays spent."""
    attempts = Attempts(credentials=credentials, failure_delay_s=0.1, max_failures=5,
                        failure_window_s=600)
    checks = HashChecks(monkeypatch)
    guesses = [asyncio.create_task(attempts.check("127.0.0.1", USER, f"guess-{i}"))
               for i in range(3)]
    await asyncio.sleep(0.02)
    guesses[2].cancel()
    results = await asyncio.gather(*guesses, return_exceptions=True)
    assert results[:2] == [AttemptResult.FAILED] * 2
    assert isinstance(results[2], asyncio.CancelledError)
    await asyncio.sleep(1.5)  # the third's turn has come and gone
    assert len(checks.started) == 2 and attempts.spent("127.0.0.1") == 3


async def test_the_guess_budget_keeps_a_digest_of_each_user_name(
        credentials: CredentialFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three hundred guesses at distinct 60 KB user names (a sign-in form's size) leave less
    than 1 MB behind: the names are not kept. (The hash check each guess runs answers "no" at
    once: three hundred real ones under tracemalloc took a minute on a loaded runner, and
    what they cost is not what is measured.)"""
    monkeypatch.setattr(users_file, "_check_hash", lambda _entry, _secret: False)
    attempts = Attempts(credentials=credentials, failure_delay_s=0.0, max_failures=1000,
                        failure_window_s=600)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(300):
            name = f"{i:05d}" + "x" * 60_000
            assert await attempts.check(f"10.0.{i // 250}.{i % 250}", name, "guess") \
                is AttemptResult.FAILED
            del name
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1_000_000, kept


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
async def test_a_hash_check_runs_in_a_thread_of_its_own_at_a_lower_priority(
        credentials: CredentialFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs outside the event loop's thread and the default executor, in a
    hash-check thread whose nice value is the process's plus 10: relaying goes first."""
    seen: list[tuple[str, int]] = []
    real = users_file._check_hash

    def observed(entry: Any, secret: bytes) -> bool:
        seen.append((threading.current_thread().name,
                     os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return real(entry, secret)

    monkeypatch.setattr(users_file, "_check_hash", observed)
    assert await credentials.verify(USER, PASSWORD)
    [(name, nice)] = seen
    assert name.startswith("hash-check") and nice == os.getpriority(os.PRIO_PROCESS, 0) + 10
