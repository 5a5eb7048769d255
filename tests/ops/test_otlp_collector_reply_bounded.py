"""What the OTLP/HTTP exporter reads of a collector's reply is bounded: a real ``python -m relay
serve`` process exporting its spans to a loopback collector that answers each export with
200 MB (chunked, or with its Content-Length) keeps its peak resident memory (``VmHWM``) and
logs one WARNING per such reply."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.clients import message, send
from tests.support.net import free_port
from tests.support.relays import start_serve

pytestmark = pytest.mark.timeout(90)

HUGE = 200 * 1024 * 1024


@dataclass
class HugeReplyCollector:
    """An OTLP/HTTP collector on loopback whose every ``POST /v1/traces`` is answered 200 with
    ``HUGE`` bytes, chunked or (``declared``) with its Content-Length; ``exports`` counts
    the requests."""

    declared: bool
    exports: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None

    async def _traces(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.exports += 1
        response = web.StreamResponse(headers={"Content-Type": "application/x-protobuf"})
        if self.declared:
            response.content_length = HUGE
        else:
            response.enable_chunked_encoding()
        await response.prepare(request)
        chunk, sent = b"\0" * 65536, 0
        try:
            while sent < HUGE:
                await response.write(chunk)
                sent += len(chunk)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the exporter stopped reading and closed
        return response

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        self.port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def peak_rss(pid: int) -> int:
    """The peak resident memory of process ``pid`` in bytes (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def exported(collector: HugeReplyCollector, count: int, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while collector.exports < count:
        assert time.monotonic() < deadline, f"{collector.exports} exports"
        await asyncio.sleep(0.05)


@pytest.fixture(params=[False, True], ids=["chunked", "content-length"])
async def collector(request: pytest.FixtureRequest) -> AsyncIterator[HugeReplyCollector]:
    served = HugeReplyCollector(declared=request.param)
    await served.start()
    yield served
    await served.stop()


async def test_a_200_mb_collector_reply_leaves_the_relays_memory_where_it_was(
        tmp_path: Path, collector: HugeReplyCollector) -> None:
    """Three messages, each exported on its own: the second and third export start only once
    the reply to the one before was dealt with, so two 200 MB replies have been; the relay's
    peak resident memory grew by less than 32 MB over its peak before them (it grew by
    about twice the reply when the exporter read it whole), each reply cost one WARNING, and
    every message was relayed."""
    relay = await start_serve(
        tmp_path, "--upstream", "maildir:md", "--metrics-listen", "off", "--store",
        f"sqlite:///{tmp_path}/store.db", workers=1,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
             "OTEL_BSP_SCHEDULE_DELAY": "20"})
    try:
        first = await send(relay.port, ["user@example.net"], message("K-0"))
        await exported(collector, 1)
        before = peak_rss(relay.proc.pid)
        replies = [first]
        for n in (1, 2):
            replies.append(await send(relay.port, ["user@example.net"], message(f"K-{n}")))
            await exported(collector, n + 1)
        grown = peak_rss(relay.proc.pid) - before
    finally:
        await asyncio.to_thread(relay.stop)
    assert [r.code for r in replies] == [250, 250, 250], replies
    assert grown < 32 * 1024 * 1024, f"peak RSS grew {grown / 2**20:.0f} MB"
    warned = [e for e in relay.lines() if e.get("level") == "WARNING"
              and "OTLP collector" in str(e.get("message"))]
    assert len(warned) >= 2, relay.lines()

