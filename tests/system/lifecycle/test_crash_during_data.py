"""A relay killed (SIGKILL) before its final dot left leaves a reservation, not a SENDING
record, so a retry once the lease ends is relayed instead of being answered "in doubt": while a
large message streams to a slow smarthost (it reads 64 KiB every 50 ms), and while a smarthost
takes its time to answer DATA (a real `serve` process, the shared Redis under a fresh
prefix)."""

from __future__ import annotations

import asyncio
import signal
import time
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


@dataclass
class SlowToAnswerData(ScriptedPeer):
    """Answers DATA with 354 only after ``delay_s`` (policy checks, a tarpit); ``data_at`` is
    when DATA came (``time.monotonic()``)."""

    delay_s: float = 4.0
    data_at: list[float] = field(default_factory=list)

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        self.data_at.append(time.monotonic())
        await asyncio.sleep(self.delay_s)
        return await super().on_data(reader, writer)


async def inspect(key: str) -> State:
    """The state the test Redis holds for ``key``."""
    store = RedisStore.from_url(REDIS_URL, op_timeout_s=2.0)
    try:
        return (await store.inspect(key)).state
    finally:
        await store.close()


async def test_a_relay_killed_while_data_waits_for_354_leaves_a_reservation(
        tmp_path: Path) -> None:
    """A 1 KB message, a smarthost that answers DATA after 4 s, SIGKILL 1.6 s after DATA: the
    record is PENDING (the SENDING mark waits for the 354), not SENDING."""
    prefix = f"test:crash:{uuid.uuid4().hex}:"
    key = store_key(prefix, fingerprint(normalize_recipient("user@example.net"), "welcome",
                                        "K-1"))
    async with serve_peer(SlowToAnswerData()) as peer:
        relay = await start_serve(tmp_path, "--upstream", f"127.0.0.1:{peer.port}", "--store",
                                  REDIS_URL, "--store-prefix", prefix, "--metrics-listen",
                                  "off", "--lease", "60", workers=1)
        sending = asyncio.create_task(send(relay.port, ["user@example.net"],
                                           message(body="\r\n".join(["x" * 78] * 13))))
        try:
            await until(lambda: bool(peer.data_at), what="DATA at the smarthost")
            await asyncio.sleep(1.6)
            relay.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(relay.proc.wait, 10)
            record = await inspect(key)
        finally:
            sending.cancel()
            await asyncio.to_thread(relay.stop)
            delete_prefix(REDIS_URL, prefix)
    assert record is State.PENDING, record


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
