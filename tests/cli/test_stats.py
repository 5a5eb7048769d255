"""`dedup-relay stats`: a real relay process (on the test Redis under its own prefix, or on an
SQLite file) writes records in every state, and the command, run as a process with the relay's
settings, reports exactly those; its cap, its figures of records in doubt, its exit codes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import State
from relay.core.recipients import normalize_recipient
from relay.store.redis.store import RedisStore
from relay.store.sqlite.store import SqliteStore
from tests.support.cli import run_cli
from tests.support.clients import SendResult, message, send
from tests.support.peers import ScriptedPeer, serve_peer
from tests.support.relays import REDIS_URL, ServeProcess, delete_prefix, start_serve
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(60)

STATES = ("pending", "sending", "sent", "unknown")


@dataclass(kw_only=True)
class ModalPeer(ScriptedPeer):
    """An upstream whose ``mode`` (read when RCPT or the message comes) decides what the next
    transaction does: ``ok`` (250 to the dot), ``close_after_dot`` (the dot read, no reply:
    hang up), ``hang_at_rcpt`` (RCPT never answered: its reservation stays PENDING),
    ``hang_after_dot`` (the dot read, no reply: the record stays SENDING). ``stalled`` counts
    the transactions held."""

    mode: str = "ok"
    stalled: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_rcpt(self, writer: asyncio.StreamWriter) -> None:
        if self.mode == "hang_at_rcpt":
            self.stalled += 1
            await self.release.wait()
        writer.write(b"250 ok\r\n")

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if self.mode == "ok":
            return await super().on_data(reader, writer)
        writer.write(b"354 go ahead\r\n")
        await writer.drain()
        if not await self.read_to_dot(reader):
            return False
        if self.mode == "hang_after_dot":
            self.stalled += 1
            await self.release.wait()
        return False  # close_after_dot (or released): no reply to the dot


def _key(prefix: str, rcpt: str, dedupe_key: str) -> str:
    return store_key(prefix, fingerprint(normalize_recipient(rcpt), "welcome", dedupe_key))


@contextlib.asynccontextmanager
async def _relay(tmp_path: Path, kind: str, upstream_port: int) -> AsyncIterator[
        tuple[ServeProcess, dict[str, str]]]:
    """`serve` in front of ``upstream_port`` on Redis (a fresh prefix) or an SQLite file; yields
    it and the RELAY_* environment that points `stats` at the same store."""
    prefix = f"test:stats:{uuid.uuid4().hex}:"
    store = REDIS_URL if kind == "redis" else f"sqlite:///{tmp_path / 'relay.db'}"
    env = {"RELAY_STORE": store, "RELAY_STORE_PREFIX": prefix, "RELAY_LEASE": "60"}
    relay = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{upstream_port}", "--settle-journal",
        str(tmp_path / "owed.jsonl"), "--shutdown-grace", "1", "--upstream-timeout", "30",
        "--upstream-command-timeout", "30", "--metrics-listen", "off", workers=1, env=env)
    relay.prefix = prefix
    try:
        yield relay, env
    finally:
        await asyncio.to_thread(relay.stop)
        if kind == "redis":
            delete_prefix(REDIS_URL, prefix)


async def _state(env: dict[str, str], key: str) -> State:
    if env["RELAY_STORE"].startswith("redis"):
        store: RedisStore | SqliteStore = RedisStore.from_url(REDIS_URL)
    else:
        store = await SqliteStore.open(env["RELAY_STORE"].removeprefix("sqlite:///"))
    try:
        return (await store.inspect(key)).state
    finally:
        await store.close()


def _stats(tmp_path: Path, env: dict[str, str], *flags: str) -> dict[str, object]:
    done = run_cli("stats", "--json", *flags, cwd=tmp_path, env=env)
    assert done.returncode == 0, done
    report = json.loads(done.stdout)
    assert isinstance(report, dict)
    return report


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
async def test_stats_reports_the_states_a_real_relay_wrote(tmp_path: Path, kind: str) -> None:
    """Through a real relay: one message relayed (SENT), one whose upstream hung up after the
    dot (UNKNOWN), one held at RCPT (PENDING), one held after its dot (SENDING). `stats --json`
    with the relay's settings (RELAY_* env) counts one of each; the UNKNOWN one is the only
    one in doubt and the oldest, none older than a day; `store` and `prefix` say where."""
    async with serve_peer(ModalPeer()) as peer, _relay(tmp_path, kind, peer.port) as (
            relay, env):
        sent = await send(relay.port, ["sent@example.net"], message(key="K-sent"))
        assert sent.code == 250, sent
        peer.mode = "close_after_dot"
        unknown = await send(relay.port, ["unknown@example.net"], message(key="K-unknown"))
        assert unknown.code == 451, unknown
        held: list[asyncio.Task[SendResult]] = []
        peer.mode = "hang_at_rcpt"
        held.append(asyncio.create_task(
            send(relay.port, ["pending@example.net"], message(key="K-pending"))))
        await until(lambda: peer.stalled == 1, what="the upstream holding RCPT")
        peer.mode = "hang_after_dot"
        held.append(asyncio.create_task(
            send(relay.port, ["sending@example.net"], message(key="K-sending"))))
        await until(lambda: peer.stalled == 2, what="the upstream holding the dot's reply")
        sending_key = _key(relay.prefix, "sending@example.net", "K-sending")
        assert await _state(env, sending_key) is State.SENDING  # marked before the dot went

        report = await asyncio.to_thread(_stats, tmp_path, env)

        peer.release.set()
        await asyncio.gather(*held, return_exceptions=True)
    assert report["states"] == {"pending": 1, "sending": 1, "sent": 1, "unknown": 1}, report
    assert (report["scanned"], report["complete"], report["foreign"]) == (4, True, 0)
    assert (report["in_doubt"], report["sending_past_lease"]) == (1, 0)
    assert report["in_doubt_older_than"] == {"hours": 24, "count": 0}
    assert isinstance(report["oldest_in_doubt"], str) and report["oldest_in_doubt"].endswith("Z")
    assert isinstance(report["oldest_in_doubt_age_s"], float)
    assert 0 <= report["oldest_in_doubt_age_s"] < 30
    assert report["prefix"] == env["RELAY_STORE_PREFIX"]
    assert report["store"] == env["RELAY_STORE"]


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh Redis key prefix, deleted afterwards."""
    name = f"test:stats:{uuid.uuid4().hex}:"
    yield name
    delete_prefix(REDIS_URL, name)


def _fill(prefix: str, values: dict[str, bytes]) -> None:
    with redis.Redis.from_url(REDIS_URL) as client:
        for suffix, value in values.items():
            client.set(prefix + suffix, value, ex=3600)


def test_max_keys_caps_the_scan_and_says_so(tmp_path: Path, prefix: str) -> None:
    """30 records, --max-keys 10: 10 keys looked at, ``complete`` false, a line on stderr
    saying the counts are partial, exit 0; without the cap all 30, complete."""
    _fill(prefix, {str(n): b"0" for n in range(30)})
    env = {"RELAY_STORE": REDIS_URL, "RELAY_STORE_PREFIX": prefix}
    done = run_cli("stats", "--json", "--max-keys", "10", cwd=tmp_path, env=env)
    assert done.returncode == 0, done
    report = json.loads(done.stdout)
    assert (report["scanned"], report["complete"], report["states"]["sent"]) == (10, False, 10)
    assert "stopped after 10 keys (--max-keys): the counts are partial" in done.stderr
    assert "scanned" not in done.stderr  # no progress lines off a terminal
    full = _stats(tmp_path, env)
    assert (full["scanned"], full["complete"], full["states"]) == (
        30, True, {"pending": 0, "sending": 0, "sent": 30, "unknown": 0})


def test_older_than_counts_the_old_records_in_doubt(tmp_path: Path, prefix: str) -> None:
    """UNKNOWN records 50 h, 30 h and 1 h old, a SENDING one whose heartbeat is 40 h old (past
    its 60 s lease) and a foreign value: --older-than 24 counts three, --older-than 48 one; the
    oldest is the 50 h one; the foreign value is a ``sent`` record."""
    now_ms = int(time.time() * 1000)

    def hours_ago(hours: int) -> int:
        return now_ms - hours * 3_600_000

    _fill(prefix, {"a": f"U|{hours_ago(50)}".encode(), "b": f"U|{hours_ago(30)}".encode(),
                   "c": f"U|{hours_ago(1)}".encode(),
                   "d": f"D|tok|{hours_ago(40)}|60000".encode(), "e": b"1"})
    env = {"RELAY_STORE": REDIS_URL, "RELAY_STORE_PREFIX": prefix}
    day = _stats(tmp_path, env)
    assert day["states"] == {"pending": 0, "sending": 1, "sent": 1, "unknown": 3}
    assert (day["in_doubt"], day["sending_past_lease"], day["foreign"]) == (4, 1, 1)
    assert day["in_doubt_older_than"] == {"hours": 24, "count": 3}
    assert day["oldest_in_doubt_age_s"] == pytest.approx(50 * 3600, abs=30)
    two_days = _stats(tmp_path, env, "--older-than", "48")
    assert two_days["in_doubt_older_than"] == {"hours": 48, "count": 1}


def test_the_table_for_a_person(tmp_path: Path, prefix: str) -> None:
    """Without --json: one line per figure on stdout, the store named on stderr."""
    _fill(prefix, {"a": b"0", "b": f"U|{int(time.time() * 1000)}".encode()})
    done = run_cli("stats", cwd=tmp_path,
                   env={"RELAY_STORE": REDIS_URL, "RELAY_STORE_PREFIX": prefix})
    assert done.returncode == 0, done
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["pending", "0"]
    assert lines[2].split()[:2] == ["sent", "1"] and lines[3].split() == ["unknown", "1"]
    assert any(line.split()[:3] == ["in", "doubt", "1"] for line in lines), lines
    assert f"prefix {prefix}, hex keys" in done.stderr


def test_progress_lines_on_request(tmp_path: Path, prefix: str) -> None:
    """--progress: a line on stderr per 100000 keys scanned (the other tests' runs, off a
    terminal, show that none is the default)."""
    with redis.Redis.from_url(REDIS_URL) as client, client.pipeline(transaction=False) as pipe:
        for n in range(100_500):
            pipe.set(f"{prefix}{n}", b"0", ex=600)
        pipe.execute()
    env = {"RELAY_STORE": REDIS_URL, "RELAY_STORE_PREFIX": prefix}
    done = run_cli("stats", "--json", "--progress", cwd=tmp_path, env=env)
    assert done.returncode == 0, done
    assert json.loads(done.stdout)["states"]["sent"] == 100_500
    progress = [line for line in done.stderr.splitlines() if "scanned" in line]
    assert len(progress) == 1 and progress[0].startswith("dedup-relay: scanned 10"), progress


def test_a_store_that_fails_exits_3_and_bad_settings_78(tmp_path: Path) -> None:
    """Redis not answering: exit 3 naming the failure; a missing SQLite file or an invalid
    setting: exit 78, as the other admin commands."""
    down = run_cli("stats", "--json", "--store", "redis://127.0.0.1:1/0", cwd=tmp_path,
                   env={"RELAY_STORE_TIMEOUT": "1"})
    assert down.returncode == 3, down
    assert "store failed: count_states" in down.stderr and down.stdout == ""
    missing = run_cli("stats", "--store", "sqlite:///nowhere.db", cwd=tmp_path)
    assert missing.returncode == 78, missing
    invalid = run_cli("stats", cwd=tmp_path, env={"RELAY_LEASE": "-1"})
    assert invalid.returncode == 78, invalid
