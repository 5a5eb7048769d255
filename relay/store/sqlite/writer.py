"""Group commit for the SQLite store: one thread owns the connection and runs its callers' writes
in shared transactions, one ``BEGIN IMMEDIATE ... COMMIT`` (one fsync) per batch.

The thread takes whatever is queued when it is free (at most :data:`BATCH_LIMIT` operations), so
a batch is the calls that arrived while the previous one was committing: no call waits for a
batch to fill. Each write runs inside its own ``SAVEPOINT``: one that raises is rolled back alone
and fails alone, its batch-mates commit. A caller's future is resolved only after ``COMMIT``
returned (the batch is durable under ``synchronous = FULL``); a failed ``BEGIN`` or ``COMMIT``
fails the whole batch. Reads that need no transaction (``in_tx=False``) run between batches, in
queue order.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BATCH_LIMIT = 256
"""Most operations one transaction carries (bounds how long the write lock is held)."""

BUSY_POLL_MS = 2
"""The connection's busy timeout in ms: how long SQLite itself waits for a lock before
:func:`begin_immediate` tries again. SQLite's own wait sleeps up to 100 ms between tries, so
behind another process's stream of commits a writer could starve for the whole op timeout."""


def begin_immediate(conn: sqlite3.Connection, deadline: float) -> None:
    """``BEGIN IMMEDIATE`` (take the write lock), trying again every millisecond or so while
    another connection holds it, until ``deadline`` (``time.monotonic()``); then raises the
    sqlite3.OperationalError (database is locked)."""
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            if not locked(exc) or time.monotonic() >= deadline:
                raise
            pause(0.0005)


_NEVER_SET = threading.Event()


def pause(seconds: float) -> None:
    """Block this thread for ``seconds`` (a relative wait on the monotonic clock).

    Not :func:`time.sleep`: since Python 3.11 it sleeps until an absolute ``CLOCK_MONOTONIC``
    deadline (``clock_nanosleep(TIMER_ABSTIME)``), which libfaketime 0.9.10 (the ``faketime``
    that runs a process with its wall clock offset) answers EINVAL, so every sleep raised
    OSError. A wait on an event that is never set has no such call."""
    _NEVER_SET.wait(seconds)


def locked(exc: sqlite3.OperationalError) -> bool:
    """Whether ``exc`` is SQLITE_BUSY or SQLITE_LOCKED (another connection holds a lock)."""
    return exc.sqlite_errorcode & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def now_ms() -> int:
    """Wall-clock time in whole milliseconds since the epoch."""
    return int(time.time() * 1000)


@dataclass(eq=False)
class Op:
    """One queued call.

    ``fn`` is ``fn(conn, now_ms)`` for a write (``in_tx``: run inside the batch's transaction,
    ``now_ms`` read after the write lock was taken) and ``fn(conn, 0)`` for anything else (run
    alone, outside a transaction; ``conn`` is None before the connection exists). ``started``
    is resolved when its batch begins, ``done`` with ``fn``'s result or exception once the batch
    has committed.
    """

    fn: Callable[[Any, int], Any]
    in_tx: bool
    loop: asyncio.AbstractEventLoop
    started: asyncio.Future[None] = field(init=False)
    done: asyncio.Future[Any] = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.loop.create_future()
        self.done = self.loop.create_future()


_Outcome = tuple[Op, bool, Any]  # (op, succeeded, result or exception)
_STOP = None


def _start_all(ops: list[Op]) -> None:
    for op in ops:
        if not op.started.done():
            op.started.set_result(None)


def _finish_all(outcomes: list[_Outcome]) -> None:
    for op, ok, value in outcomes:
        if op.done.done():
            continue
        if ok:
            op.done.set_result(value)
        else:
            op.done.set_exception(value)


class Writer:
    """The thread that owns one :class:`sqlite3.Connection` and runs queued :class:`Op`.

    :meth:`submit` is called on the event loop; everything else runs in the thread. ``conn`` is
    set by the first op (the store's connect) and cleared by its disconnect.
    """

    def __init__(self, name: str, lock_wait_s: float) -> None:
        """Prepare the queue; the thread starts with the first :meth:`submit`. A batch waits
        at most ``lock_wait_s`` seconds for the write lock, then fails."""
        self.conn: sqlite3.Connection | None = None
        self._lock_wait_s = lock_wait_s
        self._queue: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def submit(self, op: Op) -> None:
        """Queue ``op`` (FIFO); starts the thread on first use."""
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()
        self._queue.put(op)

    def stop(self) -> None:
        """Let the thread end once the operations queued before this call are done."""
        self._queue.put(_STOP)

    # -- in the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            batch = [first]
            stop = False
            while len(batch) < BATCH_LIMIT:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                batch.append(item)
            self._run_batch(batch)
            if stop:
                return

    def _run_batch(self, batch: list[Op]) -> None:
        _post(_start_all, [(op.loop, op) for op in batch])
        writes: list[Op] = []
        for op in batch:
            if op.in_tx:
                writes.append(op)
                continue
            self._finish(self._commit(writes))
            writes = []
            self._finish([self._alone(op)])
        self._finish(self._commit(writes))

    def _finish(self, outcomes: list[_Outcome]) -> None:
        if outcomes:
            _post(_finish_all, [(o[0].loop, o) for o in outcomes])

    def _alone(self, op: Op) -> _Outcome:
        try:
            return (op, True, op.fn(self.conn, 0))
        except Exception as exc:  # handed to the caller, who translates it
            return (op, False, exc)

    def _commit(self, ops: list[Op]) -> list[_Outcome]:
        """Run ``ops`` in one transaction; their outcomes, all failed when the batch failed."""
        if not ops:
            return []
        conn = self.conn
        if conn is None:
            gone = sqlite3.ProgrammingError("the SQLite store is not open")
            return [(op, False, gone) for op in ops]
        try:
            begin_immediate(conn, time.monotonic() + self._lock_wait_s)
        except Exception as exc:
            return [(op, False, exc) for op in ops]
        try:
            outcomes = self._each(conn, ops)
            if any(ok for _, ok, _ in outcomes):
                conn.execute("COMMIT")
            else:
                conn.execute("ROLLBACK")
        except Exception as exc:
            if conn.in_transaction:
                _rollback(conn)
            return [(op, False, exc) for op in ops]
        return outcomes

    @staticmethod
    def _each(conn: sqlite3.Connection, ops: list[Op]) -> list[_Outcome]:
        """Each op under its own savepoint (none for a batch of one). Raises when an op's failure
        ended the transaction itself (its batch-mates' writes are gone with it)."""
        if len(ops) == 1:
            [op] = ops
            try:
                return [(op, True, op.fn(conn, now_ms()))]
            except Exception as exc:
                if not conn.in_transaction:
                    raise
                return [(op, False, exc)]
        outcomes: list[_Outcome] = []
        for op in ops:
            conn.execute("SAVEPOINT op")
            try:
                value = op.fn(conn, now_ms())
            except Exception as exc:
                if not conn.in_transaction:
                    raise
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                outcomes.append((op, False, exc))
                continue
            conn.execute("RELEASE op")
            outcomes.append((op, True, value))
        return outcomes


def _rollback(conn: sqlite3.Connection) -> None:
    # the transaction may be gone already; the batch fails with the first error
    with contextlib.suppress(sqlite3.Error):
        conn.execute("ROLLBACK")


def _post(callback: Callable[[list[Any]], None],
          items: list[tuple[asyncio.AbstractEventLoop, Any]]) -> None:
    """Run ``callback(its items)`` on each loop named in ``items`` (one wake-up per loop)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
    for loop, item in items:
        by_loop.setdefault(loop, []).append(item)
    for loop, mine in by_loop.items():
        # RuntimeError: that loop is closed, nobody awaits its futures any more
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback, mine)
