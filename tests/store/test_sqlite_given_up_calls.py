"""A call to the embedded store that its caller gave up on (timed out or cancelled) still
runs in the writer thread; when it then fails, its failure is nobody's to read and must not be
logged as an unhandled error ("Future exception was never retrieved", with a traceback, once
per call: the relay's log under lock contention). Real files, a real second connection holding
the write lock."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from relay.store.sqlite.store import SqliteStore

LEASE_S = 60.0
OP_TIMEOUT_S = 0.3


def hold_write_lock(db: Path, seconds: float) -> threading.Thread:
    """Another connection takes the file's write lock (``BEGIN IMMEDIATE``) and keeps it for
    ``seconds``; returns once it holds it."""
    held = threading.Event()

    def run() -> None:
        with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
            conn.execute("BEGIN IMMEDIATE")
            held.set()
            threading.Event().wait(seconds)
            conn.execute("ROLLBACK")

    thread = threading.Thread(target=run)
    thread.start()
    held.wait(5)
    return thread


@pytest.mark.timeout(30)
async def test_a_call_that_fails_after_its_caller_gave_up_logs_no_unhandled_error(
        tmp_path: Path) -> None:
    """While another connection holds the write lock, a reserve whose batch starts after a
    read and another write in the same batch times out first and fails later: nothing reaches
    the event loop's exception handler."""
    db = tmp_path / "dedup.db"
    store = await SqliteStore.open(str(db), op_timeout_s=OP_TIMEOUT_S)
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    holder = hold_write_lock(db, 2.5)
    try:
        first = asyncio.create_task(store.reserve(["x"], token="t0", lease_s=LEASE_S))
        await asyncio.sleep(0.05)  # the writer waits for the lock on this one's batch
        # queued behind it, they make one batch: a write, a read alone, a write
        calls = [store.reserve(["a"], token="t1", lease_s=LEASE_S), store.inspect("b"),
                 store.reserve(["c"], token="t2", lease_s=LEASE_S)]
        results = await asyncio.gather(first, *calls, return_exceptions=True)
        await asyncio.sleep(3 * OP_TIMEOUT_S)  # the last write's batch segment fails now
    finally:
        holder.join()
        await store.close()
    del first, calls, results
    gc.collect()
    await asyncio.sleep(0.1)
    loop.set_exception_handler(None)
    assert [c.get("message") for c in unhandled] == []


@pytest.mark.timeout(30)
async def test_cancelled_calls_that_then_fail_log_no_unhandled_error(tmp_path: Path) -> None:
    """Two reserves cancelled while another connection holds the write lock (a shutdown
    cutting their transactions), one waiting for the lock, one still queued behind it, fail
    in the writer later: nothing reaches the event loop's exception handler."""
    db = tmp_path / "dedup.db"
    store = await SqliteStore.open(str(db), op_timeout_s=OP_TIMEOUT_S)
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    holder = hold_write_lock(db, 1.5)
    try:
        waiting = asyncio.create_task(store.reserve(["a"], token="t1", lease_s=LEASE_S))
        await asyncio.sleep(0.1)  # its batch waits for the lock
        queued = asyncio.create_task(store.reserve(["b"], token="t2", lease_s=LEASE_S))
        await asyncio.sleep(0.05)  # queued behind that batch: not started yet
        calls = [waiting, queued]
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await asyncio.sleep(3 * OP_TIMEOUT_S)
    finally:
        holder.join()
        await store.close()
    del waiting, queued, calls
    gc.collect()
    await asyncio.sleep(0.1)
    loop.set_exception_handler(None)
    assert [c.get("message") for c in unhandled] == []
