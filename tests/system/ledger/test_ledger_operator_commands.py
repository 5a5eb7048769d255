"""The audit ledger as an operator meets it through the commands and settings.

- ``ledger_required = true`` with no ``ledger`` is invalid configuration (exit 78), never a relay
  running with no audit trail.
- The ledger row of an in-doubt decision names the upstream that took the final dot (with
  several upstreams the row is the only place that says where to look the Message-ID up).
- ``dedup-relay in-doubt --older-than`` with a duration out of range is bad input (exit 2).
- ``dedup-relay history`` checks the files its ledger URL names (``passfile=``) as
  ``check-config`` and ``serve`` do (exit 78).
- ``release`` settles an in-doubt decision whose store record has expired (the window passed
  before an operator got to it): it writes the row that resolves it.

The CLI cases run ``python -m relay`` as a process against the shared PostgreSQL on
127.0.0.1:5432 (a private schema holding the ledger's table); the in-doubt row is written by
an in-process relay in front of the test sink, whose reply to the final dot comes too late.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import asyncpg
import redis

from tests.support.cli import run_cli
from tests.support.clients import message, send
from tests.support.relays import REDIS_URL, MakeRelay
from tests.support.sink import Sink


async def _rows(url: str, count: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The ledger's rows at ``url`` (oldest first) once there are ``count``; fails after
    ``timeout_s`` seconds with what there is."""
    deadline = time.monotonic() + timeout_s
    while True:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            got = [dict(r) for r in await conn.fetch(
                "SELECT * FROM dedup_relay_ledger ORDER BY decided_at, recorded_at")]
        finally:
            await conn.close()
        if len(got) >= count or time.monotonic() > deadline:
            assert len(got) == count, got
            return got
        await asyncio.sleep(0.05)


def test_ledger_required_without_a_ledger_is_invalid_configuration(tmp_path: Path) -> None:
    """check-config --ledger-required with no --ledger/RELAY_LEDGER/`ledger`: exit 78 naming
    the ledger setting, not 'configuration ok'."""
    done = run_cli("check-config", "--store", f"sqlite:///{tmp_path / 'd.db'}",
                   "--upstream", "127.0.0.1:25", "--ledger-required", cwd=tmp_path)
    assert done.returncode == 78, (done.returncode, done.stdout, done.stderr)
    assert "ledger" in done.stderr


async def test_in_doubt_row_names_the_upstream_that_took_the_final_dot(
        make_relay: MakeRelay, sink: Sink, ledger_url: str) -> None:
    """The smarthost takes the final dot and answers too late: the relay answers 451 and
    writes an `unknown` row; that row's `upstream` is the upstream it sent to."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                             upstream_timeout=0.6)
    sink.handler.hang_after_dot_s = 2.0
    doubt = await send(relay.port, ["cy@example.net"],
                       message(key="order-3", extra="Message-ID: <d1@app.example>\r\n"))
    assert doubt.code == 451, doubt
    sink.handler.hang_after_dot_s = 0.0
    (row,) = await _rows(ledger_url, 1)
    assert row["outcome"] == "unknown"
    assert row["message_id"] == "<d1@app.example>"
    assert row["upstream"] == f"127.0.0.1:{sink.port}", row


def test_in_doubt_older_than_out_of_range_is_bad_input(tmp_path: Path, ledger_url: str) -> None:
    """A duration PostgreSQL cannot subtract from now() is the operator's input, not the
    ledger failing: exit 2."""
    done = run_cli("in-doubt", "--ledger", ledger_url, "--older-than", "3000000d", "--json",
                   cwd=tmp_path)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)


def test_history_with_a_missing_passfile_is_invalid_configuration(tmp_path: Path,
                                                                  ledger_url: str) -> None:
    """`passfile=` naming no file: check-config refuses it (78, 'no such file'); history,
    reading the same settings, says the same rather than trying to connect."""
    missing = tmp_path / "no-pgpass"
    sep = "&" if "?" in ledger_url else "?"
    url = f"{ledger_url}{sep}passfile={missing}"
    checked = run_cli("check-config", "--store", f"sqlite:///{tmp_path / 'd.db'}",
                      "--upstream", "127.0.0.1:25", "--ledger", url, cwd=tmp_path)
    assert checked.returncode == 78 and "no such file" in checked.stderr, checked.stderr
    done = run_cli("history", "--ledger", url, "--store-key", "email:fp:00", "--json",
                   cwd=tmp_path)
    assert done.returncode == 78, (done.returncode, done.stdout, done.stderr)
    assert "passfile" in done.stderr


async def test_release_settles_an_in_doubt_decision_whose_record_expired(
        make_relay: MakeRelay, sink: Sink, ledger_url: str, tmp_path: Path) -> None:
    """In doubt, then the record leaves the store (its dedup window passed: the key deleted
    here, as Redis's expiry does); the operator finds "never received" in the smarthost's
    log and runs `release --store-key KEY`: the decision is settled, `in-doubt` lists
    nothing."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                             upstream_timeout=0.6)
    sink.handler.hang_after_dot_s = 2.0
    doubt = await send(relay.port, ["late@example.net"], message(key="order-5"))
    assert doubt.code == 451, doubt
    sink.handler.hang_after_dot_s = 0.0
    (row,) = await _rows(ledger_url, 1)
    key = row["store_key"]
    assert row["outcome"] == "unknown" and key
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        assert client.delete(key) == 1  # the dedup window passed
    finally:
        client.close()
    env = {"RELAY_STORE": REDIS_URL, "RELAY_STORE_PREFIX": relay.settings.store_prefix,
           "RELAY_LEDGER": ledger_url}
    before = await asyncio.to_thread(run_cli, "in-doubt", "--json", cwd=tmp_path, env=env)
    assert before.returncode == 0 and key in before.stdout, before
    released = await asyncio.to_thread(
        run_cli, "release", "--store-key", key, "--reason", "smarthost log: never received",
        cwd=tmp_path, env=env)
    after = await asyncio.to_thread(run_cli, "in-doubt", "--json", cwd=tmp_path, env=env)
    assert after.returncode == 0, after
    assert after.stdout.strip() == "[]", (released.returncode, released.stderr, after.stdout)
