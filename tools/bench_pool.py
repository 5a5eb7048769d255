"""Benchmark: the upstream connection pool against a connection per message.

    .venv/bin/python tools/bench_pool.py --messages 2000 --concurrency 20 --rtt-ms 0 2

For each upstream round-trip time in ``--rtt-ms`` (the sink delays its greeting and every reply
by it, like a smarthost that far away) it runs the same load twice through a real
``python -m relay serve`` process: ``upstream_pool_size = 0`` (the baseline: connect, EHLO,
transaction, QUIT per message) and the default pool. Clients send unique messages (every one is
relayed) over loopback, ``--concurrency`` at a time, each a new SMTP session as legacy
applications open them. Printed per run: messages/s, client latency p50/p95/p99 (ms, connect
to the reply to the final dot), upstream connections opened, the relay's peak RSS (MiB); then
the pool's figures as ratios of the baseline measured in the same invocation. Store: the Redis
on 127.0.0.1:6379 (``--store``), a random key prefix deleted afterwards. Loopback only; bounded
by ``--messages``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiosmtplib
import redis
from aiosmtpd.smtp import SMTP, Envelope, Session

REPO = Path(__file__).resolve().parent.parent


class DelaySink:
    """An aiosmtpd handler that answers every command after ``rtt_s`` and counts connections
    (each new one says EHLO once)."""

    def __init__(self, rtt_s: float) -> None:
        self.rtt_s = rtt_s
        self.delivered = 0
        self.connections = 0

    async def _wait(self, session: Session) -> None:
        if self.rtt_s:
            await asyncio.sleep(self.rtt_s)

    async def handle_EHLO(self, server: SMTP, session: Session, envelope: Envelope,
                          hostname: str, responses: list[str]) -> list[str]:
        self.connections += 1
        await self._wait(session)
        session.host_name = hostname
        return responses

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        await self._wait(session)
        envelope.mail_from = address
        return "250 2.1.0 OK"

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        await self._wait(session)
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_RSET(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        await self._wait(session)
        return "250 2.0.0 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        await self._wait(session)
        self.delivered += 1
        return "250 2.0.0 queued"


@dataclass
class Run:
    label: str
    rtt_ms: float
    rate: float
    p50: float
    p95: float
    p99: float
    connections: int
    rss_mib: float


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _wait_port(port: int, proc: asyncio.subprocess.Process) -> None:
    for _ in range(150):
        if proc.returncode is not None:
            raise RuntimeError("relay exited during start-up")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise RuntimeError(f"relay did not listen on {port}")


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _one(port: int, n: int, prefix: str) -> float:
    started = time.perf_counter()
    content = (f"From: app@example.com\r\nTo: u{n}@example.net\r\nSubject: bench\r\n"
               f"X-Dedupe-Key: {prefix}{n}\r\n\r\nbody {n}\r\n").encode()
    client = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=60)
    await client.connect()
    try:
        await client.sendmail("app@example.com", [f"u{n}@example.net"], content)
    finally:
        await client.quit()
    return time.perf_counter() - started


async def run_once(label: str, pool_size: int, rtt_ms: float, args: argparse.Namespace) -> Run:
    """One load through a fresh relay process and sink; returns its figures."""
    sink = DelaySink(rtt_ms / 1000)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: SMTP(sink, hostname="sink.bench"),
                                      "127.0.0.1", 0)
    sink_port = server.sockets[0].getsockname()[1]
    prefix = f"bench:{uuid.uuid4().hex}:"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update({"RELAY_STORE": args.store, "RELAY_STORE_PREFIX": prefix,
                "RELAY_UPSTREAM_POOL_SIZE": str(pool_size), "RELAY_LOG_LEVEL": "WARNING",
                "RELAY_MAX_CONNECTIONS_PER_IP": str(args.concurrency * 2)})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relay", "serve", "--listen", f"127.0.0.1:{port}",
        "--upstream", f"127.0.0.1:{sink_port}", "--metrics-listen", "off",
        cwd=REPO, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        await _wait_port(port, proc)
        gate = asyncio.Semaphore(args.concurrency)

        async def limited(n: int) -> float:
            async with gate:
                return await _one(port, n, prefix)

        started = time.perf_counter()
        latencies = await asyncio.gather(*(limited(n) for n in range(args.messages)))
        wall = time.perf_counter() - started
        rss = _peak_rss_mib(proc.pid)
    finally:
        proc.terminate()
        await proc.wait()
        server.close()
        client = redis.Redis.from_url(args.store)
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)
        client.close()
    if sink.delivered != args.messages:
        raise RuntimeError(f"{label}: {sink.delivered} of {args.messages} delivered")
    ms = sorted(x * 1000 for x in latencies)
    q = statistics.quantiles(ms, n=100)
    return Run(label, rtt_ms, args.messages / wall, q[49], q[94], q[98],
               sink.connections, rss)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 2.0])
    parser.add_argument("--store", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    print(f"{args.messages} messages, {args.concurrency} concurrent clients, "
          f"{os.cpu_count()} cores, python {sys.version.split()[0]}")
    print("| upstream RTT | upstream | msg/s | p50 ms | p95 ms | p99 ms | upstream conns "
          "| relay peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for rtt in args.rtt_ms:
        base = await run_once("new connection per message (baseline)", 0, rtt, args)
        pool = await run_once("pool (default, 4 idle)", 4, rtt, args)
        for r in (base, pool):
            print(f"| {rtt:g} ms | {r.label} | {r.rate:.0f} | {r.p50:.1f} | {r.p95:.1f} | "
                  f"{r.p99:.1f} | {r.connections} | {r.rss_mib:.0f} |")
        print(f"| {rtt:g} ms | pool / baseline | x{pool.rate / base.rate:.2f} | "
              f"x{pool.p50 / base.p50:.2f} | x{pool.p95 / base.p95:.2f} | "
              f"x{pool.p99 / base.p99:.2f} | x{pool.connections / base.connections:.3f} | "
              f"x{pool.rss_mib / base.rss_mib:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
