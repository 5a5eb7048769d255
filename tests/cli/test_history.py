"""`dedup-relay history` and the audit rows of `release` / `mark-sent`, run as
processes with the relay's settings (RELAY_* env vars) against a real PostgreSQL ledger in a
private schema: the rows of one store key, oldest first, with the outcome words, `at` and the
upstream reply; the same key from --rcpt/--key; an operator's release and mark-sent recorded;
a ledger that does not answer, or lacks its schema, refuses before the store is touched."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from relay.admin import FingerprintInput, key_for, os_user
from relay.core.interfaces import LedgerAction, LedgerEntry, Record, State
from relay.settings import AdminSettings, load_settings
from relay.store.postgres.ledger import LedgerOptions, insert_rows, key_digest, row_of
from relay.store.sqlite.store import SqliteStore
from tests.support.cli import run_cli
from tests.support.clients import message, send
from tests.support.net import free_port
from tests.support.peers import ScriptedPeer, serve_peer
from tests.support.postgres import private_schema, run_apart
from tests.support.relays import start_serve

pytestmark = pytest.mark.timeout(60)

RCPT, KEY, TEMPLATE = "ann.lee@example.net", "order-4711", "receipt"
T0 = 1_796_000_000.125  # 2026-11-30T...: whole milliseconds survive the ledger's timestamptz


async def _insert(url: str, entries: list[LedgerEntry]) -> None:
    """One row per entry, one statement per entry: ``recorded_at`` follows the list's order."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        for entry in entries:
            await insert_rows(conn, [row_of(entry, LedgerOptions(instance="relay-a/42"))])
    finally:
        await conn.close()


async def _rows(url: str) -> list[dict[str, object]]:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        got = await conn.fetch("SELECT * FROM dedup_relay_ledger ORDER BY decided_at")
    finally:
        await conn.close()
    return [dict(row) for row in got]


def rows_in(url: str) -> list[dict[str, object]]:
    out: list[list[dict[str, object]]] = []

    async def read() -> None:
        out.append(await _rows(url))

    run_apart(read())
    return out[0]


@pytest.fixture
def sqlite_store(tmp_path: Path) -> str:
    """An existing (empty) SQLite store file in ``tmp_path``, as the relay's store URL."""
    sqlite3.connect(tmp_path / "d.db").close()
    return "sqlite:///d.db"


def store_key() -> str:
    """The store key of (RCPT, TEMPLATE, KEY) under the default settings."""
    given = FingerprintInput(rcpt=RCPT, templates=(TEMPLATE,), keys=(KEY,))
    return key_for(load_settings({}, base=AdminSettings), given)[1]


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def test_history_prints_one_keys_rows_oldest_first(ledger_url: str, tmp_path: Path) -> None:
    """A send, a duplicate, an in-doubt retry, an operator's mark-sent for one key, written
    out of order and beside another key's row: `history --store-key K --json` prints exactly
    K's four, oldest first, with their outcome words, `at` and upstream reply; `--rcpt/--key`
    finds the same rows; text mode prints one line each."""
    key = store_key()
    other = key[:-4] + "0000"
    sent = LedgerEntry(decided_at=T0, outcome="relayed", recipient=RCPT, store_key=key,
                       template=TEMPLATE, dedupe_key=KEY,
                       reply="250 2.0.0 Ok: queued as 4Xb2Lk1Zz9z3",
                       upstream_queue_id="4Xb2Lk1Zz9z3", upstream="smarthost.test:25",
                       message_id="<m1@app.test>", queue_id="Q1",
                       client_reply="250 2.0.0 Ok: queued as 4Xb2Lk1Zz9z3")
    dup = LedgerEntry(decided_at=T0 + 60, outcome="suppressed", recipient=RCPT, store_key=key,
                      template=TEMPLATE, dedupe_key=KEY, message_id="<m2@app.test>",
                      queue_id="Q2", client_reply="250 2.0.0 duplicate")
    lost = LedgerEntry(decided_at=T0 + 120, outcome="unknown", recipient=RCPT, store_key=key,
                       template=TEMPLATE, dedupe_key=KEY, upstream="smarthost.test:25",
                       message_id="<m3@app.test>", queue_id="Q3")
    marked = LedgerEntry(decided_at=T0 + 180, outcome="marked_sent", recipient="",
                         store_key=key, action=LedgerAction.MARK_SENT)
    elsewhere = LedgerEntry(decided_at=T0 + 30, outcome="relayed", recipient=RCPT,
                            store_key=other, reply="250 ok")
    run_apart(_insert(ledger_url, [marked, lost, elsewhere, sent, dup]))

    env = {"RELAY_LEDGER": ledger_url}
    done = run_cli("history", "--store-key", key, "--json", cwd=tmp_path, env=env)
    assert done.returncode == 0, done
    got = json.loads(done.stdout)
    assert [r["outcome"] for r in got] == ["relayed", "suppressed", "unknown", "marked_sent"]
    assert [r["at"] for r in got] == [iso(T0), iso(T0 + 60), iso(T0 + 120), iso(T0 + 180)]
    assert got[0]["at"].endswith(".125Z")
    assert [r["reply"] for r in got] == ["250 2.0.0 Ok: queued as 4Xb2Lk1Zz9z3", "", "", ""]
    assert [r["action"] for r in got] == ["relay", "relay", "relay", "mark_sent"]
    first = got[0]
    assert first["store_key"] == key and first["template"] == TEMPLATE
    assert first["recipient"] == "a***@example.net"  # masked by default
    assert first["key"] == key_digest(KEY, None)  # hashed by default
    assert (first["upstream_queue_id"], first["message_id"], first["queue_id"],
            first["upstream"], first["instance"]) == (
        "4Xb2Lk1Zz9z3", "<m1@app.test>", "Q1", "smarthost.test:25", "relay-a/42")
    assert first["client_reply"].startswith("250 2.0.0")
    assert datetime.fromisoformat(first["recorded_at"]) > datetime.fromisoformat(first["at"])

    derived = run_cli("history", "--rcpt", RCPT, "--template", TEMPLATE, "--key", KEY,
                      "--json", cwd=tmp_path, env=env)
    assert derived.returncode == 0, derived
    assert json.loads(derived.stdout) == got

    text = run_cli("history", "--store-key", key, "--limit", "2", cwd=tmp_path, env=env)
    assert text.returncode == 0, text
    lines = text.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(iso(T0)) and " relayed " in lines[0]
    assert "queued as 4Xb2Lk1Zz9z3" in lines[0] and "<m1@app.test>" in lines[0]
    assert " suppressed " in lines[1]
    assert "--limit" in text.stderr


def test_history_of_a_key_without_rows(ledger_url: str, tmp_path: Path) -> None:
    """No rows: `[]` with --json, "no rows" on stderr without; exit 0 both times."""
    env = {"RELAY_LEDGER": ledger_url}
    done = run_cli("history", "--store-key", "email:fp:nothing", "--json", cwd=tmp_path,
                   env=env)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done
    text = run_cli("history", "--store-key", "email:fp:nothing", cwd=tmp_path, env=env)
    assert (text.returncode, text.stdout) == (0, ""), text
    assert "no rows" in text.stderr


def test_history_without_a_ledger_names_the_setting(tmp_path: Path) -> None:
    """No ledger configured: exit 78, naming --ledger and RELAY_LEDGER."""
    done = run_cli("history", "--store-key", "email:fp:x", "--json", cwd=tmp_path)
    assert done.returncode == 78, done
    assert "--ledger" in done.stderr and "RELAY_LEDGER" in done.stderr
    assert done.stdout == ""


def test_history_on_a_ledger_without_its_schema(tmp_path: Path) -> None:
    """The ledger's table missing: exit 3, the message names `db upgrade --ledger`; a
    ledger that does not answer: exit 3 too."""
    with private_schema(upgraded=False) as url:
        done = run_cli("history", "--store-key", "email:fp:x", "--json", cwd=tmp_path,
                       env={"RELAY_LEDGER": url})
    assert done.returncode == 3, done
    assert "db upgrade --ledger" in done.stderr
    down = run_cli("history", "--store-key", "email:fp:x", "--ledger",
                   f"postgresql://postgres@127.0.0.1:{free_port()}/postgres", cwd=tmp_path)
    assert down.returncode == 3, down
    assert "ledger" in down.stderr and down.stdout == ""


def test_mark_sent_and_release_write_their_rows(ledger_url: str, sqlite_store: str,
                                                tmp_path: Path) -> None:
    """mark-sent and then release of a key given with --rcpt/--template/--key: each acts on
    the store and writes its row (action, outcome, store key, masked recipient, template,
    hashed key, HOSTNAME/cli, the reason and the OS user in ``reply``); a release that deletes
    nothing still writes its row (exit 1): the operator's decision settles an in-doubt entry
    whose record already left the store."""
    key = store_key()
    env = {"RELAY_LEDGER": ledger_url, "RELAY_STORE": sqlite_store, "RELAY_HOSTNAME": "ops.test"}
    select = ("--rcpt", RCPT, "--template", TEMPLATE, "--key", KEY)
    marked = run_cli("mark-sent", *select, "--reason", "smarthost log: delivered",
                     cwd=tmp_path, env=env)
    assert marked.returncode == 0, marked
    assert "dedup-relay: ledger: postgresql://" in marked.stderr
    released = run_cli("release", "--store-key", key, "--reason", "customer asked again",
                       cwd=tmp_path, env=env)
    assert released.returncode == 0, released
    assert json.loads(released.stdout)["previous"]["state"] == "sent"
    again = run_cli("release", "--store-key", key, "--reason", "twice", cwd=tmp_path, env=env)
    assert again.returncode == 1, again  # nothing deleted: its row says so

    rows = rows_in(ledger_url)
    assert [(r["action"], r["outcome"]) for r in rows] == [
        ("mark_sent", "marked_sent"), ("release", "released"), ("release", "released")]
    mark, rel, nothing = rows
    assert (mark["store_key"], mark["recipient"], mark["template"], mark["dedupe_key"]) == (
        key, "a***@example.net", TEMPLATE, key_digest(KEY, None))
    user = os_user()
    assert mark["reply"] == f"marked sent by an operator: smarthost log: delivered ({user})"
    assert (rel["store_key"], rel["recipient"], rel["template"], rel["dedupe_key"],
            rel["reply"]) == (key, "", "", None, f"released by {user}: customer asked again")
    said = str(nothing["reply"])
    assert said.startswith("nothing to release") and "twice" in said
    assert mark["instance"] == rel["instance"] == "ops.test/cli"
    now = datetime.now(tz=UTC)
    assert all(abs((now - r["decided_at"]).total_seconds()) < 30  # type: ignore[operator]
               for r in rows)


def test_a_ledger_that_does_not_answer_refuses_before_the_store(
        sqlite_store: str, tmp_path: Path) -> None:
    """release and mark-sent with a ledger that does not answer, or lacks its schema: exit
    3, and the store record is as it was (an operator action is never left unrecorded)."""
    key = store_key()
    path = str(tmp_path / "d.db")
    run_apart(_on_sqlite(path, lambda store: store.force_mark_sent(
        key, reply="250 kept", window_s=3600)))
    before = _inspect(path, key)
    assert (before.state, before.reply) == (State.SENT, "250 kept")

    env = {"RELAY_STORE": sqlite_store,
           "RELAY_LEDGER": f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"}
    released = run_cli("release", "--store-key", key, "--reason", "x", cwd=tmp_path, env=env)
    assert released.returncode == 3, released
    assert "nothing done" in released.stderr and released.stdout == ""
    with private_schema(upgraded=False) as bare:
        marked = run_cli("mark-sent", "--store-key", key, "--reason", "x", cwd=tmp_path,
                         env={**env, "RELAY_LEDGER": bare})
    assert marked.returncode == 3, marked
    assert "db upgrade --ledger" in marked.stderr and marked.stdout == ""

    after = _inspect(path, key)
    assert (after.state, after.at, after.reply) == (before.state, before.at, before.reply)


async def _on_sqlite(path: str, action: Callable[[SqliteStore], Awaitable[object]]) -> None:
    store = await SqliteStore.open(path)
    try:
        await action(store)
    finally:
        await store.close()


def _inspect(path: str, key: str) -> Record:
    got: list[Record] = []

    async def read(store: SqliteStore) -> None:
        got.append(await store.inspect(key))

    run_apart(_on_sqlite(path, read))
    return got[0]


async def _refuse_inserts(url: str) -> None:
    """Make every insert into the ledger's table fail (a trigger raising), schema intact."""
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute("""
            CREATE FUNCTION refuse_row() RETURNS trigger LANGUAGE plpgsql AS
            $$ BEGIN RAISE EXCEPTION 'ledger refuses rows'; END $$;
            CREATE TRIGGER refuse BEFORE INSERT ON dedup_relay_ledger
            FOR EACH ROW EXECUTE FUNCTION refuse_row();""")
    finally:
        await conn.close()


def test_a_row_that_does_not_land_after_the_action_is_said(
        ledger_url: str, sqlite_store: str, tmp_path: Path) -> None:
    """The ledger answers, then refuses the row: the release is done (stdout says so, the
    record is gone) and the command says its row was not written, exit 3."""
    key = store_key()
    path = str(tmp_path / "d.db")
    run_apart(_on_sqlite(path, lambda store: store.force_mark_sent(
        key, reply="250 kept", window_s=3600)))
    run_apart(_refuse_inserts(ledger_url))
    done = run_cli("release", "--store-key", key, "--reason", "x", cwd=tmp_path,
                   env={"RELAY_STORE": sqlite_store, "RELAY_LEDGER": ledger_url})
    assert done.returncode == 3, done
    assert json.loads(done.stdout)["released"] is True
    assert "audit row was not written" in done.stderr and "ledger refuses rows" in done.stderr
    assert _inspect(path, key).state is State.ABSENT
    assert rows_in(ledger_url) == []


@dataclass(kw_only=True)
class QueueingPeer(ScriptedPeer):
    """A smarthost that names a queue id in its 250 to the dot, or (``lose``) reads the dot
    and hangs up without a reply: the relay's attempt is in doubt."""

    lose: bool = False

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"354 go ahead\r\n")
        await writer.drain()
        if not await self.read_to_dot(reader) or self.lose:
            return False
        writer.write(b"250 2.0.0 Ok: queued as 4Xb2Lk1Zz9z3\r\n")
        return True


async def test_history_and_in_doubt_of_a_serving_relay(ledger_url: str, tmp_path: Path) -> None:
    """A relay process with --ledger: a send and its duplicate, then another key's send the
    smarthost loses. `history --rcpt/--template/--key --json` prints relayed then suppressed
    with the smarthost's reply on the first; the lookups find the same rows
    (:func:`lookups_find_the_same_rows`); `in-doubt --json` lists the lost one with its
    Message-ID; after `mark-sent` it is resolved and in-doubt prints []."""
    env = {"RELAY_LEDGER": ledger_url, "RELAY_STORE": f"sqlite:///{tmp_path / 'relay.db'}"}
    async with serve_peer(QueueingPeer()) as peer:
        relay = await start_serve(
            tmp_path, "--upstream", f"127.0.0.1:{peer.port}", "--metrics-listen", "off",
            "--shutdown-grace", "1", workers=1, env=env)
        try:
            data = message(key=KEY, template=TEMPLATE, extra="Message-ID: <one@app.test>\r\n")
            assert (await send(relay.port, [RCPT], data)).code == 250
            assert (await send(relay.port, [RCPT], data)).code == 250  # a duplicate
            peer.lose = True
            lost = message(key="order-4712", template=TEMPLATE,
                           extra="Message-ID: <lost@app.test>\r\n")
            assert (await send(relay.port, [RCPT], lost)).code != 250
        finally:
            await asyncio.to_thread(relay.stop)  # flushes the ledger's queue

    done = await asyncio.to_thread(run_cli, "history", "--rcpt", RCPT, "--template", TEMPLATE,
                                   "--key", KEY, "--json", cwd=tmp_path, env=env)
    assert done.returncode == 0, done
    got = json.loads(done.stdout)
    assert [r["outcome"] for r in got] == ["relayed", "suppressed"]
    assert got[0]["reply"] == "250 2.0.0 Ok: queued as 4Xb2Lk1Zz9z3"
    assert got[0]["upstream_queue_id"] == "4Xb2Lk1Zz9z3"
    assert got[0]["message_id"] == "<one@app.test>" and got[1]["reply"] == ""
    assert got[0]["at"] < got[1]["at"] and all(r["at"].endswith("Z") for r in got)

    await lookups_find_the_same_rows(tmp_path, env, got)

    doubt = await asyncio.to_thread(run_cli, "in-doubt", "--json", cwd=tmp_path, env=env)
    assert doubt.returncode == 0, doubt
    [row] = json.loads(doubt.stdout)
    assert (row["message_id"], row["recipient"], row["template"]) == (
        "<lost@app.test>", "a***@example.net", TEMPLATE)
    marked = await asyncio.to_thread(run_cli, "mark-sent", "--store-key", row["store_key"],
                                     "--reason", "smarthost log: delivered", cwd=tmp_path,
                                     env=env)
    assert marked.returncode == 0, marked
    after = await asyncio.to_thread(run_cli, "in-doubt", "--json", cwd=tmp_path, env=env)
    assert (after.returncode, after.stdout.strip()) == (0, "[]"), after


async def lookups_find_the_same_rows(tmp_path: Path, env: dict[str, str],
                                     fingerprint: list[dict[str, object]]) -> None:
    """`history --rcpt` alone lists all three rows of the recipient newest first (the lost
    message's too); `--message-id` (bare) finds the send and its retry, `--queue-id` (the
    relay's, the smarthost's) and `--since/--until` the send, printed as the fingerprint's
    history prints it; a text line names the queue ids."""
    async def history(*args: str) -> list[dict[str, object]]:
        done = await asyncio.to_thread(run_cli, "history", *args, "--json", cwd=tmp_path,
                                       env=env)
        assert done.returncode == 0, done
        return list(json.loads(done.stdout))

    sent = fingerprint[0]
    by_rcpt = await history("--rcpt", RCPT.upper())
    assert [r["outcome"] for r in by_rcpt] == ["unknown", "suppressed", "relayed"]
    assert by_rcpt[2] == sent
    assert sent["received_at"] is not None and sent["sending_at"] is not None
    assert await history("--message-id", "one@app.test") == [fingerprint[1], sent]  # a retry
    assert await history("--queue-id", str(sent["queue_id"])) == [sent]
    assert sent in await history("--queue-id", "4Xb2Lk1Zz9z3")
    assert await history("--rcpt", RCPT, "--template", TEMPLATE, "--since", str(sent["at"]),
                         "--until", str(fingerprint[1]["at"])) == [sent]
    assert await history("--template", "no-such-template") == []
    text = await asyncio.to_thread(run_cli, "history", "--message-id", "<one@app.test>",
                                   cwd=tmp_path, env=env)
    assert text.returncode == 0 and f"queue-id {sent['queue_id']}" in text.stdout, text


@pytest.mark.parametrize(("args", "said"), [
    ((), "--message-id"),
    (("--rcpt", "no address"), "--rcpt"),
    (("--rcpt", RCPT, "--since", "yesterday"), "--since"),
    (("--since", "2026-03-02", "--until", "2026-03-01"), "period is empty"),
    (("--store-key", "email:fp:x", "--message-id", "<m@a>"), "one or the other"),
    (("--rcpt", RCPT, "--auth-user", "app"), "--auth-user"),
    (("--rcpt", RCPT, "--template", "a", "--template", "b"), "one --template"),
])
def test_a_lookup_history_refuses(ledger_url: str, tmp_path: Path, args: tuple[str, ...],
                                  said: str) -> None:
    """Nothing to look up by, an address the relay refuses, a time it cannot read, an empty
    period, a lookup beside a fingerprint, an AUTH identity or two templates without a key:
    exit 2 and the reason."""
    done = run_cli("history", *args, cwd=tmp_path, env={"RELAY_LEDGER": ledger_url})
    assert done.returncode == 2, done
    assert said in done.stderr, done.stderr
