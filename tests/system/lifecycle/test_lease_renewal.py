"""An attempt that works longer than its lease keeps its reservations: the relay
renews them (compare-token, in the store's clock) until the attempt settles. Real relay
processes on the shared Redis, a real sink that is slow on purpose."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from bench.faultbench.lib import Faults, RelayConfig, RelayProcess, free_port, start_sink
from bench.faultbench.traffic import BenchMessage, read_sink_log, send_once
from tests.support.relays import REDIS_URL, delete_prefix

pytestmark = pytest.mark.slow  # relay processes under load, real leases: seconds per test

LEASE_S = 3.0


def _relay(tmp_path: Path, sink_port: int, prefix: str, policy: str = "suppress") -> RelayProcess:
    config = RelayConfig(lease_s=LEASE_S, upstream_timeout_s=10.0, command_timeout_s=3.0)
    return RelayProcess(port=free_port(), upstream_port=sink_port, store_url=REDIS_URL,
                        store_prefix=prefix, log_path=tmp_path / "relay.log", config=config,
                        extra_env={"RELAY_UNKNOWN_POLICY": policy,
                                   "RELAY_IN_FLIGHT_WAIT": "0"})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("unknown_policy", ["send", "suppress"])
async def test_a_retry_while_the_upstream_holds_its_reply_past_the_lease_is_told_in_flight(
        tmp_path: Path, unknown_policy: str) -> None:
    """The upstream holds its reply to the final dot for 5 s with a 3 s lease: a retry at 4 s is
    answered 450 (the first attempt is alive), the first gets 250, one copy is delivered."""
    tag = uuid.uuid4().hex[:8]
    prefix = f"test:lease:{tag}:"
    msg = BenchMessage(index=0, key=f"{tag}-0", rcpts=(f"a.{tag}@example.net",))
    sink = await start_sink(Faults(), tmp_path / "sink.jsonl")
    relay = _relay(tmp_path, sink.port, prefix, unknown_policy)
    try:
        await relay.start()
        taken = sink.handler.hold_next(5.0)
        first = asyncio.create_task(send_once(relay.port, msg, 20.0))
        await asyncio.wait_for(taken.wait(), 10)
        await asyncio.sleep(LEASE_S + 1.0)
        retry = await send_once(relay.port, msg, 10.0)
        original = await first
    finally:
        await relay.stop()
        sink.close()
        await asyncio.to_thread(delete_prefix, REDIS_URL, prefix)
    assert (original.code, retry.code) == (250, 450), (original, retry)
    assert list(read_sink_log(tmp_path / "sink.jsonl").values()) == [1]


@pytest.mark.timeout(60)
async def test_a_transaction_with_slow_recipients_longer_than_the_lease_is_relayed(
        tmp_path: Path) -> None:
    """MAIL, eight RCPTs and DATA answered slowly (about 10 s in all, lease 3 s): the message is
    relayed and answered 250, not refused as if the store were down."""
    tag = uuid.uuid4().hex[:8]
    prefix = f"test:lease:{tag}:"
    msg = BenchMessage(index=0, key=f"{tag}-0",
                       rcpts=tuple(f"r{i}.{tag}@example.net" for i in range(8)))
    sink = await start_sink(Faults(slow_s=2.0), tmp_path / "sink.jsonl")
    relay = _relay(tmp_path, sink.port, prefix)
    try:
        await relay.start()
        loop = asyncio.get_running_loop()
        started = loop.time()
        attempt = await send_once(relay.port, msg, 30.0)
        took_s = loop.time() - started
    finally:
        await relay.stop()
        sink.close()
        await asyncio.to_thread(delete_prefix, REDIS_URL, prefix)
    assert took_s > LEASE_S, f"the sink was not slow enough to test anything ({took_s:.1f} s)"
    assert attempt.code == 250, attempt
    assert len(read_sink_log(tmp_path / "sink.jsonl")) == 8
