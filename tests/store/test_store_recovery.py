"""The store comes back: once Redis answers again, no client sees a 4yz caused by
a connection the relay's pool still held from before the restart. A private redis-server is
stopped and started under a running relay; a real sink; smtplib clients."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.support import redis_servers
from tests.support.clients import message, send
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

BURST = 20


@pytest.mark.timeout(60)
async def test_the_first_burst_after_redis_restarts_is_relayed(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """20 parallel messages right after Redis restarted (its pooled connections dead) are all
    answered 250: a dead pooled connection is replaced and the call tried once more."""
    with redis_servers.server_group("store-recovery") as group:
        server = group.add(lambda _port: ["--save", "", "--appendonly", "no"])
        port = server.port
        relay = await make_relay(upstream=f"127.0.0.1:{sink.port}",
                                 store=f"redis://127.0.0.1:{port}/0", store_timeout=2.0)
        tag = uuid.uuid4().hex[:8]
        warm = await asyncio.gather(*(
            send(relay.port, [f"warm{i}.{tag}@example.net"], message(key=f"w{i}"))
            for i in range(BURST)))  # the pool now holds many connections
        assert {r.code for r in warm} == {250}
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(server.start)  # answers PING again when this returns
        burst = await asyncio.gather(*(
            send(relay.port, [f"b{i}.{tag}@example.net"], message(key=f"b{i}"))
            for i in range(BURST)))
    codes = sorted(r.code for r in burst)
    assert codes == [250] * BURST, [(r.code, r.text) for r in burst if r.code != 250]
