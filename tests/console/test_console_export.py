"""The console's CSV export while its client reads slowly, over a raw socket against an
in-process relay and a real PostgreSQL ledger: the ledger's connection holds no transaction
(and so no snapshot that keeps VACUUM from removing dead rows) while the download waits, and
the file is whole once the client reads on."""

from __future__ import annotations

import asyncio
import socket
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from yarl import URL

from relay.core.interfaces import LedgerEntry
from relay.store.postgres.ledger import LedgerOptions, insert_rows, row_of
from tests.support.console import VIEWER, VIEWER_PASSWORD, Browser, console_relay, opened
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.timeout(90)

ROWS = 20_000  # ~8 MB of CSV: more than the socket buffers between the relay and the client
EXPORT_BACKENDS = """
SELECT state, backend_xmin::text AS xmin, backend_xid::text AS xid FROM pg_stat_activity
WHERE pid <> pg_backend_pid() AND datname = current_database()
  AND (query LIKE 'FETCH%dedup_relay_export%' OR query LIKE '%decided_at < $2%')
"""


def unchunked(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body (RFC 9112 section 7.1), up to its last
    chunk."""
    out, at = bytearray(), 0
    while True:
        end = body.index(b"\r\n", at)
        size = int(body[at:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2:end + 2 + size]
        at = end + 2 + size + 2


async def test_a_slow_download_holds_no_ledger_transaction(
        ledger_url: str, make_relay: MakeRelay, sink: Sink, tmp_path: Path,
        web: list[Browser]) -> None:
    """A client that reads the first bytes of a 20,000-row export and then stops reading:
    while the export waits on it, the ledger connection that reads the rows is idle, outside
    any transaction and without a snapshot (VACUUM may remove dead rows); when the client
    reads on, the file holds every row. (``ledger_url`` comes first: its schema is dropped
    after the relay stopped, whatever the export held.)"""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url)
    assert relay.console is not None
    start = datetime(2026, 5, 1, tzinfo=UTC)
    conn = await asyncpg.connect(ledger_url, timeout=10)
    opened_sockets: list[asyncio.StreamWriter] = []
    try:
        await insert_rows(conn, [row_of(LedgerEntry(
            decided_at=(start + timedelta(milliseconds=i)).timestamp(), outcome="relayed",
            recipient=f"user{i}@example.net", reply="250 " + "x" * 300),
            LedgerOptions(instance="relay-a/1")) for i in range(ROWS)])
        b = opened(web, relay)
        await b.sign_in(VIEWER, VIEWER_PASSWORD)
        cookie = b.http.cookie_jar.filter_cookies(URL(b.base))["dedup_relay_session"].value
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # no window to grow
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1",
                                                               relay.console.port))
        reader, writer = await asyncio.open_connection(sock=client, limit=4096)
        opened_sockets.append(writer)
        writer.write(f"GET /export.csv?from=2026-05-01&to=2026-05-02 HTTP/1.1\r\n"
                     f"Host: x\r\nCookie: dedup_relay_session={cookie}\r\n"
                     f"Connection: close\r\n\r\n".encode())
        received = await reader.read(1000)
        assert received.startswith(b"HTTP/1.1 200")
        reader._transport.pause_reading()  # type: ignore[attr-defined]  # stop reading
        deadline = time.monotonic() + 10
        while not await conn.fetch(EXPORT_BACKENDS):
            assert time.monotonic() < deadline, "no export is reading the ledger"
            await asyncio.sleep(0.05)
        # the export blocks on the client once the socket buffers are full: its backend stays
        # out of any statement (two looks 0.5 s apart; a loaded runner fetches slowly, idle
        # between batches); an export that held a transaction would never read "idle"
        deadline, idle_looks = time.monotonic() + 30, 0
        while idle_looks < 2:
            assert time.monotonic() < deadline, "the export never waited on the client"
            await asyncio.sleep(0.5)
            backends = await conn.fetch(EXPORT_BACKENDS)
            idle_looks = idle_looks + 1 if all(b["state"] == "idle" for b in backends) else 0
        for backend in backends:
            assert (backend["state"], backend["xmin"], backend["xid"]) == ("idle", None, None)
        reader._transport.resume_reading()  # type: ignore[attr-defined]
        received += await asyncio.wait_for(reader.read(), 60)
    finally:
        for each in opened_sockets:
            each.close()
        await conn.close()
    body = unchunked(received.split(b"\r\n\r\n", 1)[1]).decode()
    lines = body.split("\r\n")
    assert lines[0].startswith("decided_at,") and lines[-1] == ""
    assert len(lines) == ROWS + 2 and "incomplete" not in body
