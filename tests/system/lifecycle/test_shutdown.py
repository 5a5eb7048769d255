"""Graceful shutdown: stop accepting, finish what is inside DATA, cut the rest honestly."""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

import pytest

from relay.core import replies
from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import State
from relay.core.recipients import normalize_recipient
from tests.support.cli import start_relay, wait_for_port
from tests.support.clients import RawClient, message, send
from tests.support.net import free_port
from tests.support.relays import REDIS_URL, MakeRelay, delete_prefix, start_serve
from tests.support.sink import Sink
from tests.support.waiting import until

pytestmark = pytest.mark.both_loops  # asyncio's loop and uvloop's (tests/conftest.py)


def key_for(prefix: str, rcpt: str = "user@example.net") -> str:
    """Store key of (rcpt, 'welcome', 'K-1')."""
    return store_key(prefix, fingerprint(normalize_recipient(rcpt), "welcome", "K-1"))


async def test_idle_session_is_told_421_and_new_connections_are_refused(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """On stop an idle client gets 421 4.3.2 and the port no longer accepts connections."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    await relay.stop()
    assert await client.reply() == str(replies.SHUTTING_DOWN)
    assert await client.reader.read() == b""
    await client.close()
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    except OSError:
        pass
    else:
        writer.close()
        raise AssertionError("the listener still accepts connections after stop")


async def test_message_in_flight_finishes_then_session_closes(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """A message waiting on the upstream at stop is delivered and answered 250, then 421."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", shutdown_grace=10.0)
    sink.handler.delay_s = 1.0
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    await client.cmd("MAIL FROM:<app@example.com>")
    await client.cmd("RCPT TO:<user@example.net>")
    await client.cmd("DATA")
    await client.write(message() + b".\r\n")
    await asyncio.sleep(0.3)  # the relay is now waiting for the upstream
    stopping = asyncio.create_task(relay.stop())
    assert (await client.reply()).startswith("250 2.0.0 Ok: relayed 1")
    assert await client.reply() == str(replies.SHUTTING_DOWN)
    await client.close()
    await stopping
    assert len(sink.handler.delivered) == 1


async def test_cut_before_the_dot_releases(make_relay: MakeRelay, sink: Sink) -> None:
    """Past the grace, a transaction stuck before the final dot is released (retry is safe)."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", shutdown_grace=0.3,
                             upstream_command_timeout=20.0, upstream_timeout=25.0)
    sink.handler.mail_delay_s = 5.0
    sending = asyncio.create_task(send(relay.port, ["user@example.net"], message()))
    await asyncio.sleep(0.5)
    await relay.stop()
    record = await _inspect_after_stop(relay.settings.store, key_for(relay.settings.store_prefix))
    assert record is State.ABSENT
    result = await sending
    assert (result.code, result.text) == (451, replies.CUT_BY_SHUTDOWN.text)


async def test_cut_after_the_dot_is_unknown(make_relay: MakeRelay, sink: Sink) -> None:
    """Past the grace and the wait for the reply to a dot on the wire (5 s), a transaction whose
    final dot is out is marked UNKNOWN, not released."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", shutdown_grace=0.3,
                             upstream_timeout=20.0)
    sink.handler.hang_after_dot_s = 8.0
    sending = asyncio.create_task(send(relay.port, ["user@example.net"], message()))
    await asyncio.sleep(0.5)
    await relay.stop()
    record = await _inspect_after_stop(relay.settings.store, key_for(relay.settings.store_prefix))
    assert record is State.UNKNOWN
    result = await sending  # told "in doubt" before the session closes, never left guessing
    assert (result.code, result.text) == (451, replies.OUTCOME_UNKNOWN.text)


@pytest.mark.parametrize("refusal", ["554 5.7.1 message refused", "451 4.3.0 try later"])
async def test_a_refusal_just_after_the_grace_releases_the_record(
        tmp_path: Path, sink: Sink, refusal: str) -> None:
    """SIGTERM to `serve` while the smarthost holds its reply to the final dot; the grace
    (0.5 s) ends, the refusal comes 1.5 s after the dot: the relay waits for it, releases the
    record (absent, not UNKNOWN: a retry is relayed, never told 250 for mail not delivered),
    the client gets the refusal, and the process exits 0."""
    prefix = f"test:shutdown:{uuid.uuid4().hex}:"
    sink.handler.data_plan.append(refusal)
    sink.handler.hang_after_dot_s = 1.5
    relay = await start_serve(tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--store",
                              REDIS_URL, "--store-prefix", prefix, "--shutdown-grace", "0.5",
                              "--metrics-listen", "off", workers=1)
    try:
        sending = asyncio.create_task(send(relay.port, ["user@example.net"], message()))
        await until(lambda: sink.handler.transactions > 0, within_s=10, what="MAIL at the sink")
        await asyncio.sleep(0.5)  # the body and its dot are at the sink, which holds its reply
        relay.proc.send_signal(signal.SIGTERM)
        result = await sending
        code = await asyncio.to_thread(relay.proc.wait, 30)
        record = await _inspect_after_stop(REDIS_URL, key_for(prefix))
    finally:
        await asyncio.to_thread(relay.stop)
        delete_prefix(REDIS_URL, prefix)
    assert code == 0
    assert record is State.ABSENT
    assert result.code == int(refusal[:3]) and result.text.endswith(refusal[10:]), result


async def _inspect_after_stop(url: str, key: str) -> State:
    """The key's state, read with a fresh store (the relay's own is closed)."""
    from relay.store.redis.store import RedisStore

    store = RedisStore.from_url(url)
    try:
        return (await store.inspect(key)).state
    finally:
        await store.close()


def test_sigterm_lets_the_message_in_flight_finish(tmp_path: Path) -> None:
    """SIGTERM to `dedup-relay serve` mid-message: the client gets 250, the process exits 0."""
    import smtplib
    import threading
    import time

    port = free_port()
    proc = start_relay(tmp_path, port, "maildir:md")
    try:
        wait_for_port(port, proc)
        outcome: dict[str, object] = {}

        def client() -> None:
            smtp = smtplib.SMTP("127.0.0.1", port, timeout=30)
            smtp.ehlo("client.test")
            smtp.mail("app@example.com")
            smtp.rcpt("user@example.net")
            smtp.putcmd("data")
            assert smtp.getreply()[0] == 354
            smtp.send(message()[:40])  # part of the body, then SIGTERM arrives
            time.sleep(0.8)
            smtp.send(message()[40:] + b".\r\n")
            outcome["reply"] = smtp.getreply()
            outcome["after"] = smtp.getreply()  # the 421 4.3.2 that closes the session
            smtp.close()

        thread = threading.Thread(target=client)
        thread.start()
        time.sleep(0.4)
        proc.send_signal(signal.SIGTERM)
        thread.join(timeout=30)
        assert proc.wait(timeout=30) == 0
        assert outcome["reply"][0] == 250  # type: ignore[index]
        assert outcome["after"][0] == 421  # type: ignore[index]
        assert len(list((tmp_path / "md" / "new").iterdir())) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # waits, and closes the pipes (no ResourceWarning)


async def test_a_settle_after_the_upstream_reply_completes_when_the_grace_ends(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """The grace ends while the SENT mark after the upstream's 250 waits on a paused Redis
    (DEBUG SLEEP on a private server): the mark still lands, the record is SENT and the client
    reads its 250 (it is not cancelled, which would leave SENDING and a bare disconnect)."""
    import redis

    from tests.support import redis_servers

    with redis_servers.server_group("settle-cut") as group:
        port = group.add(lambda _port: ["--save", "", "--appendonly", "no",
                                        "--enable-debug-command", "yes"]).port
        url = f"redis://127.0.0.1:{port}/0"
        relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=url,
                                 shutdown_grace=0.8, store_timeout=4.0, lease=30.0)
        sink.handler.hang_after_dot_s = 1.0  # the 250 comes 1 s after the final dot
        sending = asyncio.create_task(send(relay.port, ["user@example.net"], message()))
        await until(lambda: len(sink.handler.delivered) == 1)  # the dot is out (SENDING was
        # marked before it); the 250 comes 1 s later, when Redis sleeps and the grace still runs
        await asyncio.sleep(0.4)
        pauser = redis.Redis(port=port, socket_timeout=10)
        pause = asyncio.create_task(
            asyncio.to_thread(pauser.execute_command, "DEBUG", "SLEEP", "2"))
        await asyncio.sleep(0.05)
        await relay.stop()  # the grace (0.8 s) ends while the SENT mark waits on Redis
        await pause
        pauser.close()
        record = await _inspect_after_stop(url, key_for(relay.settings.store_prefix))
        result = await sending
    assert record is State.SENT
    assert result.code == 250, result
    assert len(sink.handler.delivered) == 1


async def test_a_settle_the_store_did_not_take_before_exit_is_paid_by_the_next_start(
    make_relay: MakeRelay, sink: Sink, tmp_path: Path
) -> None:
    """Redis goes away after the final dot: the client gets its 250, the SENT mark is owed, the
    stopping relay writes it to the settle journal, and the next relay applies it once Redis is
    back: the record is SENT, not a SENDING that reads as in doubt."""
    from tests.support import redis_servers

    journal = tmp_path / "owed.jsonl"
    with redis_servers.server_group("settle-journal") as group:
        server = group.add(lambda _port: ["--save", "", "--appendonly", "yes",
                                          "--appendfsync", "always"])
        port = server.port
        url = f"redis://127.0.0.1:{port}/0"
        settings = {"upstream": f"127.0.0.1:{sink.port}", "store": url, "store_timeout": 0.5,
                    "shutdown_grace": 1.0, "settle_journal": str(journal),
                    "store_prefix": "test:journal:"}
        relay = await make_relay(**settings)
        sink.handler.hang_after_dot_s = 1.0
        sending = asyncio.create_task(send(relay.port, ["user@example.net"], message()))
        await until(lambda: len(sink.handler.delivered) == 1)  # the dot is out (SENDING was
        # marked before it): Redis goes away
        await asyncio.to_thread(server.stop)
        result = await sending
        await relay.stop()
        written = journal.read_text()
        await asyncio.to_thread(server.start)
        await make_relay(**settings)
        record = await _inspect_after_stop(url, key_for(relay.settings.store_prefix))
    assert result.code == 250, result
    assert '"action": "sent"' in written
    assert record is State.SENT
    assert not journal.exists()


async def test_a_cut_during_the_reserve_releases_what_landed_and_says_so(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """The grace ends while the reserve waits on a paused Redis: the reserve still lands, is
    released (compare-token), the client reads 451 4.3.2 (not a bare disconnect) and nothing
    is relayed, so its retry is relayed at once instead of meeting a PENDING record (450)."""
    import redis

    from tests.support import redis_servers

    with redis_servers.server_group("reserve-cut") as group:
        port = group.add(lambda _port: ["--save", "", "--appendonly", "no",
                                        "--enable-debug-command", "yes"]).port
        url = f"redis://127.0.0.1:{port}/0"
        relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=url,
                                 shutdown_grace=0.3, store_timeout=4.0, lease=30.0)
        pauser = redis.Redis(port=port, socket_timeout=10)
        pause = asyncio.create_task(
            asyncio.to_thread(pauser.execute_command, "DEBUG", "SLEEP", "1.5"))
        await asyncio.sleep(0.1)  # Redis sleeps: the reserve at the final dot will wait
        sending = asyncio.create_task(send(relay.port, ["user@example.net"], message()))
        await asyncio.sleep(0.3)
        await relay.stop()
        await pause
        pauser.close()
        record = await _inspect_after_stop(url, key_for(relay.settings.store_prefix))
        result = await sending
    assert (result.code, result.text) == (451, replies.CUT_BY_SHUTDOWN.text)
    assert record is State.ABSENT
    assert sink.handler.delivered == []
