"""A busy relay is not a store outage. The embedded store's op timeout is about
the database, not about this process: calls queued behind the relay's own calls, and a call that
finished while the event loop was blocked, are never reported as 'store unavailable'."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from relay.store.sqlite.store import SqliteStore

LEASE_S = 60.0


@pytest.mark.timeout(30)
async def test_calls_queued_behind_each_other_do_not_time_out(tmp_path: Path) -> None:
    """200 concurrent reserves on one store with a 50 ms op timeout all succeed: each fsynced
    transaction is fast, only the queue behind the one worker thread is long."""
    store = await SqliteStore.open(str(tmp_path / "dedup.db"), op_timeout_s=0.05)
    try:
        results = await asyncio.gather(*(
            store.reserve([f"k{i}"], token=f"t{i}", lease_s=LEASE_S) for i in range(200)))
    finally:
        await store.close()
    assert all(r[0].reserved for r in results)


@pytest.mark.timeout(30)
async def test_a_call_that_finished_while_the_loop_was_blocked_is_not_a_timeout(
        tmp_path: Path) -> None:
    """A reserve that completed while the event loop was blocked (3 s of CPU-bound work, op
    timeout 1 s) returns its result instead of raising StoreError."""
    store = await SqliteStore.open(str(tmp_path / "dedup.db"), op_timeout_s=1.0)
    try:
        loop = asyncio.get_running_loop()
        reserving = asyncio.create_task(store.reserve(["k"], token="t", lease_s=LEASE_S))
        await asyncio.sleep(0)  # the call is submitted to the worker thread
        loop.call_soon(time.sleep, 3.0)  # the loop is busy (a large message being parsed)
        [reservation] = await reserving
    finally:
        await store.close()
    assert reservation.reserved
