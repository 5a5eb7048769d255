"""Several relay instances sharing one store: two `python -m relay serve` processes on the shared
Redis (random key prefix), one sink, 20 clients sending the same messages to both in turn."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from pathlib import Path

import pytest

from bench.faultbench.lib import Faults, RelayProcess, free_port, start_sink
from bench.faultbench.traffic import (
    RetryPolicy,
    deliver,
    make_messages,
    read_sink_log,
    reply_class,
)
from tests.support.relays import REDIS_URL, delete_prefix

pytestmark = pytest.mark.slow  # relay processes under load, real leases: seconds per test

CLIENTS = 20
KEYS = 10
DEADLINE_S = 30.0
# quick retries: 450 (another attempt in flight) clears as soon as that attempt settles
POLICY = RetryPolicy(base_s=0.05, max_s=0.5, timeout_s=10.0)


@pytest.mark.timeout(90)
async def test_two_relays_on_one_store_deliver_each_fingerprint_once(tmp_path: Path) -> None:
    """20 clients sending the same 10 messages to two relays in turn: one delivery each, all 250."""
    tag = uuid.uuid4().hex[:8]
    prefix = f"test:two-relays:{tag}:"
    messages = make_messages(KEYS, tag)
    sink = await start_sink(Faults(slow_s=0.05), tmp_path / "sink.jsonl")
    relays = [RelayProcess(port=free_port(), upstream_port=sink.port, store_url=REDIS_URL,
                           store_prefix=prefix, log_path=tmp_path / f"relay{i}.log")
              for i in range(2)]
    try:
        await asyncio.gather(*(r.start() for r in relays))
        ports = [r.port for r in relays]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        gate = asyncio.Semaphore(CLIENTS)
        replies: Counter[str] = Counter()

        async def client(n: int) -> list[str]:
            rng = random.Random(n)
            ends = []
            for j, msg in enumerate(messages):  # messages and retries go to A, B, A, ... in turn
                first = (n + j) % 2
                log = await deliver(msg, ports[first:] + ports[:first], POLICY, deadline, gate,
                                    rng)
                replies.update(reply_class(a) for a in log.attempts)
                ends.append(log.end)
            return ends

        ends = await asyncio.gather(*(client(n) for n in range(CLIENTS)))
        await asyncio.sleep(1.2)  # an upstream transaction still running lands at the sink
    finally:
        for relay in relays:
            await relay.stop()
        sink.close()
        await asyncio.to_thread(delete_prefix, REDIS_URL, prefix)
    copies = read_sink_log(tmp_path / "sink.jsonl")
    expected = {(r.lower(), m.key) for m in messages for r in m.rcpts}
    summary = (f"copies per fingerprint {sorted(Counter(copies.values()).items())}, "
               f"client ends {Counter(e for es in ends for e in es)}, replies {dict(replies)}, "
               f"relay exit codes {[r.exit_codes for r in relays]}")
    print(summary)
    assert set(copies) == expected, summary
    assert all(n == 1 for n in copies.values()), summary
    assert all(e == "accepted" for es in ends for e in es), summary
    assert replies["250 2.0.0"] == CLIENTS * KEYS, summary
    for relay in relays:  # both instances took part
        assert '"message": "message"' in relay.log_path.read_text(), summary
