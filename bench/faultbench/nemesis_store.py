"""The nemesis's store (``bench.faultbench.nemesis``): a bench-owned redis-server or PostgreSQL
server behind a proxy that can hold every byte (a black hole, not a refusal), or a SQLite file
whose write lock another process can take, each able to take a fault and heal from it.

Faults of one kind are counted (``down``, ``held``), so overlapping ones compose: the server
comes back when its last outage ends, the proxy passes bytes again when its last partition
ends. A fault that cannot apply (a restart of a server already stopped) returns False.
Loopback only; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sqlite3
from dataclasses import dataclass, field

from bench.faultbench.lib import BenchPostgres, BenchRedis, BenchSqlite, _end
from tests.support.pg_proxy import PgProxy


@dataclass
class StoreControl:
    """The run's store and, for a server, the proxy the relays reach it through.

    ``direct_url`` is the server itself (the bench reads the final records there),
    ``url`` what the relays use (the proxy for Redis and PostgreSQL). Whatever starts, stops
    or kills the server or takes the file's lock runs one at a time (a restart still under way
    when an outage begins would race its stop).
    """

    store: BenchRedis | BenchPostgres | BenchSqlite
    proxy: PgProxy | None = None
    down: int = 0
    held: int = 0
    _lock: sqlite3.Connection | None = None
    _ops: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def direct_url(self) -> str:
        return self.store.url

    @property
    def url(self) -> str:
        if self.proxy is None:
            return self.store.url
        if isinstance(self.store, BenchRedis):
            return f"redis://127.0.0.1:{self.proxy.port}/0"
        return self.proxy.url(self.store.url)

    async def start(self) -> None:
        """Start the store and, for a server, its proxy."""
        await self.store.start()
        if not isinstance(self.store, BenchSqlite):
            port = (self.store.port if isinstance(self.store, BenchRedis)
                    else _port_of(self.store.url))
            self.proxy = PgProxy("127.0.0.1", port)
            await self.proxy.start()

    async def take_down(self) -> bool:
        """Stop the server (its first outage stops it; Redis: SIGTERM, PostgreSQL: ``-m
        fast``); False for SQLite."""
        if isinstance(self.store, BenchSqlite):
            return False
        async with self._ops:
            self.down += 1
            if self.down == 1:
                await self.store.stop()
        return True

    async def bring_up(self) -> None:
        """End one outage; the last one starts the server again on its data."""
        async with self._ops:
            self.down = max(0, self.down - 1)
            if self.down == 0:
                await self.store.start()

    async def restart(self) -> bool:
        """Restart a running server (PostgreSQL: ``pg_ctl restart -m fast``); False when it
        is down or SQLite."""
        async with self._ops:
            if isinstance(self.store, BenchSqlite) or self.down:
                return False
            if isinstance(self.store, BenchPostgres):
                await self.store.restart("fast")
            else:
                await self.store.stop()
                await self.store.start()
        return True

    async def crash(self) -> bool:
        """SIGKILL to a running server (PostgreSQL: its postmaster); counts as an outage
        until :meth:`bring_up`. False when it is down or SQLite."""
        async with self._ops:
            if isinstance(self.store, BenchSqlite) or self.down:
                return False
            self.down += 1
            if isinstance(self.store, BenchPostgres):
                await self.store.kill()
            elif self.store.proc is not None:
                await _end(self.store.proc, signal.SIGKILL, 5)
                self.store.proc = None
        return True

    def partition(self) -> bool:
        """Hold every byte between the relays and the server (new connections hang too)."""
        if self.proxy is None:
            return False
        self.held += 1
        self.proxy.hang()
        return True

    def unpartition(self) -> None:
        """End one partition; the last one passes the held bytes on."""
        self.held = max(0, self.held - 1)
        if self.held == 0 and self.proxy is not None:
            self.proxy.resume()

    async def lock(self) -> bool:
        """SQLite: take the file's write lock from another connection and keep it (the
        first of overlapping locks); False for a server. Raises sqlite3.Error when the lock
        could not be had within 10 s."""
        if not isinstance(self.store, BenchSqlite):
            return False
        async with self._ops:
            if self.held == 0:
                self._lock = await asyncio.to_thread(_take_write_lock, self.store.url)
            self.held += 1
        return True

    async def unlock(self) -> None:
        """End one lock; the last one rolls its transaction back."""
        async with self._ops:
            self.held = max(0, self.held - 1)
            if self.held == 0 and self._lock is not None:
                conn, self._lock = self._lock, None
                await asyncio.to_thread(_release, conn)

    async def heal(self) -> None:
        """End every fault: the server running, the proxy passing bytes, no lock held."""
        if self.down:
            self.down = 1
            await self.bring_up()
        if self.proxy is not None:
            self.held = 0
            self.proxy.resume()
        if self._lock is not None:
            self.held = 1
            await self.unlock()

    async def close(self) -> None:
        """Stop the proxy and the server."""
        try:
            if self._lock is not None:
                await asyncio.to_thread(_release, self._lock)
            if self.proxy is not None:
                self.proxy.resume()
                await self.proxy.close()
        finally:
            await self.store.close()


def _port_of(url: str) -> int:
    return int(url.split("@", 1)[-1].split("/", 1)[0].rsplit(":", 1)[1])


def _take_write_lock(url: str) -> sqlite3.Connection:
    """A connection to the SQLite file of ``url`` inside ``BEGIN IMMEDIATE`` (the write
    lock), taken within 10 s (a relay's transaction may hold it a moment)."""
    conn = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=10.0,
                           isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def _release(conn: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        conn.execute("ROLLBACK")
    conn.close()

