"""The PostgreSQL store's statements end within the relay's bound, read only what they need,
and connect as a pooler accepts.

- A reserve that waited for a pooled connection has ended in the server before the relay gives
  up and releases what it may have taken: no orphan PENDING keeps the key for a lease.
- The in-doubt count (every relay runs it every 30 s; ``in-doubt`` too) reads the ledger's
  in-doubt rows through its partial index, not the whole ledger (measured: 400000 rows take
  80-140 ms warm without it), so ``DedupRelayInDoubtUnresolved`` is not silenced on a big
  ledger by the ledger sessions' ``statement_timeout``.
- The store's connections send only the startup parameters PgBouncer tracks (it refuses any
  other, such as ``statement_timeout``, with ``unsupported startup parameter``): the test
  reads the startup message the store's pool sends through a sniffing proxy.

Each test works in a private schema of the shared server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from relay.core.errors import StoreError
from relay.core.interfaces import Settle, SettleOp
from relay.store.postgres import ledger as ledger_module
from relay.store.postgres import migrations
from relay.store.postgres.store import PostgresStore
from tests.support.postgres import POSTGRES_URL, private_schema, run_apart

_L = "dedup_relay_ledger"


async def _upgrade_ledger(url: str) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await migrations.upgrade(conn, "ledger")
    finally:
        await conn.close()


@pytest.fixture
def url() -> Iterator[str]:
    """A private schema with the store's and the ledger's tables."""
    with private_schema() as url:
        run_apart(_upgrade_ledger(url))
        yield url


async def _uncommitted_insert(url: str, key: str) -> tuple[asyncpg.Connection, Any]:
    """A connection whose open transaction inserted a PENDING row under ``key`` (another
    relay's reserve, not yet committed); returns it and its transaction."""
    conn = await asyncpg.connect(url, timeout=10)
    tx = conn.transaction()
    await tx.start()
    await conn.execute("INSERT INTO dedup_relay_fingerprints (key, state, token, expires_at) "
                       "VALUES ($1, 'pending', 'other', now() + interval '1 minute')", key)
    return conn, tx


async def test_a_reserve_that_waited_for_its_connection_leaves_no_orphan(url: str) -> None:
    """Pool of one connection, op timeout 2 s. A reserve of k:busy holds the connection for
    0.9 s (it waits for another relay's uncommitted k:busy); the reserve of k:x waits for the
    connection meanwhile, then for another relay's uncommitted insert of k:x, and times out
    (StoreError at 2 s). The core then releases k:x with its token (compare-token), as
    ``DedupCore._relay_dedup`` does, and the other relay's transaction rolls back. No PENDING
    of the failed attempt may be left: its client was answered 451 and its retry must not be
    told 450 for a lease."""
    store = await PostgresStore.open(url, op_timeout_s=2.0, pool_size=1,
                                     cleanup_interval_s=None)
    busy_conn, busy_tx = await _uncommitted_insert(url, "k:busy")
    x_conn, x_tx = await _uncommitted_insert(url, "k:x")
    check = await asyncpg.connect(url, timeout=10)
    try:
        busy = asyncio.ensure_future(store.reserve(["k:busy"], token="A", lease_s=60.0))
        await asyncio.sleep(0.1)  # busy holds the pool's one connection
        failed = asyncio.ensure_future(store.reserve(["k:x"], token="B", lease_s=60.0))
        # failed waits for the connection past its share of the bound (0.4 x 2 s: it gives
        # up before its statement is sent); busy's statement waited 0.9 s, under its
        # statement_timeout (0.5 x 2 s)
        await asyncio.sleep(0.8)
        await busy_tx.rollback()
        [took] = await busy
        assert took.reserved
        with pytest.raises(StoreError):
            await failed
        # DedupCore: store reserve failed -> release_quietly (compare-token)
        assert await store.settle([SettleOp(key="k:x", action=Settle.RELEASE)], token="B",
                                  window_s=60.0) == [False]
        await x_tx.rollback()  # the other relay's reserve failed: its insert is gone
        await asyncio.sleep(1.2)  # any orphan's statement_timeout (1 s) has passed
        left = await check.fetchrow(
            "SELECT state, token FROM dedup_relay_fingerprints WHERE key = 'k:x'")
        assert left is None, f"an orphan of the failed reserve holds k:x: {dict(left)}"
    finally:
        for conn in (busy_conn, x_conn, check):
            with contextlib.suppress(Exception):
                await conn.close()
        await store.close()


def _ledger_rows_read(plan: Any) -> int:
    """Rows the plan ``plan`` (EXPLAIN ANALYZE, FORMAT JSON) read from the ledger as its
    outer relation ``u``: returned plus removed by its filter, times its loops."""
    total = 0
    stack = [plan[0]["Plan"]]
    while stack:
        node = stack.pop()
        if node.get("Relation Name") == _L and node.get("Alias") == "u":
            total += int((node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0))
                         * node.get("Actual Loops", 1))
        stack.extend(node.get("Plans", []))
    return total


async def test_the_in_doubt_count_reads_the_in_doubt_rows_not_the_whole_ledger(
        url: str) -> None:
    """20000 settled rows (relayed, suppressed: what a ledger is made of) and one unresolved
    ``unknown`` row: the gauge's count finds the one, and its plan may read at most a few
    hundred of the ledger's rows (the in-doubt ones), not all of them."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(
            "INSERT INTO dedup_relay_ledger "
            "(row_id, decided_at, action, outcome, store_key, recipient) "
            "SELECT gen_random_uuid(), now() - interval '2 days' + i * interval '1 ms', "
            "'decide', CASE WHEN i % 2 = 0 THEN 'relayed' ELSE 'suppressed' END, "
            "'k:' || (i / 2), 'u***@example.net' FROM generate_series(1, 20000) AS i")
        await conn.execute(
            "INSERT INTO dedup_relay_ledger "
            "(row_id, decided_at, action, outcome, store_key, recipient) "
            "VALUES (gen_random_uuid(), now() - interval '1 day', 'decide', 'unknown', "
            "'k:doubt', 'u***@example.net')")
        await conn.execute("ANALYZE dedup_relay_ledger")
        assert await conn.fetchval(ledger_module.COUNT_UNRESOLVED, 3_600_000) == 1
        plan = json.loads(await conn.fetchval(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + ledger_module.COUNT_UNRESOLVED, 3_600_000))
        read = _ledger_rows_read(plan)
        assert read <= 500, f"the in-doubt count read {read} ledger rows for 1 in doubt"
    finally:
        await conn.close()


_SSL_REQUEST = 80877103
_GSS_REQUEST = 80877104
POOLER_PARAMETERS = frozenset({"user", "database", "client_encoding", "datestyle", "timezone",
                               "standard_conforming_strings", "application_name"})
"""The startup parameters PgBouncer accepts without ``ignore_startup_parameters`` (its tracked
parameters, plus the connection's own user and database)."""


class _StartupSniffer:
    """A TCP proxy on a free loopback port in front of ``host:port`` that records the names of
    the parameters of every StartupMessage a client sends (``names``)."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self.names: list[set[str]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_reader, up_writer = await asyncio.open_connection(*self._target)
        try:
            while True:  # SSLRequest / GSSENCRequest (refused by the server: sslmode), then
                head = await reader.readexactly(8)  # the StartupMessage
                length, code = struct.unpack("!ii", head)
                body = await reader.readexactly(length - 8)
                up_writer.write(head + body)
                await up_writer.drain()
                if code in (_SSL_REQUEST, _GSS_REQUEST):
                    writer.write(await up_reader.readexactly(1))  # 'N'
                    await writer.drain()
                    continue
                fields = body.split(b"\0")
                self.names.append({f.decode().lower() for f in fields[0:-2:2]})
                break
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            up_writer.close()
            self._tasks.discard(task)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


async def test_the_store_connects_with_only_the_startup_parameters_a_pooler_accepts() -> None:
    """The store's pool, on a URL without query parameters of its own, sends a StartupMessage
    whose parameters PgBouncer accepts in its default configuration."""
    parts = urlsplit(POSTGRES_URL)
    sniffer = _StartupSniffer(parts.hostname or "127.0.0.1", parts.port or 5432)
    await sniffer.start()
    user = parts.username or "postgres"
    url = f"postgresql://{user}@127.0.0.1:{sniffer.port}{parts.path}?sslmode=disable"
    store = await PostgresStore.open(url, op_timeout_s=2.0, check_schema=False,
                                     cleanup_interval_s=None)
    try:
        await store.ping()
        assert sniffer.names, "no StartupMessage seen"
        refused = set().union(*sniffer.names) - POOLER_PARAMETERS
        assert not refused, f"startup parameters PgBouncer refuses: {sorted(refused)}"
    finally:
        await store.close()
        await sniffer.close()
