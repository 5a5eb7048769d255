"""A second process on one SQLite store file, for the tests of several processes sharing it.

Run as ``python -m tests.support.sqlite_procs hammer PATH``: reserve its own 50 keys, then
release them or mark them SENDING and SENT (for 1 ms), round after round from two tasks,
through a real :class:`SqliteStore`, until SIGTERM;
prints ``ready`` after its first round and, at the end, one JSON line ``{"rounds": N,
"errors": [...]}``. ``python -m tests.support.sqlite_procs race PATH COUNT START``: at wall-clock
time ``START`` (seconds since the epoch) reserve keys ``k0`` .. ``k{COUNT-1}``, one concurrent
call per key, and print the JSON list of the keys this process reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from uuid import uuid4

from relay.core.errors import StoreError
from relay.core.interfaces import Settle, SettleOp
from relay.store.sqlite.store import SqliteStore

HAMMER_KEYS = [f"hammer:{i}" for i in range(50)]
"""The keys the hammer process writes (no contract test uses the ``hammer:`` prefix)."""


async def hammer(path: str) -> None:
    """Write HAMMER_KEYS from two concurrent tasks until SIGTERM, then print the stats."""
    store = await SqliteStore.open(path)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    rounds, errors = 0, []

    async def worker(keys: list[str]) -> None:
        nonlocal rounds
        while not stop.is_set():
            token = uuid4().hex
            try:
                won = await store.reserve(keys, token=token, lease_s=60)
                steps = [Settle.RELEASE] if rounds % 2 else [Settle.SENDING, Settle.SENT]
                # SENT for 1 ms: the rows lapse before the next round reserves the keys again
                done = [await store.settle([SettleOp(k, step, "250 ok") for k in keys],
                                           token=token,
                                           window_s=0.001 if step is Settle.SENT else 60)
                        for step in steps]
                if not all(r.reserved for r in won) or not all(all(d) for d in done):
                    errors.append(f"round {rounds}: {won} {done}")
            except StoreError as exc:
                errors.append(str(exc))
            rounds += 1
            if rounds == 4:
                print("ready", flush=True)
            await asyncio.sleep(0.005)  # contention, not a busy loop on a two-core runner

    await asyncio.gather(*(worker(HAMMER_KEYS[i::2]) for i in range(2)))
    await store.close()
    print(json.dumps({"rounds": rounds, "errors": errors}), flush=True)


async def race(path: str, count: int, start: float) -> None:
    """Reserve ``k0`` .. ``k{count-1}`` at ``start``, one call each; print the keys won."""
    store = await SqliteStore.open(path, op_timeout_s=10.0)
    await asyncio.sleep(max(0.0, start - time.time()))
    token = uuid4().hex
    results = await asyncio.gather(*(
        store.reserve([f"k{i}"], token=token, lease_s=60) for i in range(count)))
    await store.close()
    print(json.dumps([r.key for [r] in results if r.reserved]), flush=True)


@contextlib.contextmanager
def hammering(path: str) -> Iterator[subprocess.Popen[str]]:
    """Run the hammer on ``path`` while the block runs; asserts it wrote throughout (at least
    one more round after the block) without a single StoreError."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.sqlite_procs", "hammer", path],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", "the hammer process did not start"
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    stats = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0
    assert stats["errors"] == [], stats["errors"][:3]
    assert stats["rounds"] > 4


def race_processes(path: str, count: int, processes: int = 2) -> list[list[str]]:
    """Run ``processes`` race processes on ``path`` starting together; the keys each won."""
    start = time.time() + 1.5  # after every process has imported the relay and opened the file
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.support.sqlite_procs", "race", path, str(count),
         repr(start)], stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    won: list[list[str]] = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        won.append(json.loads(out))
    return won


if __name__ == "__main__":
    if sys.argv[1] == "hammer":
        asyncio.run(hammer(sys.argv[2]))
    else:
        asyncio.run(race(sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
