"""`dedup-relay in-doubt`, run as a process with the relay's settings against a real
PostgreSQL ledger in a private schema: the in-doubt (unknown) decisions no later row resolved,
oldest first, with what an operator needs to find them in the smarthost's log; a later
relayed / marked_sent / released row resolves one, a later refusal does not; --older-than
filters by age."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from relay.core.interfaces import LedgerAction, LedgerEntry
from relay.store.postgres import migrations
from relay.store.postgres.ledger import LedgerOptions, insert_rows, row_of
from tests.support.cli import run_cli
from tests.support.postgres import private_schema, run_apart

pytestmark = pytest.mark.timeout(60)

HOUR = 3600.0


async def _setup(url: str, entries: list[LedgerEntry]) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await migrations.upgrade(conn, "ledger")
        await insert_rows(conn, [row_of(e, LedgerOptions(instance="relay-a/7",
                                                         recipients_full=True))
                                 for e in entries])
    finally:
        await conn.close()


def unknown(key: str, at: float, upstream_queue_id: str = "") -> LedgerEntry:
    return LedgerEntry(decided_at=at, outcome="unknown", recipient=f"{key}@example.net",
                       store_key=f"email:fp:{key}", template="t", dedupe_key="k",
                       upstream="smarthost.test:25", message_id=f"<{key}@app.test>",
                       queue_id=f"Q-{key}", client_reply="451 4.4.2 in doubt",
                       upstream_queue_id=upstream_queue_id)


def later(key: str, at: float, outcome: str,
          action: LedgerAction = LedgerAction.RELAY) -> LedgerEntry:
    return LedgerEntry(decided_at=at, outcome=outcome, recipient=f"{key}@example.net",
                       store_key=f"email:fp:{key}", action=action)


@pytest.fixture
def ledger_url() -> Iterator[str]:
    """A ledger (private schema) holding in-doubt decisions, resolved and not:
    ``old`` (2 h, nothing after), ``refused`` (3 h, then a 4yz refusal: still in doubt),
    ``recent`` (10 min), and ``relayed`` / ``marked`` / ``released`` (each 2 h, resolved by
    a later row), plus a relayed row without doubt."""
    now = time.time()
    entries = [
        unknown("old", now - 2 * HOUR, upstream_queue_id="4Xb2Lk1Zz9z3"),
        unknown("refused", now - 3 * HOUR),
        later("refused", now - 2.5 * HOUR, "refused_temp"),
        unknown("recent", now - 600),
        unknown("relayed", now - 2 * HOUR), later("relayed", now - HOUR, "relayed"),
        unknown("marked", now - 2 * HOUR),
        later("marked", now - HOUR, "marked_sent", LedgerAction.MARK_SENT),
        unknown("released", now - 2 * HOUR),
        later("released", now - 90 * 60, "released", LedgerAction.RELEASE),
        later("fine", now - HOUR, "relayed"),
    ]
    with private_schema(upgraded=False) as url:
        run_apart(_setup(url, entries))
        yield url


def test_in_doubt_lists_the_unresolved_oldest_first(ledger_url: str, tmp_path: Path) -> None:
    """Without --older-than: the three unresolved ones, oldest first, each with its store
    key, recipient, template, at, age, upstream queue id, Message-ID, queue id, upstream,
    instance and client reply; a later relayed, marked_sent or released row resolved the
    others, a later refusal did not. --older-than 1h leaves out the recent one."""
    env = {"RELAY_LEDGER": ledger_url}
    done = run_cli("in-doubt", "--json", cwd=tmp_path, env=env)
    assert done.returncode == 0, done
    got = json.loads(done.stdout)
    assert [r["store_key"] for r in got] == ["email:fp:refused", "email:fp:old",
                                             "email:fp:recent"]
    old = got[1]
    assert (old["recipient"], old["template"], old["upstream_queue_id"], old["message_id"],
            old["queue_id"], old["upstream"], old["instance"], old["client_reply"]) == (
        "old@example.net", "t", "4Xb2Lk1Zz9z3", "<old@app.test>", "Q-old",
        "smarthost.test:25", "relay-a/7", "451 4.4.2 in doubt")
    assert got[0]["upstream_queue_id"] == ""
    assert 2 * HOUR - 60 < old["age_s"] < 2 * HOUR + 60
    assert 540 < got[2]["age_s"] < 720
    assert old["at"].endswith("Z") and old["at"][10] == "T"

    hour = run_cli("in-doubt", "--older-than", "1h", "--json", cwd=tmp_path, env=env)
    assert hour.returncode == 0, hour
    assert [r["store_key"] for r in json.loads(hour.stdout)] == ["email:fp:refused",
                                                                 "email:fp:old"]
    minutes = run_cli("in-doubt", "--older-than", "150m", "--json", cwd=tmp_path, env=env)
    assert [r["store_key"] for r in json.loads(minutes.stdout)] == ["email:fp:refused"]


def test_in_doubt_text_says_what_to_do(ledger_url: str, tmp_path: Path) -> None:
    """Text mode: one line per decision (store key, queue id, Message-ID), then how to settle
    them: check the smarthost's log, then mark-sent or release."""
    done = run_cli("in-doubt", "--older-than", "1.5", "--limit", "1", cwd=tmp_path,
                   env={"RELAY_LEDGER": ledger_url})
    assert done.returncode == 0, done
    lines = done.stdout.splitlines()
    assert "email:fp:refused" in lines[0] and "<refused@app.test>" in lines[0]
    assert "email:fp:old" not in done.stdout  # --limit 1
    assert "smarthost's log" in done.stdout
    assert "dedup-relay mark-sent" in done.stdout and "dedup-relay release" in done.stdout
    assert "--limit" in done.stderr


def test_in_doubt_refusals(tmp_path: Path) -> None:
    """A duration it cannot read: exit 2; no ledger configured: exit 78 naming the setting;
    an empty ledger: `[]`."""
    bad = run_cli("in-doubt", "--older-than", "soon", cwd=tmp_path)
    assert bad.returncode == 2, bad
    none = run_cli("in-doubt", "--json", cwd=tmp_path)
    assert none.returncode == 78, none
    assert "RELAY_LEDGER" in none.stderr
    with private_schema(upgraded=False) as url:
        run_apart(_setup(url, []))
        empty = run_cli("in-doubt", "--json", cwd=tmp_path, env={"RELAY_LEDGER": url})
    assert (empty.returncode, empty.stdout.strip()) == (0, "[]"), empty


async def _looked(url: str, looks: dict[str, int], given_up: list[str]) -> None:
    """Count the reconciler's looks at the in-doubt keys of ``looks`` (key -> times) and write
    a ``reconcile_given_up`` row for those of ``given_up``."""
    from relay.store.postgres.ledger_read import LedgerReader

    async with await LedgerReader.open(url) as reader:
        rows = {row.store_key: row for row in await reader.to_reconcile(limit=100)}
        for key, times in looks.items():
            for _ in range(times):
                await reader.note_looks([(rows[f"email:fp:{key}"], "wait: mx1 unknown")])
        await reader.write([LedgerEntry(
            decided_at=time.time(), outcome="reconcile_given_up", recipient="",
            store_key=f"email:fp:{key}", action=LedgerAction.RECONCILE_GIVEN_UP,
            reply="given up by the reconciler") for key in given_up], LedgerOptions())


def test_in_doubt_says_when_the_reconciler_looked(tmp_path: Path) -> None:
    """Each record says what the reconciler did with it (looked at N times, last when and
    what it found; gave up; not looked at yet), the text ends with when it last looked at
    any, and --json holds the same per record. Without any look: it says so."""
    now = time.time()
    with private_schema(upgraded=False) as url:
        run_apart(_setup(url, [unknown("looked", now - 3 * HOUR),
                               unknown("gone", now - 2 * HOUR), unknown("new", now - HOUR)]))
        env = {"RELAY_LEDGER": url}
        before = run_cli("in-doubt", cwd=tmp_path, env=env)
        assert before.returncode == 0, before
        assert "has not looked at any in-doubt record" in before.stdout
        run_apart(_looked(url, {"looked": 2, "gone": 1}, ["gone"]))

        text = run_cli("in-doubt", cwd=tmp_path, env=env)
        got = json.loads(run_cli("in-doubt", "--json", cwd=tmp_path, env=env).stdout)
    assert text.returncode == 0, text
    lines = text.stdout.splitlines()
    assert "email:fp:looked" in lines[0]
    assert lines[1].strip().startswith("reconciler: looked 2 time(s), last ")
    assert lines[1].endswith("wait: mx1 unknown")
    assert "email:fp:gone" in lines[2] and "reconciler: gave up" in lines[3]
    assert "email:fp:new" in lines[4] and "reconciler: not looked at yet" in lines[5]
    assert "the reconciler last looked at 20" in text.stdout
    by_key = {r["store_key"]: r["reconcile"] for r in got}
    assert by_key["email:fp:looked"]["looks"] == 2
    assert by_key["email:fp:looked"]["answer"] == "wait: mx1 unknown"
    assert by_key["email:fp:gone"]["given_up"] and not by_key["email:fp:looked"]["given_up"]
    assert by_key["email:fp:new"] == {"looks": 0, "looked_at": None, "answer": None,
                                      "given_up": False}
