"""Two relays on one SQLite file whose wall clocks disagree by more than the lease (libfaketime
on one: the wall clock only, as an NTP step moves it): a live SENDING record never reads as in
doubt, because its heartbeat is judged on the host's boot clock, which no step moves."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import pytest

from tests.support.faultbench_lib import Faults, RelayConfig, RelayProcess, free_port, start_sink
from tests.support.faultbench_traffic import make_messages, read_sink_log, send_once

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("faketime") is None,
                       reason="needs faketime (Debian package faketime)"),
]

LEASE_S = 3.0
HOLD_S = 4.0  # the upstream holds its reply to A's final dot longer than the lease
STEP_S = 20.0  # relay B's wall clock is this far ahead: more than the lease


@pytest.mark.timeout(60)
@pytest.mark.parametrize("unknown_policy", ["send", "suppress"])
async def test_a_clock_step_on_the_sqlite_host_does_not_make_a_sending_record_in_doubt(
        tmp_path: Path, unknown_policy: str) -> None:
    """A copy sent to relay B (wall clock 20 s ahead) while relay A waits for the upstream's
    reply to its dot is answered 450 (in flight), not 250 "in doubt" and not relayed: one
    delivery, A's client gets 250."""
    tag = uuid.uuid4().hex[:8]
    [msg] = make_messages(1, tag, two_rcpt_every=0)
    sink = await start_sink(Faults(), tmp_path / "sink.jsonl")
    config = RelayConfig(lease_s=LEASE_S, upstream_timeout_s=HOLD_S + 3.0,
                         command_timeout_s=2.0)
    store = f"sqlite:///{tmp_path / 'dedup.db'}"
    relays = [RelayProcess(port=free_port(), upstream_port=sink.port, store_url=store,
                           store_prefix="email:fp:", log_path=tmp_path / f"relay{i}.log",
                           config=config, extra_env={"RELAY_UNKNOWN_POLICY": unknown_policy},
                           clock_offset_s=offset)
              for i, offset in enumerate((0.0, STEP_S))]
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
    copies = read_sink_log(tmp_path / "sink.jsonl")
    assert original.code == 250, original
    assert retry.code == 450, retry
    assert list(copies.values()) == [1], copies
