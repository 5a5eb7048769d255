"""Relays whose wall clocks disagree, sharing one store (libfaketime moves one relay's wall clock
only, as an NTP step or a skewed host does): a SENDING record never reads as in doubt while its
relay waits for the upstream's reply. On Redis every time that decides a record's state is the
store's; on a SQLite file a SENDING heartbeat is aged on the host's boot clock, which no step of
the wall clock moves (design.md §3, "A step of the clock")."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import pytest

from bench.faultbench.lib import Faults, RelayConfig, RelayProcess, free_port, start_sink
from bench.faultbench.traffic import make_messages, read_sink_log, send_once
from tests.support.relays import REDIS_URL, delete_prefix

pytestmark = [
    pytest.mark.slow,  # relay processes, real leases: seconds per test
    pytest.mark.skipif(shutil.which("faketime") is None,
                       reason="needs faketime (Debian package faketime)"),
]

LEASE_S = 3.0
HOLD_S = 4.0  # the upstream holds its reply to A's final dot longer than the lease


@pytest.mark.timeout(60)
@pytest.mark.parametrize("unknown_policy", ["send", "suppress"])
@pytest.mark.parametrize(("store", "offsets"), [
    ("redis", (-10.0, 0.0)),  # A's clock 10 s behind
    ("sqlite", (0.0, 20.0)),  # B's clock 20 s ahead: a step longer than the lease
])
async def test_a_clock_that_disagrees_does_not_make_a_sending_record_look_in_doubt(
        tmp_path: Path, unknown_policy: str, store: str, offsets: tuple[float, float]) -> None:
    """A copy sent to relay B while relay A waits for the upstream's reply to its dot, their
    wall clocks apart by more than the lease, is answered 450 (in flight, without a wait) and
    never relayed: one delivery, A's client gets 250."""
    tag = uuid.uuid4().hex[:8]
    prefix = f"test:skew:{tag}:"
    url = REDIS_URL if store == "redis" else f"sqlite:///{tmp_path / 'dedup.db'}"
    [msg] = make_messages(1, tag, two_rcpt_every=0)
    sink = await start_sink(Faults(), tmp_path / "sink.jsonl")
    config = RelayConfig(lease_s=LEASE_S, upstream_timeout_s=HOLD_S + 3.0,
                         command_timeout_s=2.0)
    env = {"RELAY_UNKNOWN_POLICY": unknown_policy, "RELAY_IN_FLIGHT_WAIT": "0"}
    relays = [RelayProcess(port=free_port(), upstream_port=sink.port, store_url=url,
                           store_prefix=prefix, log_path=tmp_path / f"relay{i}.log",
                           config=config, extra_env=env, clock_offset_s=offset)
              for i, offset in enumerate(offsets)]
    try:
        await asyncio.gather(*(r.start() for r in relays))
        taken = sink.handler.hold_next(HOLD_S)
        first = asyncio.create_task(send_once(relays[0].port, msg, 20.0))
        await asyncio.wait_for(taken.wait(), 10)
        await asyncio.sleep(0.5)  # A marked SENDING and sent its dot; the sink holds the reply
        retry = await send_once(relays[1].port, msg, 10.0)
        original = await first
    finally:
        for relay in relays:
            await relay.stop()
        sink.close()
        if store == "redis":
            await asyncio.to_thread(delete_prefix, REDIS_URL, prefix)
    copies = read_sink_log(tmp_path / "sink.jsonl")
    assert original.code == 250, original
    assert retry.code == 450, retry
    assert list(copies.values()) == [1], copies
