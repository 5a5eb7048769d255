"""A shutdown past its grace whose wait for the reply to a final dot ends while the kernel
still holds unsent bytes of the message resets the connection and releases the record: the
dot can never arrive, so nothing was delivered (a real `serve` process stopped with SIGTERM, a
smarthost that reads 64 KiB every 250 ms, the shared Redis under a fresh prefix)."""

from __future__ import annotations

import asyncio
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import State
from relay.core.recipients import normalize_recipient
from relay.store.redis.store import RedisStore
from tests.support.clients import message, send
from tests.support.peers import ScriptedPeer, serve_peer
from tests.support.relays import REDIS_URL, delete_prefix, start_serve
from tests.support.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

BODY_BYTES = 3_000_000  # the kernel takes it at once; the smarthost needs about 12 s for it


@dataclass(kw_only=True)
class SlowReader(ScriptedPeer):
    """Reads the message 64 KiB every 250 ms (about 256 KB/s); ``received`` counts the bytes,
    ``dots`` the final dots (refused with 451, as a smarthost that went away would)."""

    received: int = 0
    dots: int = 0

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"354 go ahead\r\n")
        await writer.drain()

        async def slowly(chunk: bytes) -> None:
            self.received += len(chunk)
            await asyncio.sleep(0.25)

        if not await self.read_to_dot(reader, slowly):
            return False
        self.dots += 1
        writer.write(b"451 4.3.0 too late\r\n")
        return True


async def test_a_cut_past_the_wait_for_a_reply_resets_a_dot_still_in_the_kernel(
        tmp_path: Path) -> None:
    """SIGTERM with a 1 s grace while a 3 MB message sits in the kernel's send queue: after
    the 5 s wait for a reply the connection is reset, the client is told 451 4.3.2 (released,
    not in doubt), the record is gone, and the smarthost never gets the dot."""
    prefix = f"test:unsent:{uuid.uuid4().hex}:"
    key = store_key(prefix, fingerprint(normalize_recipient("user@example.net"), "welcome",
                                        "K-1"))
    body = b"x" * 998 + b"\r\n"
    content = message() + body * (BODY_BYTES // len(body))
    async with serve_peer(SlowReader(), rcvbuf=64 * 1024) as peer:
        relay = await start_serve(tmp_path, "--upstream", f"127.0.0.1:{peer.port}", "--store",
                                  REDIS_URL, "--store-prefix", prefix, "--metrics-listen",
                                  "off", "--lease", "60", "--shutdown-grace", "1", workers=1)
        try:
            sending = asyncio.create_task(send(relay.port, ["user@example.net"], content))
            await until(lambda: peer.received > 128 * 1024, within_s=30,
                        what="the body streaming to the smarthost")
            await asyncio.sleep(0.5)  # every byte, the dot's too, is in the kernel by now
            stopped = asyncio.create_task(asyncio.to_thread(relay.stop, signal.SIGTERM))
            result = await sending
            assert await stopped == 0
            await until(lambda: peer.cut + peer.dots > 0, within_s=30,
                        what="the smarthost seeing the reset or the dot")
            store = RedisStore.from_url(REDIS_URL, op_timeout_s=2.0)
            try:
                record = await store.inspect(key)
            finally:
                await store.close()
        finally:
            await asyncio.to_thread(relay.stop)
            delete_prefix(REDIS_URL, prefix)
    assert (result.code, result.text.split()[0]) == (451, "4.3.2"), result
    assert peer.dots == 0
    assert record.state is State.ABSENT, record
