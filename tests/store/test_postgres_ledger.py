"""The audit ledger's writer on a real PostgreSQL (relay/store/postgres/ledger.py): a batch
written twice lands once (row ids), the retention cleanup deletes only old rows in bounded
statements, the in-doubt gauge counts only unresolved decisions old enough, a full queue
drops and counts, and `db upgrade --ledger` on an empty database and on the current schema.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest

from relay.core.interfaces import LedgerEntry
from relay.store.postgres import migrations
from relay.store.postgres.ledger import (
    COLUMNS,
    LedgerOptions,
    PostgresLedger,
    insert_rows,
    key_digest,
    row_of,
)
from tests.support.cli import run_cli
from tests.support.net import free_port
from tests.support.postgres import private_schema


@pytest.fixture
def url(ledger_url: str) -> str:
    """The ledger's schema (tests/conftest.py's ``ledger_url``)."""
    return ledger_url


@dataclass
class Counted:
    """A LedgerMetrics that keeps what it was told."""

    written: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    queued: int = 0
    up: dict[str, bool] = field(default_factory=dict)
    in_doubt: int = -1

    def ledger_written(self, rows: int) -> None:
        self.written += rows

    def ledger_dropped(self, reason: str, rows: int) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + rows

    def ledger_queued(self, rows: int) -> None:
        self.queued = rows

    def component_up(self, component: str, up: bool) -> None:
        self.up[component] = up

    def in_doubt_unresolved(self, count: int) -> None:
        self.in_doubt = count


@pytest.fixture
async def conn(url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(url, timeout=10)
    yield c
    await c.close()


def entry(outcome: str, key: str = "fp:1", at: float = 1_796_000_000.0,
          rcpt: str = "john.doe@example.com") -> LedgerEntry:
    return LedgerEntry(decided_at=at, outcome=outcome, recipient=rcpt, store_key=key,
                       template="receipt", dedupe_key="order-1")


async def test_a_batch_written_twice_lands_once(conn: asyncpg.Connection) -> None:
    """The retry of a batch whose reply was lost: same row ids, no second row."""
    rows = [row_of(entry("relayed"), LedgerOptions()), row_of(entry("suppressed"),
                                                                LedgerOptions())]
    await insert_rows(conn, rows)
    await insert_rows(conn, rows)
    assert await conn.fetchval("SELECT count(*) FROM dedup_relay_ledger") == 2


def test_rows_mask_recipients_and_hash_keys_unless_told_otherwise() -> None:
    """Masked and SHA-256 by default; HMAC with the fingerprint secret; plain when asked."""
    row = dict(zip(("row_id", "decided_at", "action", "outcome", "store_key", "recipient",
                    "template", "dedupe_key"), row_of(entry("relayed"), LedgerOptions()),
                   strict=False))
    assert row["recipient"] == "j***@example.com"
    assert row["dedupe_key"] == key_digest("order-1", None) != "order-1"
    assert key_digest("order-1", b"s") != key_digest("order-1", None)
    full = row_of(entry("relayed"), LedgerOptions(recipients_full=True, keys_plain=True))
    assert full[5] == "john.doe@example.com" and full[7] == "order-1"


def test_addresses_in_reply_texts_are_masked_unless_recipients_are_kept_full() -> None:
    """The upstream's reply and the client's reply quote the recipient: masked in the row
    as the recipient is, kept as they are with ledger_recipients = full."""
    refused = LedgerEntry(decided_at=1_796_000_000.0, outcome="refused_temp",
                          recipient="jane.roe@example.net", store_key="fp:2",
                          reply="450 4.2.0 <jane.roe@example.net>: greylisted",
                          client_reply="450 4.2.0 <jane.roe@example.net>: greylisted")
    masked = dict(zip(COLUMNS, row_of(refused, LedgerOptions()), strict=True))
    assert masked["reply"] == "450 4.2.0 <j***@example.net>: greylisted"
    assert masked["client_reply"] == "450 4.2.0 <j***@example.net>: greylisted"
    full = dict(zip(COLUMNS, row_of(refused, LedgerOptions(recipients_full=True)), strict=True))
    assert full["reply"] == "450 4.2.0 <jane.roe@example.net>: greylisted"


async def test_cleanup_deletes_only_rows_past_the_retention(
        url: str, conn: asyncpg.Connection) -> None:
    """Rows written 2 days ago go with a 1-day retention; today's stay."""
    await insert_rows(conn, [row_of(entry("relayed", key=f"k{i}"), LedgerOptions())
                             for i in range(5)])
    await conn.execute("UPDATE dedup_relay_ledger SET recorded_at = now() - interval '2 days' "
                       "WHERE store_key IN ('k0', 'k1', 'k2')")
    ledger = await PostgresLedger.open(url, metrics=Counted(),
                                       options=LedgerOptions(retention_s=86400.0),
                                       cleanup_interval_s=None, gauge_interval_s=None)
    try:
        assert await ledger.cleanup() == 3
        assert await ledger.cleanup() == 0
    finally:
        await ledger.close()
    left = await conn.fetch("SELECT store_key FROM dedup_relay_ledger ORDER BY store_key")
    assert [r["store_key"] for r in left] == ["k3", "k4"]


async def test_the_in_doubt_gauge_counts_unresolved_decisions_old_enough(
        url: str, conn: asyncpg.Connection) -> None:
    """unknown then marked_sent: resolved; unknown then held: not; unknown then relayed (sent
    again): resolved; an unknown younger than the window: not counted yet."""
    await conn.execute("SET TIME ZONE 'UTC'")
    db_now = float(await conn.fetchval("SELECT extract(epoch FROM now())"))
    old = db_now - 7200
    options = LedgerOptions()
    rows = [
        entry("unknown", key="a", at=old), entry("marked_sent", key="a", at=old + 60),
        entry("unknown", key="b", at=old), entry("held", key="b", at=old + 60),
        entry("unknown", key="c", at=old), entry("relayed", key="c", at=old + 60),
        entry("unknown", key="d", at=old),
        entry("unknown", key="e", at=db_now - 10),
    ]
    await insert_rows(conn, [row_of(r, options) for r in rows])
    metrics = Counted()
    ledger = await PostgresLedger.open(url, metrics=metrics,
                                       options=LedgerOptions(in_doubt_after_s=3600.0),
                                       cleanup_interval_s=None, gauge_interval_s=None)
    try:
        assert await ledger.refresh_in_doubt() == 2  # b and d
    finally:
        await ledger.close()
    assert metrics.in_doubt == 2


async def test_a_full_queue_drops_and_counts_unless_required(url: str) -> None:
    """The database unreachable (a closed port): queue_max rows kept, the rest counted full;
    required keeps every row of an admitted message and stops admitting."""
    dead = "postgresql://postgres@127.0.0.1:9/postgres"
    metrics = Counted()
    ledger = PostgresLedger(await _pool(dead), metrics=metrics,
                            options=LedgerOptions(queue_max=2), cleanup_interval_s=None,
                            gauge_interval_s=None)
    try:
        ledger.record([entry("relayed", key=f"k{i}") for i in range(3)])
        assert metrics.dropped == {"full": 1} and metrics.queued == 2
        assert ledger.admits()
    finally:
        await ledger.close(flush_s=0)
    assert metrics.dropped == {"full": 1, "shutdown": 2}
    required = Counted()
    ledger = PostgresLedger(await _pool(dead), metrics=required,
                            options=LedgerOptions(queue_max=2, required=True),
                            cleanup_interval_s=None, gauge_interval_s=None)
    try:
        ledger.record([entry("relayed", key=f"k{i}") for i in range(3)])
        assert required.dropped == {} and required.queued == 3
        assert not ledger.admits()
    finally:
        await ledger.close(flush_s=0)


async def _pool(url: str) -> asyncpg.Pool:
    pool = asyncpg.create_pool(url, min_size=0, max_size=1)
    await pool
    return pool


def test_db_upgrade_ledger_on_an_empty_database_and_on_the_current_schema() -> None:
    """Exit 0 both times: "upgraded from version 0 to" the latest, then "current"; --sql prints the
    ledger's table for a DBA."""
    with private_schema(upgraded=False) as empty:
        cmd = [sys.executable, "-m", "relay", "db", "upgrade", "--ledger", empty]
        env = {"PATH": "/usr/bin:/bin"}
        first = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env,
                               check=False)
        assert first.returncode == 0, first.stderr
        latest = migrations.latest("ledger")
        assert "ledger schema" in first.stdout and f"from version 0 to {latest}" in first.stdout
        again = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env,
                               check=False)
        assert again.returncode == 0 and "current" in again.stdout, again
    sql = subprocess.run([sys.executable, "-m", "relay", "db", "upgrade", "--sql", "--ledger",
                          "postgresql://u@h:5432/d"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert sql.returncode == 0 and "CREATE TABLE IF NOT EXISTS dedup_relay_ledger" in sql.stdout
    assert "dedup_relay_fingerprints" not in sql.stdout


async def test_a_row_the_database_refuses_is_dropped_alone(
        url: str, conn: asyncpg.Connection) -> None:
    """A batch with one row PostgreSQL refuses for its data (a NaN time: SQLSTATE 22008) does
    not hold the queue: the other rows land, that one is counted rejected, the ledger is up."""
    metrics = Counted()
    ledger = await PostgresLedger.open(url, metrics=metrics, options=LedgerOptions(),
                                       cleanup_interval_s=None, gauge_interval_s=None)
    try:
        ledger.record([entry("relayed", key="p1"), entry("relayed", key="p2", at=float("nan")),
                       entry("relayed", key="p3")])
        for _ in range(200):
            if metrics.written == 2:
                break
            await asyncio.sleep(0.02)
    finally:
        await ledger.close()
    keys = await conn.fetch("SELECT store_key FROM dedup_relay_ledger ORDER BY store_key")
    assert [r["store_key"] for r in keys] == ["p1", "p3"]
    assert metrics.dropped == {"rejected": 1} and metrics.up["ledger"] is True


def test_check_config_checks_the_files_the_ledger_url_names(tmp_path: Path) -> None:
    """`check-config` refuses a ledger URL naming a TLS file that does not exist (exit 78,
    naming it) without connecting, and accepts one on a closed port, naming it in its
    "configuration ok" line."""
    port = free_port()
    ok = run_cli("check-config", "--upstream", "maildir:md", "--ledger",
                 f"postgresql://relay@127.0.0.1:{port}/audit", "--ledger-required",
                 cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert f"ledger postgresql://relay@127.0.0.1:{port}/audit (required)" in ok.stdout
    missing = run_cli("check-config", "--upstream", "maildir:md", "--ledger",
                      "postgresql://relay@127.0.0.1:5/audit?sslrootcert=/nope/ledger-ca.pem",
                      cwd=tmp_path)
    assert missing.returncode == 78, missing.stderr
    assert "sslrootcert=/nope/ledger-ca.pem" in missing.stderr
