"""The settles a PostgreSQL store announces, heard by one listening connection per store
(design.md §4.8): the settle statement (and an operator's release or mark-sent) runs
``pg_notify('relay_settled', key)`` for each key whose attempt it ended, delivered when its
transaction commits; while some message of this process waits for a key, one pooled
connection is held and LISTENs on that channel, whatever the number waiting; it UNLISTENs
and goes back to the pool when the last one leaves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import asyncpg

from relay.core.errors import StoreError
from relay.core.interfaces import SettleWatch
from relay.store.postgres.calls import ERRORS
from relay.store.settled import KeyWaiters

log = logging.getLogger("relay.store.postgres")

SETTLED_CHANNEL = "relay_settled"
NOTIFY = f"SELECT pg_notify('{SETTLED_CHANNEL}', $1)"


class PostgresSettles:
    """The listening connection of one store over ``pool``; ``op_timeout_s`` (seconds)
    bounds taking the connection and its LISTEN."""

    def __init__(self, pool: asyncpg.Pool, op_timeout_s: float) -> None:
        self._pool = pool
        self._op_timeout_s = op_timeout_s
        self._conn: Any = None  # the pooled connection, while it listens
        self._lock = asyncio.Lock()
        self.waiters = KeyWaiters(subscribe=self._listen, unsubscribe=self._unlisten)

    def watching(self, keys: Sequence[str]) -> AbstractAsyncContextManager[SettleWatch]:
        """:meth:`relay.core.interfaces.FingerprintStore.watch_settles`."""
        return self.waiters.watching(keys)

    def _heard(self, conn: object, pid: int, channel: str, payload: object) -> None:
        del conn, pid, channel
        if isinstance(payload, str):
            self.waiters.notify(payload)

    async def _listen(self, keys: list[str]) -> None:
        del keys  # one channel for every key: the payload names it
        async with self._lock:
            if self._conn is not None:
                return
            try:
                async with asyncio.timeout(self._op_timeout_s):
                    conn = await self._pool.acquire()
                    try:
                        await conn.add_listener(SETTLED_CHANNEL, self._heard)
                    except BaseException:
                        await self._pool.release(conn)
                        raise
            except (*ERRORS, TimeoutError) as exc:
                raise StoreError("watch", f"LISTEN failed: {exc!r}") from exc
            self._conn = conn

    async def _unlisten(self, keys: list[str]) -> None:
        del keys
        async with self._lock:
            if self._conn is None or self.waiters.keys:
                return
            conn, self._conn = self._conn, None
            try:
                async with asyncio.timeout(self._op_timeout_s):
                    await conn.remove_listener(SETTLED_CHANNEL, self._heard)
                    await self._pool.release(conn)
            except (*ERRORS, TimeoutError) as exc:
                conn.terminate()
                raise StoreError("watch", f"UNLISTEN failed: {exc!r}") from exc

    async def close(self) -> None:
        """Give the connection back (the pool closes it), else end it. Never raises."""
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                async with asyncio.timeout(self._op_timeout_s):
                    await conn.remove_listener(SETTLED_CHANNEL, self._heard)
                    await self._pool.release(conn)
            except (*ERRORS, TimeoutError):
                conn.terminate()
