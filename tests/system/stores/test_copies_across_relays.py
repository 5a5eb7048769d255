"""A copy sent to relay B while relay A (another process on the same store) relays the first
attempt waits for A's settle (``in_flight_wait``, design.md §4.8) and is answered 250 once A
sent it: on Redis B hears A's settle on the key's channel, on a shared SQLite file B's shared
re-read of the keys it waits for finds it."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from bench.faultbench.lib import Faults, RelayConfig, RelayProcess, free_port, start_sink
from bench.faultbench.traffic import make_messages, read_sink_log, send_once
from tests.support.relays import REDIS_URL, delete_prefix

pytestmark = pytest.mark.slow  # relay processes: seconds per test

HOLD_S = 3.0  # the upstream holds its reply to A's final dot


@pytest.mark.timeout(60)
@pytest.mark.parametrize("store", ["redis", "sqlite"])
async def test_a_copy_at_another_relay_waits_for_the_first_attempt_and_gets_250(
        tmp_path: Path, store: str) -> None:
    tag = uuid.uuid4().hex[:8]
    prefix = f"test:across:{tag}:"
    url = REDIS_URL if store == "redis" else f"sqlite:///{tmp_path / 'dedup.db'}"
    [msg] = make_messages(1, tag, two_rcpt_every=0)
    sink = await start_sink(Faults(), tmp_path / "sink.jsonl")
    config = RelayConfig(lease_s=30.0, upstream_timeout_s=HOLD_S + 5.0, command_timeout_s=2.0)
    relays = [RelayProcess(port=free_port(), upstream_port=sink.port, store_url=url,
                           store_prefix=prefix, log_path=tmp_path / f"relay{i}.log",
                           config=config) for i in range(2)]
    try:
        await asyncio.gather(*(r.start() for r in relays))
        taken = sink.handler.hold_next(HOLD_S)
        first = asyncio.create_task(send_once(relays[0].port, msg, 20.0))
        await asyncio.wait_for(taken.wait(), 10)
        copy = await send_once(relays[1].port, msg, 20.0)
        original = await first
    finally:
        for relay in relays:
            await relay.stop()
        sink.close()
        if store == "redis":
            await asyncio.to_thread(delete_prefix, REDIS_URL, prefix)
    assert (original.code, copy.code) == (250, 250), (original, copy)
    assert list(read_sink_log(tmp_path / "sink.jsonl").values()) == [1]
