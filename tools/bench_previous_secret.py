"""Benchmark: what ``fingerprint_secret_previous`` costs each message (docs/design.md §2.3).

    .venv/bin/python tools/bench_previous_secret.py [--messages 300 --rounds 5]

For each store (the Redis of ``--redis`` under a prefix of its own, a new SQLite file, a new
schema of the PostgreSQL of ``--postgres``) ``--messages`` messages, one recipient and a new key
each, go one after another through one core (an upstream in this process that accepts
everything), without a previous secret and with one (no record is under its keys: the cost
every message pays while it is set; a record found there costs one more release, for a
duplicate only), the two alternating for ``--rounds`` rounds. Printed per message, the median
of the rounds: wall and process CPU time (microseconds), store calls (each one round trip: the
reserve, the SENDING mark, the SENT settle, and with a previous secret the read of the previous
keys, sent beside the reserve), and the mean latency of the reserve and of that read; then the
difference. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
from prometheus_client import CollectorRegistry

from relay.core.dedup import DedupCore, InboundMessage, Policy
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    FingerprintStore,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    Record,
    Reservation,
    SettleOp,
    SmtpReply,
)
from relay.ops.metrics import PrometheusMetrics
from relay.ops.ports import StoreWrapper
from relay.store.postgres import migrations
from relay.store.postgres.store import PostgresStore
from relay.store.redis.store import RedisStore
from relay.store.sqlite.store import SqliteStore

OK = SmtpReply(250, "2.0.0", "ok")
BODY = b"From: shop@shop.example\r\nSubject: Your receipt\r\nX-Template: receipt\r\n"


class Accepting:
    """An upstream that accepts every recipient at once (marking SENDING first)."""

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        if progress is not None and progress.before_dot is not None:
            assert await progress.before_dot(message.rcpt_tos)
        ok = RcptResult(RcptStatus.ACCEPTED, OK)
        return DeliveryResult(recipients=dict.fromkeys(message.rcpt_tos, ok), final_reply=OK)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


class Counted(StoreWrapper):
    """``inner`` with its calls counted and the reserve's and batch read's latency summed."""

    def __init__(self, inner: FingerprintStore) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)

    async def reserve(self, keys: Sequence[str], **options: Any) -> list[Reservation]:
        started = time.perf_counter()
        try:
            return await self.inner.reserve(keys, **options)
        finally:
            self.calls["reserve"] += 1
            self.seconds["reserve"] += time.perf_counter() - started

    async def inspect_many(self, keys: Sequence[str]) -> list[Record]:
        started = time.perf_counter()
        try:
            return await self.inner.inspect_many(keys)
        finally:
            self.calls["inspect_many"] += 1
            self.seconds["inspect_many"] += time.perf_counter() - started

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        self.calls["settle"] += 1
        return await self.inner.settle(ops, token=token, window_s=window_s)


@contextlib.asynccontextmanager
async def opened(kind: str, args: argparse.Namespace, workdir: Path
                 ) -> AsyncIterator[FingerprintStore]:
    """A store of ``kind`` for one run, closed (and its schema dropped) after it."""
    if kind == "redis":
        store: FingerprintStore = RedisStore.from_url(args.redis)
    elif kind == "sqlite":
        store = await SqliteStore.open(str(workdir / f"{uuid.uuid4().hex}.db"))
    else:
        schema = f"bench_{uuid.uuid4().hex}"
        conn = await asyncpg.connect(args.postgres)
        await conn.execute(f"CREATE SCHEMA {schema}")
        url = f"{args.postgres}?search_path={schema}"
        scoped = await asyncpg.connect(url)
        await migrations.upgrade(scoped, "store")
        await scoped.close()
        store = await PostgresStore.open(url, cleanup_interval_s=None)
    try:
        yield store
    finally:
        await store.close()
        if kind == "postgres":
            await conn.execute(f"DROP SCHEMA {schema} CASCADE")
            await conn.close()


async def run(store: FingerprintStore, previous: bool, messages: int) -> dict[str, float]:
    """``messages`` messages through one core over ``store``; per message figures."""
    counted = Counted(store)
    prefix = f"bench:{uuid.uuid4().hex}:"
    policy = Policy(key_prefix=prefix, secret=b"now", previous_secret=b"before" if previous
                    else None, in_flight_wait_s=0.0)
    core = DedupCore(store=counted, upstream=Accepting(), policy=policy,
                     metrics=PrometheusMetrics(registry=CollectorRegistry()))
    wall, cpu = time.perf_counter(), time.process_time()
    for n in range(messages):
        content = BODY + f"X-Dedupe-Key: order-{n}\r\n\r\nThanks.\r\n".encode()
        decision = await core.process(InboundMessage(
            mail_from="shop@shop.example", rcpt_tos=["jane@example.net"], content=content,
            queue_id=f"q{n}"))
        assert decision.reply.code == 250, decision.reply
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    figures = {"wall_us": wall / messages * 1e6, "cpu_us": cpu / messages * 1e6,
               "calls": sum(counted.calls.values()) / messages}
    for op in ("reserve", "inspect_many"):
        if counted.calls[op]:
            figures[f"{op}_us"] = counted.seconds[op] / counted.calls[op] * 1e6
    return figures


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-previous-secret-") as tmp:
        for kind in args.stores:
            runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            async with opened(kind, args, Path(tmp)) as store:
                await run(store, True, min(100, args.messages))  # warm up
                for _ in range(args.rounds):
                    for previous in (False, True):
                        runs[previous].append(await run(store, previous, args.messages))
            rows = [{name: statistics.median(r[name] for r in runs[previous])
                     for name in runs[previous][0]} for previous in (False, True)]
            for label, row in zip(("without", "with previous"), rows, strict=True):
                extra = " ".join(f"{k} {v:.0f}" for k, v in row.items()
                                 if k.endswith("_us") and k not in ("wall_us", "cpu_us"))
                print(f"{kind:8} {label:14} wall {row['wall_us']:7.0f} us  cpu "
                      f"{row['cpu_us']:6.0f} us  store calls {row['calls']:.2f}  {extra}",
                      flush=True)
            print(f"{kind:8} {'extra':14} wall {rows[1]['wall_us'] - rows[0]['wall_us']:+7.0f}"
                  f" us  cpu {rows[1]['cpu_us'] - rows[0]['cpu_us']:+6.0f} us  store calls "
                  f"{rows[1]['calls'] - rows[0]['calls']:+.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300, help="messages per run")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each, alternating")
    parser.add_argument("--stores", nargs="+", default=["redis", "sqlite", "postgres"],
                        choices=["redis", "sqlite", "postgres"])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
