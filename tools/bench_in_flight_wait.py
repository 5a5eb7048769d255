"""Benchmark: what copies waiting for another attempt (``in_flight_wait``, docs/design.md §4.8)
cost the store, counted at the store.

    .venv/bin/python tools/bench_in_flight_wait.py --messages 100 --hold 1 4

For each store (a private ``redis-server`` started here, a new SQLite file, a new PostgreSQL
database on ``--postgres``) and each layout (``one key``: every message the same key; ``many
keys``: each message its own key), the keys are first reserved by another attempt (another
token); ``--messages`` messages then go through one core (:func:`relay.ops.observed.
observed_core`, an upstream in this process that accepts everything) at once and wait; after
``--hold`` seconds the other attempt settles its keys SENT (one settle call) and every message
is answered (messages start in batches of 20, 0.1 s apart, all waiting before the settle).
The same is run with ``in_flight_wait = 0`` (every copy answered 450 at once, no
wait): the difference, divided by the messages, is what a waiting message costs the store.

Counted: Redis, the calls of every command (``INFO commandstats``, scripts' inner calls
included); SQLite, the statements run on the store's connection (its trace callback);
PostgreSQL, the transactions of the database (``pg_stat_database``: each statement of the store
is one, LISTEN and UNLISTEN too; read once the store's connections closed, so that they flushed
their counts). Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from relay.core.dedup import DedupCore, InboundMessage, Policy
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    FingerprintStore,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    Settle,
    SettleOp,
    SmtpReply,
)
from relay.core.keys import recipient_keys
from relay.ops.metrics import PrometheusMetrics
from relay.ops.observed import observed_core
from relay.store.postgres import migrations
from relay.store.postgres.store import PostgresStore
from relay.store.redis.store import RedisStore
from relay.store.sqlite.store import SqliteStore

OTHER = "the-other-attempt"
BATCH, BATCH_GAP_S = 20, 0.1  # messages started together, and the pause between two batches
OP_TIMEOUT_S = 5.0
RCPT = "user@example.net"
Counter = Callable[[], Awaitable[collections.Counter[str]]]


class AcceptAll:
    """An upstream that accepts every recipient at once."""

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        if progress is not None:
            progress.dot_written = True
        ok = SmtpReply(250, "2.0.0", "ok")
        return DeliveryResult({r: RcptResult(RcptStatus.ACCEPTED, ok) for r in message.rcpt_tos},
                              final_reply=ok)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


def content(key: str) -> bytes:
    return (f"From: app@example.com\r\nTo: {RCPT}\r\nSubject: bench\r\nX-Template: bench\r\n"
            f"X-Dedupe-Key: {key}\r\n\r\nhello\r\n").encode()


async def run_once(store: FingerprintStore, *, messages: int, many_keys: bool, hold_s: float,
                   wait_s: float) -> collections.Counter[str]:
    """One run; returns the replies by code."""
    policy = Policy(key_prefix="bench:", in_flight_wait_s=wait_s)
    core: DedupCore = observed_core(store=store, upstream=AcceptAll(), policy=policy,
                                    metrics=PrometheusMetrics(registry=CollectorRegistry()))[0]
    run = uuid.uuid4().hex
    dedupe = [f"K-{run}-{i if many_keys else 0}" for i in range(messages)]
    keys = list(dict.fromkeys(
        next(iter(recipient_keys([RCPT], "bench", d, policy, None).values())) for d in dedupe))
    await store.reserve(keys, token=OTHER, lease_s=900.0)
    tasks = []
    for i, d in enumerate(dedupe):  # in batches: a burst past the store's pool is not measured
        if i % BATCH == 0:
            await asyncio.sleep(BATCH_GAP_S)
        tasks.append(asyncio.ensure_future(core.process(InboundMessage(
            mail_from="app@example.com", rcpt_tos=[RCPT], content=content(d),
            queue_id=str(i)))))
    await asyncio.sleep(hold_s)
    await store.settle([SettleOp(k, Settle.SENT, reply="250 ok") for k in keys], token=OTHER,
                       window_s=3600.0)
    decisions = await asyncio.gather(*tasks)
    return collections.Counter(str(d.reply.code) for d in decisions)


@contextlib.asynccontextmanager
async def redis_store() -> AsyncIterator[tuple[FingerprintStore, Counter]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = shutil.which("redis-server") or "redis-server"
    proc = subprocess.Popen([server, "--port", str(port), "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    client = aredis.Redis(port=port)
    try:
        for _ in range(100):
            with contextlib.suppress(OSError, aredis.ConnectionError):
                await client.ping()
                break
            await asyncio.sleep(0.05)

        async def count() -> collections.Counter[str]:
            stats = await client.info("commandstats")
            return collections.Counter({k.removeprefix("cmdstat_"): int(v["calls"])
                                        for k, v in stats.items()})

        store = RedisStore.from_url(f"redis://127.0.0.1:{port}/0", op_timeout_s=OP_TIMEOUT_S)
        yield store, count
        await store.close()
    finally:
        await client.aclose()
        proc.terminate()
        proc.wait()


@contextlib.asynccontextmanager
async def sqlite_store() -> AsyncIterator[tuple[FingerprintStore, Counter]]:
    with tempfile.TemporaryDirectory() as tmp:
        store = await SqliteStore.open(str(Path(tmp) / "fp.sqlite3"), op_timeout_s=OP_TIMEOUT_S)
        statements: collections.Counter[str] = collections.Counter()

        def traced(sql: str) -> None:
            statements[sql.split(None, 1)[0].upper()] += 1

        store._writer.conn.set_trace_callback(traced)  # type: ignore[union-attr]

        async def count() -> collections.Counter[str]:
            return collections.Counter(statements)

        yield store, count
        await store.close()


@contextlib.asynccontextmanager
async def postgres_store(url: str) -> AsyncIterator[tuple[FingerprintStore, Counter]]:
    name = f"bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(url)
    await admin.execute(f"CREATE DATABASE {name}")
    db_url = url.rsplit("/", 1)[0] + f"/{name}"
    try:
        conn = await asyncpg.connect(db_url)
        await migrations.upgrade(conn, "store")
        await conn.close()
        holder: dict[str, FingerprintStore] = {}

        async def count() -> collections.Counter[str]:
            # the store's connections report their counts when they end: close, then reopen
            await holder["store"].close()
            await asyncio.sleep(1.5)
            await admin.execute("SELECT pg_stat_clear_snapshot()")
            row = await admin.fetchrow("SELECT xact_commit + xact_rollback AS n "
                                       "FROM pg_stat_database WHERE datname = $1", name)
            holder["store"] = await PostgresStore.open(db_url, cleanup_interval_s=None,
                                                   op_timeout_s=OP_TIMEOUT_S)
            return collections.Counter({"transactions": int(row["n"]) if row else 0})

        holder["store"] = await PostgresStore.open(db_url, cleanup_interval_s=None,
                                                   op_timeout_s=OP_TIMEOUT_S)

        class Current:
            def __getattr__(self, attr: str) -> Any:
                return getattr(holder["store"], attr)

        yield Current(), count
        await holder["store"].close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


async def measure(opened: contextlib.AbstractAsyncContextManager[
        tuple[FingerprintStore, Counter]], label: str, args: argparse.Namespace) -> None:
    async with opened as (store, count):
        for many in (False, True):
            for hold_s in args.hold:
                costs = []
                for wait_s in (0.0, 30.0):
                    before = await count()
                    started = time.monotonic()
                    replies = await run_once(store, messages=args.messages, many_keys=many,
                                             hold_s=hold_s, wait_s=wait_s)
                    elapsed = time.monotonic() - started
                    after = await count()
                    used = after - before
                    costs.append(used)
                    print(f"{label:10} {'many keys' if many else 'one key':9} hold {hold_s:g} s "
                          f"wait {wait_s:4g} s: {dict(replies)} in {elapsed:.1f} s; "
                          f"{sum(used.values())} commands: {dict(used)}")
                extra = costs[1] - costs[0]
                each = ", ".join(f"{k} {v / args.messages:.2f}" for k, v in sorted(extra.items()))
                print(f"{'':10} per waiting message: {sum(extra.values()) / args.messages:.2f} "
                      f"commands ({each})")


async def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=100)
    parser.add_argument("--hold", type=float, nargs="+", default=[1.0, 4.0],
                        help="seconds the other attempt holds its keys")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--stores", nargs="+", default=["redis", "sqlite", "postgresql"])
    args = parser.parse_args(argv)
    if "redis" in args.stores and shutil.which("redis-server"):
        await measure(redis_store(), "redis", args)
    if "sqlite" in args.stores:
        await measure(sqlite_store(), "sqlite", args)
    if "postgresql" in args.stores:
        await measure(postgres_store(args.postgres), "postgresql", args)


if __name__ == "__main__":
    asyncio.run(main())
