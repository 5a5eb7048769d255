"""The SQLite store under concurrency: concurrent calls of one process share one
transaction and one fsync (group commit), a failing call fails alone, and several processes on
one file reserve every key exactly once. Real files under ``tmp_path``, real processes."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.faultbench.lib import _libfaketime
from relay.core.errors import StoreError
from relay.core.interfaces import Settle, SettleOp, State
from relay.store.sqlite.store import SqliteStore
from tests.support.cli import REPO
from tests.support.sqlite_procs import race_processes

LEASE_S = 60.0


def wal_commits(db: Path) -> int:
    """Commit frames in ``db``'s write-ahead log: one per transaction that wrote (the WAL file
    format: a 32-byte header, then frames of a 24-byte header and one page; a frame whose
    header's second word is non-zero ends a transaction)."""
    data = (db.parent / (db.name + "-wal")).read_bytes()
    page_size = struct.unpack(">I", data[8:12])[0]
    salts = data[16:24]
    commits, at = 0, 32
    while at + 24 + page_size <= len(data):
        header = data[at:at + 24]
        if header[8:16] != salts:
            break  # a frame left over from before the log was last restarted
        commits += struct.unpack(">I", header[4:8])[0] != 0
        at += 24 + page_size
    return commits


async def test_concurrent_writes_share_transactions(tmp_path: Path) -> None:
    """200 concurrent reserves are committed in far fewer than 200 transactions, and each is on
    disk (seen by another connection) when its call returns."""
    db = tmp_path / "dedup.db"
    store = await SqliteStore.open(str(db))
    try:
        before = wal_commits(db)
        results = await asyncio.gather(*(
            store.reserve([f"k{i}"], token=f"t{i}", lease_s=LEASE_S) for i in range(200)))
        commits = wal_commits(db) - before
        with contextlib.closing(sqlite3.connect(db)) as other:
            rows = other.execute("SELECT COUNT(*) FROM fingerprints").fetchone()[0]
    finally:
        await store.close()
    assert all(r.reserved for [r] in results)
    assert rows == 200
    assert 1 <= commits <= 100


async def test_a_failing_call_fails_alone_and_leaves_nothing(tmp_path: Path) -> None:
    """A reserve that fails half-way (its second key cannot be stored) raises StoreError and
    leaves its first key absent; the calls queued with it are reserved."""
    store = await SqliteStore.open(str(tmp_path / "dedup.db"))
    try:
        calls = [store.reserve([f"k{i}"], token=f"t{i}", lease_s=LEASE_S) for i in range(20)]
        calls.insert(10, store.reserve(["half", "bad\udcff"], token="t", lease_s=LEASE_S))
        results = await asyncio.gather(*calls, return_exceptions=True)
        half = await store.inspect("half")
        states = [(await store.inspect(f"k{i}")).state for i in range(20)]
    finally:
        await store.close()
    failed = results.pop(10)
    assert isinstance(failed, StoreError) and failed.op == "reserve"
    assert half.state is State.ABSENT
    assert all(not isinstance(r, BaseException) and r[0].reserved for r in results)
    assert states == [State.PENDING] * 20


async def test_a_write_records_the_time_it_got_the_lock(tmp_path: Path) -> None:
    """A SENT mark that waited 0.5 s for another process's write lock records the time it was
    written, not the time it was asked for."""
    db = str(tmp_path / "dedup.db")
    store = await SqliteStore.open(db)
    try:
        await store.reserve(["k"], token="t", lease_s=LEASE_S)
        blocker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        blocker.execute("BEGIN IMMEDIATE")
        released: list[float] = []

        def release() -> None:
            released.append(time.time())
            blocker.execute("ROLLBACK")

        timer = threading.Timer(0.5, release)
        timer.start()
        try:
            done = await store.settle([SettleOp("k", Settle.SENT, "250 ok")], token="t",
                                      window_s=LEASE_S)
        finally:
            timer.join()
            blocker.close()
        record = await store.inspect("k")
    finally:
        await store.close()
    assert done == [True]
    assert record.at is not None and record.at >= released[0] - 0.002


async def test_opening_a_file_another_connection_is_writing_waits_for_it(
        tmp_path: Path) -> None:
    """Opening a new file (not yet in WAL mode) while another connection holds its write lock
    for 0.3 s waits and succeeds: switching to WAL does not wait through SQLite's busy timeout,
    so two processes starting on one new file used to fail with 'database is locked'."""
    db = str(tmp_path / "dedup.db")
    blocker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    blocker.execute("CREATE TABLE other (a)")
    blocker.execute("BEGIN IMMEDIATE")
    timer = threading.Timer(0.3, lambda: blocker.execute("ROLLBACK"))
    timer.start()
    try:
        store = await SqliteStore.open(db, op_timeout_s=5.0)
        [reservation] = await store.reserve(["k"], token="t", lease_s=LEASE_S)
        await store.close()
    finally:
        timer.join()
        blocker.close()
    assert reservation.reserved


_WAITS_UNDER_FAKETIME = """
import asyncio, sqlite3, sys, threading
from relay.store.sqlite.store import SqliteStore

def held(db, seconds):
    blocker = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    blocker.execute("CREATE TABLE IF NOT EXISTS other (a)")
    blocker.execute("BEGIN IMMEDIATE")
    timer = threading.Timer(seconds, lambda: blocker.execute("ROLLBACK"))
    timer.start()
    return timer

async def main(db):
    opening = held(db, 0.2)  # the switch to WAL meets a held lock
    store = await SqliteStore.open(db, op_timeout_s=5.0)
    opening.join()
    writing = held(db, 0.2)  # so does the reserve's BEGIN IMMEDIATE
    [reservation] = await store.reserve(["k"], token="t", lease_s=60)
    writing.join()
    await store.close()
    assert reservation.reserved, reservation

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="libfaketime")
def test_a_process_with_its_wall_clock_offset_waits_for_a_held_lock(tmp_path: Path) -> None:
    """Under libfaketime (wall clock 20 s ahead, monotonic clock real, as the clock-skew tests
    run a relay) opening a new file and reserving both wait out another connection's write
    lock and succeed (there time.sleep raises OSError, EINVAL)."""
    env = {"LD_PRELOAD": _libfaketime(), "FAKETIME": "+20s", "FAKETIME_NO_CACHE": "1",
           "FAKETIME_DONT_FAKE_MONOTONIC": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", _WAITS_UNDER_FAKETIME, str(tmp_path / "d.db")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.timeout(90)
def test_two_processes_reserving_the_same_keys_reserve_each_once(tmp_path: Path) -> None:
    """Two processes reserving the same 1,000 keys at once (one call per key, so each process
    commits in batches) reserve every key exactly once between them."""
    first, second = race_processes(str(tmp_path / "dedup.db"), 1000)
    assert not set(first) & set(second)
    assert sorted(first + second) == sorted(f"k{i}" for i in range(1000))
