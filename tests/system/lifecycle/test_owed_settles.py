"""Settles owed while the store does not answer survive a crash and are paid as soon as it
answers (docs/design.md §3, "The settle journal"): real `python -m relay serve` processes,
kill -9, the shared test Redis under a fresh prefix behind a proxy that black-holes it (holds
every byte, answers nothing), and a scripted smarthost."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import Settle, SettleOp, State
from relay.core.recipients import normalize_recipient
from relay.store.journal_file import add_to_journal
from relay.store.redis.store import RedisStore
from tests.support.clients import message, send
from tests.support.peers import ScriptedPeer, serve_peer
from tests.support.pg_proxy import PgProxy, proxy_to
from tests.support.relays import REDIS_URL, ServeProcess, delete_prefix, start_serve
from tests.support.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

RCPT = "user@example.net"
LEASE_S = 3.0  # the relays' lease: three store timeouts


@dataclass(kw_only=True)
class RefusesTheFirstDot(ScriptedPeer):
    """A smarthost that holds its reply to the first final dot until ``answer`` is set, then
    refuses it (451, nothing taken); it takes every later message (``accepted``)."""

    answer: asyncio.Event = field(default_factory=asyncio.Event)
    dots: int = 0
    accepted: int = 0

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"354 go ahead\r\n")
        await writer.drain()
        if not await self.read_to_dot(reader):
            return False
        self.dots += 1
        if self.dots == 1:
            await self.answer.wait()
            writer.write(b"451 4.3.0 try again later\r\n")
        else:
            self.accepted += 1
            writer.write(b"250 2.0.0 queued\r\n")
        return True


def key_of(prefix: str, dedupe_key: str = "K-1") -> str:
    """The store key of the message to ``RCPT`` with template welcome and ``dedupe_key``."""
    return store_key(prefix, fingerprint(normalize_recipient(RCPT), "welcome", dedupe_key))


async def record_of(key: str) -> State:
    """The state the test Redis holds for ``key``."""
    store = RedisStore.from_url(REDIS_URL, op_timeout_s=2.0)
    try:
        return (await store.inspect(key)).state
    finally:
        await store.close()


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh key prefix on the test Redis, its keys deleted at the end."""
    name = f"test:owed:{uuid.uuid4().hex}:"
    yield name
    delete_prefix(REDIS_URL, name)


async def serve_through(proxy: PgProxy, tmp_path: Path, peer_port: int, prefix: str,
                        *flags: str) -> ServeProcess:
    """One `serve` process (no supervisor) on the test Redis through ``proxy``, the settle
    journal ``tmp_path/owed.jsonl``, store timeout 1 s, lease ``LEASE_S``."""
    return await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{peer_port}", "--store", proxy.url(REDIS_URL),
        "--store-prefix", prefix, "--store-timeout", "1", "--lease", f"{LEASE_S:g}",
        "--settle-journal", str(tmp_path / "owed.jsonl"), "--metrics-listen", "off", *flags,
        workers=1)


async def test_a_release_owed_when_the_relay_is_killed_is_paid_by_the_next_start(
        tmp_path: Path, prefix: str) -> None:
    """The store goes silent while the smarthost holds its reply to the dot, the smarthost
    refuses it: the release is owed, on disk when the client reads its 451; the relay is
    killed (SIGKILL), the store answers again, and after the lease the retry is relayed
    (not answered "in doubt" for a message nothing delivered)."""
    journal = tmp_path / "owed.jsonl"
    async with serve_peer(RefusesTheFirstDot()) as peer, proxy_to(REDIS_URL) as proxy:
        relay = await serve_through(proxy, tmp_path, peer.port, prefix)
        try:
            sending = asyncio.create_task(send(relay.port, [RCPT], message()))
            await until(lambda: peer.dots == 1, what="the final dot at the smarthost")
            proxy.hang()  # the SENDING mark landed before the dot; nothing lands from now on
            peer.answer.set()
            refused = await sending
            on_disk = journal.read_text() if journal.exists() else ""
            relay.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(relay.proc.wait, 10)
        finally:
            await asyncio.to_thread(relay.stop)
        proxy.drop()  # what the killed relay sent meanwhile never arrives
        successor = await serve_through(proxy, tmp_path, peer.port, prefix)
        try:
            await asyncio.sleep(LEASE_S + 0.5)  # past the lease of the SENDING record
            retry = await send(successor.port, [RCPT], message())
        finally:
            await asyncio.to_thread(successor.stop)
    assert refused.code == 451, refused
    assert retry.code == 250 and "relayed 1" in retry.text, retry
    assert peer.accepted == 1
    assert '"action": "release"' in on_disk


async def held_journal_line(journal: Path, prefix: str) -> str:
    """Make the message's key under ``prefix`` (returned) a SENDING record of attempt t-1
    whose 0.5 s lease has lapsed (its relay died after the dot), and journal a release of it
    under the store's identity, as the relay that owed it wrote it."""
    key = key_of(prefix)
    store = RedisStore.from_url(REDIS_URL, op_timeout_s=2.0)
    try:
        await store.reserve([key], token="t-1", lease_s=60.0)
        await store.settle([SettleOp(key, Settle.SENDING, lease_s=0.5)], token="t-1",
                           window_s=3600.0)
        owner = f"{await store.identity()} prefix={prefix}"
    finally:
        await store.close()
    add_to_journal(journal, [("t-1", SettleOp(key, Settle.RELEASE))], owner)
    await asyncio.sleep(0.6)
    return key


async def test_a_journal_held_at_a_start_without_the_store_is_paid_once_it_answers(
        tmp_path: Path, prefix: str) -> None:
    """A relay starts while its store is black-holed, with a release journaled under the
    store's identity: once the store answers, the line is paid within seconds, without a
    restart and without a message, and the file is emptied."""
    journal = tmp_path / "owed.jsonl"
    key = await held_journal_line(journal, prefix)
    async with serve_peer(RefusesTheFirstDot()) as peer, proxy_to(REDIS_URL) as proxy:
        proxy.hang()
        relay = await serve_through(proxy, tmp_path, peer.port, prefix)
        try:
            assert await record_of(key) is State.SENDING
            proxy.resume()
            await until(lambda: _absent(key), within_s=10, what="the journaled release applied")
            await until(lambda: not journal.exists(), within_s=5, what="the journal emptied")
        finally:
            await asyncio.to_thread(relay.stop)


async def _absent(key: str) -> bool:
    return await record_of(key) is State.ABSENT


async def test_a_reserve_of_a_key_with_a_held_journal_line_applies_it_first(
        tmp_path: Path, prefix: str) -> None:
    """A relay starts while its store is black-holed, with a release journaled under the
    store's identity for the key of a message: while the store is silent the message is
    answered 4yz; the moment it answers, the message is relayed (the release applied before
    its reserve), not answered "in doubt" from the SENDING record the release removes."""
    journal = tmp_path / "owed.jsonl"
    await held_journal_line(journal, prefix)
    peer = RefusesTheFirstDot(dots=1)  # takes every message
    async with serve_peer(peer), proxy_to(REDIS_URL) as proxy:
        proxy.hang()
        relay = await serve_through(proxy, tmp_path, peer.port, prefix)
        try:
            silent = await send(relay.port, [RCPT], message())
            proxy.resume()
            relayed = await send(relay.port, [RCPT], message())
        finally:
            await asyncio.to_thread(relay.stop)
    assert silent.code == 451, silent
    assert relayed.code == 250 and "relayed 1" in relayed.text, relayed
    assert peer.accepted == 1
