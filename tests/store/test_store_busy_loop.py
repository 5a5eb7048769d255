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


@pytest.mark.timeout(60)
async def test_calls_queued_behind_each_other_do_not_time_out(tmp_path: Path) -> None:
    """200 reserves queued behind a 3 s call on the store's one writer thread, with a 1 s op
    timeout, all succeed: the time a call waits behind this process's own calls is not an
    outage of the database (each waits about 3 s, three times its op timeout)."""
    store = await SqliteStore.open(str(tmp_path / "dedup.db"), op_timeout_s=1.0)
    try:
        # the writer thread is busy for 3 s with one call of its own (as a large count_states is)
        blocking = asyncio.create_task(store._call(
            "hold", lambda _conn, _now: time.sleep(3.0), in_tx=False, timeout_s=30.0))
        await asyncio.sleep(0.2)  # the long call has started
        started = time.monotonic()
        results = await asyncio.gather(*(
            store.reserve([f"k{i}"], token=f"t{i}", lease_s=LEASE_S) for i in range(200)))
        waited = time.monotonic() - started
        await blocking
    finally:
        await store.close()
    assert all(r[0].reserved for r in results)
    assert waited > 1.0  # the reserves did wait longer than their op timeout


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
