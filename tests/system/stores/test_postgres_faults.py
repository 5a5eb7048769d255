"""The fault bench on the PostgreSQL store: a real `python -m relay serve` process
(two workers) whose ``--store`` is a private PostgreSQL server the run owns
(tests/support/private_postgres.py: fsync and synchronous_commit on, the store's schema from
``dedup-relay db upgrade``), a faulty aiosmtpd sink, 40 messages from clients that retry like
MTAs, and PostgreSQL restarted, stopped or killed mid-load (bench/faultbench/scenarios.py;
the long run is ``tools/faultbench.py --only pg-restart,pg-down,pg-sigkill``).

Each test asserts design.md §1 as the checker counts it per fingerprint (no duplicate outside
UNKNOWN, nothing answered 250 and lost, every message ended before the deadline), and that the
relay failed closed while the database was away (``store_down = fail_closed``: 451 4.3.0, the
client retries) and relayed again once it was back. The shared server on 5432 is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from bench.faultbench.lib import Faults, RelayConfig, RelayProcess, free_port
from bench.faultbench.lib import start_sink as start_bench_sink
from bench.faultbench.scenarios import RunResult, evidence, run_scenario, scenarios
from bench.faultbench.traffic import make_messages, send_once
from relay.core.errors import StoreError
from relay.core.interfaces import Settle, SettleOp
from relay.store.postgres.store import PostgresStore
from tests.support.postgres import private_schema

pytestmark = pytest.mark.slow  # a PostgreSQL server and relay processes under load

MESSAGES = 40
SPREAD_S = 1.5  # the messages arrive evenly over this time; the fault comes at 40 % of it
DEADLINE_S = 30.0  # every client must have its 2yz/5yz by then
PG_DOWN_S = 3.0

SCENARIOS = {s.name: s for s in scenarios(pg_down_s=PG_DOWN_S)}


async def run(name: str, workdir: Path) -> RunResult:
    """Run one scenario of the bench and print its counts."""
    result = await run_scenario(SCENARIOS[name], messages=MESSAGES, workdir=workdir,
                                spread_s=SPREAD_S, deadline_s=DEADLINE_S)
    print(result.line())
    return result


def report(result: RunResult) -> str:
    """The counts, the fingerprints concerned and what the relay logged about them."""
    return "\n".join([result.line(), f"marks={result.marks}", *evidence(result)])


def assert_invariant(result: RunResult) -> None:
    """0 duplicates outside UNKNOWN, 0 accepted-but-lost, every message ended in time; any
    fingerprint missing at the sink is one whose client was told it is in doubt."""
    c = result.counts
    assert (c.dup_outside, c.accepted_lost, c.unfinished, c.stray_copies) == (0, 0, 0, 0), (
        report(result))
    assert c.copies + c.unknown >= c.fingerprints >= c.copies, report(result)


def assert_relayed_after_the_fault(result: RunResult) -> None:
    """The sink took copies after PostgreSQL was back (unix time ``marks['store back']``)."""
    back = result.marks["store back"]
    lines = (result.workdir / "sink.jsonl").read_text(encoding="utf-8").splitlines()
    assert any(json.loads(line)["t"] > back for line in lines), report(result)


async def test_postgres_restart_mid_load_keeps_the_invariant(tmp_path: Path) -> None:
    """`pg_ctl restart -m fast` mid-load (every pooled connection dropped): the messages that
    meet the restart are answered 451 4.3.0 (about 7 arrive in its 0.25 s), no duplicate, no
    loss, and the relay relays again on new connections once the server is back."""
    result = await run("pg-restart", tmp_path)
    assert_invariant(result)
    assert result.counts.replies["451 4.3.0"] > 0, report(result)
    assert_relayed_after_the_fault(result)


async def test_postgres_stopped_3s_mid_load_fails_closed_and_keeps_the_invariant(
        tmp_path: Path) -> None:
    """`pg_ctl stop -m immediate` for 3 s mid-load, then started (crash recovery): clients are
    told 451 4.3.0 while it is down, retry, and each message is delivered once after."""
    result = await run("pg-down", tmp_path)
    assert_invariant(result)
    assert result.counts.replies["451 4.3.0"] > 0, report(result)
    assert_relayed_after_the_fault(result)


async def test_postgres_postmaster_sigkill_mid_load_keeps_the_invariant(
        tmp_path: Path) -> None:
    """SIGKILL to the postmaster mid-load (its backends exit, no shutdown at all), then started:
    clients are told 451 4.3.0 meanwhile, and no committed record is lost (fsync on): no
    duplicate, no loss, relaying resumes."""
    result = await run("pg-sigkill", tmp_path)
    assert_invariant(result)
    assert result.counts.replies["451 4.3.0"] > 0, report(result)
    assert_relayed_after_the_fault(result)


# ------------------------------------------------------------------------------------------
# A server shutdown reaching an idle pooled connection
# ------------------------------------------------------------------------------------------

# What a backend writes to its client as a fast shutdown (pg_ctl restart/stop -m fast) or
# pg_terminate_backend begins: an ErrorResponse, FATAL, SQLSTATE 57P01 admin_shutdown; then the
# backend closes its socket. In between, asyncpg has read the message and the connection is in
# its PROTOCOL_ERROR_CONSUME state, not yet closed, and the pool still hands it out.
_FIELDS = {b"S": b"FATAL", b"V": b"FATAL", b"C": b"57P01",
           b"M": b"terminating connection due to administrator command"}
_BODY = b"".join(k + v + b"\0" for k, v in _FIELDS.items()) + b"\0"
ADMIN_SHUTDOWN = b"E" + struct.pack("!I", 4 + len(_BODY)) + _BODY


class ShutdownProxy:
    """A TCP proxy to PostgreSQL that can hold a server shutdown at its first step:
    :meth:`announce_shutdown` writes :data:`ADMIN_SHUTDOWN` to every client connection open at
    that moment and forwards nothing more from their backends, the sockets left open (the
    window between a backend's FATAL message and its close, made as long as a test needs).
    Connections made afterwards are proxied as usual."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._clients: list[tuple[asyncio.StreamWriter, list[bool]]] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]
        muted = [False]
        self._clients.append((writer, muted))
        for task in (self._pump(reader, up_writer, [False]), self._pump(up_reader, writer, muted)):
            t = asyncio.create_task(task)
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    muted: list[bool]) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await src.read(65536):
                if not muted[0]:
                    dst.write(data)
                    await dst.drain()

    async def announce_shutdown(self) -> int:
        """Send the shutdown message on every open client connection; how many."""
        sent = 0
        for writer, muted in self._clients:
            if not muted[0] and not writer.is_closing():
                muted[0] = True
                writer.write(ADMIN_SHUTDOWN)
                try:
                    await writer.drain()
                except ConnectionError:  # the relay closed that one meanwhile
                    continue
                sent += 1
        return sent

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


def through(url: str, proxy: ShutdownProxy) -> str:
    """``url`` (a postgresql:// URL on 127.0.0.1) with the proxy's port instead."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.username}@127.0.0.1:{proxy.port}"))


@pytest.fixture
def schema_url() -> Iterator[str]:
    """A private schema with the store's tables, on the shared test server."""
    with private_schema() as url:
        yield url


@pytest.fixture
async def proxy(schema_url: str) -> AsyncIterator[ShutdownProxy]:
    """A :class:`ShutdownProxy` in front of the shared test server."""
    p = ShutdownProxy(urlsplit(schema_url).port or 5432)
    await p.start()
    yield p
    await p.close()


async def test_a_shutdown_message_on_an_idle_pooled_connection_is_a_store_error(
        proxy: ShutdownProxy, schema_url: str) -> None:
    """A store call on a pooled connection whose backend has announced a shutdown fails as
    :class:`StoreError` (the Protocol's only error), so the relay's callers handle it."""
    store = await PostgresStore.open(through(schema_url, proxy), cleanup_interval_s=None)
    try:
        [held] = await store.reserve(["k1"], token="t1", lease_s=30)
        assert held.reserved
        assert await proxy.announce_shutdown() == 1
        await asyncio.sleep(0.1)  # the message reached asyncpg
        with pytest.raises(StoreError):
            await store.settle([SettleOp(key="k1", action=Settle.SENT, reply="250 ok")],
                               token="t1", window_s=60)
    finally:
        await store.close()


async def test_a_shutdown_while_the_upstream_holds_its_reply_keeps_the_250(
        proxy: ShutdownProxy, schema_url: str, tmp_path: Path) -> None:
    """PostgreSQL announces its shutdown while the upstream holds its reply to the final dot:
    the relay still answers the upstream's 250 and the record ends SENT (landed on a new
    connection), as on any other store failure after a definite upstream reply."""
    sink = await start_bench_sink(Faults(), tmp_path / "sink.jsonl")
    relay = RelayProcess(port=free_port(), upstream_port=sink.port,
                         store_url=through(schema_url, proxy), store_prefix="sd:",
                         log_path=tmp_path / "relay.log", config=RelayConfig(workers=1))
    try:
        await relay.start()
        [msg] = make_messages(1, "shutdown", two_rcpt_every=0)
        taken = sink.handler.hold_next(0.5)  # under the upstream timeout (1 s)
        sending = asyncio.create_task(send_once(relay.port, msg, timeout_s=10))
        await asyncio.wait_for(taken.wait(), 10)
        assert await proxy.announce_shutdown() >= 1
        attempt = await sending
        await asyncio.sleep(1.5)  # an owed SENT mark has its background retries
    finally:
        await relay.stop()
        sink.close()
    conn = await asyncpg.connect(schema_url, timeout=10)
    try:
        states = [r["state"] for r in await conn.fetch("SELECT state FROM "
                                                       "dedup_relay_fingerprints")]
    finally:
        await conn.close()
    log = (tmp_path / "relay.log").read_text(errors="replace")[-3000:]
    assert (attempt.code, states) == (250, ["sent"]), (attempt, states, log)
