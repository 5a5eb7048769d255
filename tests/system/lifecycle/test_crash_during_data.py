"""A relay killed (SIGKILL) while a large message streams to a slow smarthost leaves a
reservation, not a SENDING record: the final dot never left, so a retry once the lease ends is
relayed instead of being answered "in doubt" (a real `serve` process, a smarthost that reads
64 KiB every 50 ms, the shared Redis under a fresh prefix)."""

from __future__ import annotations

import asyncio
import signal
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import State
from relay.core.recipients import normalize_recipient
from relay.store.redis.store import RedisStore
from tests.support.clients import message, send
from tests.support.peers import ScriptedPeer, serve_peer
from tests.support.relays import REDIS_URL, delete_prefix, start_serve
from tests.support.waiting import until

BODY_BYTES = 6_000_000  # about 5 s at the peer's pace


@dataclass
class SlowReader(ScriptedPeer):
    """Reads the message 64 KiB at a time, 50 ms apart (about 1.3 MB/s); ``received`` counts."""

    received: list[int] = field(default_factory=list)

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"354 go ahead\r\n")
        await writer.drain()

        async def slowly(chunk: bytes) -> None:
            self.received.append(len(chunk))
            await asyncio.sleep(0.05)

        if not await self.read_to_dot(reader, slowly):
            return False
        writer.write(b"250 2.0.0 queued\r\n")
        return True


async def test_a_relay_killed_mid_data_leaves_a_reservation_not_sending(tmp_path: Path) -> None:
    """SIGKILL 1.5 s into a 6 MB transfer: the record is PENDING (reserved), not SENDING, and
    the upstream never saw the dot."""
    prefix = f"test:crash:{uuid.uuid4().hex}:"
    key = store_key(prefix, fingerprint(normalize_recipient("user@example.net"), "welcome",
                                        "K-1"))
    body = b"x" * 998 + b"\r\n"
    content = message() + body * (BODY_BYTES // len(body))
    async with serve_peer(SlowReader(), rcvbuf=64 * 1024) as peer:
        relay = await start_serve(tmp_path, "--upstream", f"127.0.0.1:{peer.port}", "--store",
                                  REDIS_URL, "--store-prefix", prefix, "--metrics-listen",
                                  "off", "--lease", "60", workers=1)
        sending = asyncio.create_task(send(relay.port, ["user@example.net"], content))
        try:
            await until(lambda: sum(peer.received) > 256 * 1024, within_s=30,
                        what="the body streaming to the smarthost")
            await asyncio.sleep(1.5)
            relay.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(relay.proc.wait, 10)
            store = RedisStore.from_url(REDIS_URL, op_timeout_s=2.0)
            try:
                record = await store.inspect(key)
            finally:
                await store.close()
        finally:
            sending.cancel()
            await asyncio.to_thread(relay.stop)
            delete_prefix(REDIS_URL, prefix)
    assert sum(peer.received) < len(content)
    assert record.state is State.PENDING, record
