"""The PostgreSQL store beyond the shared contract (tests/store/test_store_contract.py): its
schema (``dedup-relay db upgrade``, ``--sql``, the check at open), the bounded cleanup of
expired rows, and that every time it records is the database's clock, never the process's.

Each test works in a private schema of the server at ``RELAY_TEST_POSTGRES_URL``
(tests/support/postgres.py), dropped at its end; a server that does not answer fails the test.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from pydantic import ValidationError

from bench.faultbench.lib import _libfaketime
from relay.core.errors import StartupError, StoreError
from relay.core.interfaces import LimitCheck, Settle, SettleOp, State
from relay.settings import RateLimit, Settings, redact_url
from relay.store.postgres import migrations
from relay.store.postgres.store import PostgresStore
from tests.support.cli import REPO, run_cli
from tests.support.clients import message, send
from tests.support.net import free_port
from tests.support.postgres import private_schema
from tests.support.relays import MakeRelay
from tests.support.sink import Sink
from tests.support.waiting import until


@pytest.fixture
def empty_url() -> Iterator[str]:
    """The URL of a private schema with no table in it."""
    with private_schema(upgraded=False) as url:
        yield url


@pytest.fixture
def url() -> Iterator[str]:
    """The URL of a private schema holding the store's current tables."""
    with private_schema() as url:
        yield url


async def _version(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return await migrations.current(conn, "store")
    finally:
        await conn.close()


async def test_db_upgrade_creates_the_schema_then_finds_it_current(
        empty_url: str, tmp_path: Path) -> None:
    """`db upgrade` on an empty database creates the table (exit 0), and on the current
    schema changes nothing (exit 0 again); the store then opens."""
    first = run_cli("db", "upgrade", "--store", empty_url, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert f"upgraded from version 0 to {migrations.latest('store')}" in first.stdout
    again = run_cli("db", "upgrade", "--store", empty_url, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "current" in again.stdout
    assert await _version(empty_url) == migrations.latest("store")
    store = await PostgresStore.open(empty_url, cleanup_interval_s=None)
    await store.close()


async def test_db_upgrade_sql_prints_what_upgrade_runs_without_a_database(
        empty_url: str, tmp_path: Path) -> None:
    """`db upgrade --sql` prints the SQL without connecting (a closed port); applied by hand
    it gives the current schema."""
    nowhere = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    printed = run_cli("db", "upgrade", "--store", nowhere, "--sql", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert "CREATE TABLE IF NOT EXISTS dedup_relay_fingerprints" in printed.stdout
    conn = await asyncpg.connect(empty_url)
    try:
        await conn.execute(printed.stdout)
        await migrations.check(conn, "store")  # raises SchemaError unless current
    finally:
        await conn.close()


def test_db_upgrade_refuses_other_stores_and_reports_a_dead_database(tmp_path: Path) -> None:
    """A store that is no PostgreSQL one is a usage error (2); a database that does not
    answer exits 3."""
    other = run_cli("db", "upgrade", "--store", "redis://127.0.0.1:6379/0", cwd=tmp_path)
    assert other.returncode == 2, other.stderr
    dead = run_cli("db", "upgrade", "--store",
                   f"postgresql://postgres@127.0.0.1:{free_port()}/postgres",
                   "--timeout", "5", cwd=tmp_path)
    assert dead.returncode == 3, dead.stderr


async def test_open_refuses_a_missing_schema_naming_db_upgrade(empty_url: str) -> None:
    """The store checks the schema when it opens: missing -> StartupError naming the command."""
    with pytest.raises(StartupError, match="dedup-relay db upgrade"):
        await PostgresStore.open(empty_url, cleanup_interval_s=None)


async def test_open_refuses_an_old_schema(url: str) -> None:
    """A schema older than the code (its version row behind) is refused too."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("UPDATE dedup_relay_schema SET version = 0 WHERE component = 'store'")
    finally:
        await conn.close()
    with pytest.raises(StartupError, match="db upgrade"):
        await PostgresStore.open(url, cleanup_interval_s=None)


async def _at_version_1(url: str) -> None:
    """Make the empty schema at ``url`` what `db upgrade` of a relay before the rate limits
    made: the store's step 1 and version 1."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(migrations._SCHEMA_TABLE_SQL)
        await conn.execute(migrations.STEPS["store"][0])
        await conn.execute("INSERT INTO dedup_relay_schema VALUES ('store', 1)")
    finally:
        await conn.close()


LATEST = migrations.latest("store")


async def test_a_schema_at_version_1_is_told_to_run_db_upgrade_then_upgrades(
        empty_url: str, tmp_path: Path) -> None:
    """A database upgraded before the rate limits (version 1): the store refuses to open,
    naming both versions and the command; `db upgrade` takes it from 1 to this code's
    version (the rate-limit tables and functions, the content digest), and the store then
    opens and limits."""
    await _at_version_1(empty_url)
    with pytest.raises(StartupError, match=rf"at version 1, this relay needs {LATEST}: run "
                                           r"`dedup-relay db upgrade --store URL`"):
        await PostgresStore.open(empty_url, cleanup_interval_s=None)
    done = run_cli("db", "upgrade", "--store", empty_url, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"upgraded from version 1 to {LATEST}" in done.stdout, done.stdout
    await _limits_work(empty_url)


async def _limits_work(url: str) -> None:
    store = await PostgresStore.open(url, cleanup_interval_s=None)
    try:
        one = LimitCheck("v2", "messages", "v2:m:upstream:x", 1, 60.0)
        assert (await store.rate_limiter("p:").acquire([one])).allowed
        assert (await store.rate_limiter("p:").acquire([one])).refused == one
    finally:
        await store.close()


async def test_the_sql_script_takes_a_version_1_schema_to_the_latest(empty_url: str) -> None:
    """`db upgrade --sql` applied by a DBA on a database at version 1: every step again (step
    1 changes nothing), this code's version; the fingerprints already there stay."""
    await _at_version_1(empty_url)
    conn = await asyncpg.connect(empty_url)
    try:
        await conn.execute("INSERT INTO dedup_relay_fingerprints (key, state, expires_at) "
                           "VALUES ('kept', 'sent', 'infinity')")
        await conn.execute(migrations.script("store"))
        assert await migrations.current(conn, "store") == LATEST
        assert await conn.fetchval("SELECT count(*) FROM dedup_relay_fingerprints") == 1
    finally:
        await conn.close()
    await _limits_work(empty_url)


async def test_the_sql_script_never_lowers_a_newer_schema(url: str) -> None:
    """On a database a newer relay upgraded (one version past this code's) the script stops
    at its start: an error, nothing applied, the version unchanged (it never writes a lower
    one)."""
    newer = LATEST + 1
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("UPDATE dedup_relay_schema SET version = $1 WHERE component = 'store'",
                           newer)
        await conn.execute("DROP FUNCTION dedup_relay_rate_give_back")
        with pytest.raises(asyncpg.RaiseError,
                           match=f"at version {newer}, newer than this script's {LATEST}"):
            await conn.execute(migrations.script("store"))
        await conn.execute("ROLLBACK")  # what psql's COMMIT at the script's end does then
        assert await migrations.current(conn, "store") == newer
        assert not await conn.fetchval(
            "SELECT to_regproc('dedup_relay_rate_give_back') IS NOT NULL")
    finally:
        await conn.close()


async def _expired_rows(url: str, count: int, live: int = 0) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(
            "INSERT INTO dedup_relay_fingerprints (key, state, at, expires_at) "
            "SELECT 'old:' || i, 'sent', now(), now() - interval '1 second' "
            "FROM generate_series(1, $1) AS i", count)
        await conn.execute(
            "INSERT INTO dedup_relay_fingerprints (key, state, at, expires_at) "
            "SELECT 'live:' || i, 'sent', now(), now() + interval '1 hour' "
            "FROM generate_series(1, $1) AS i", live)
    finally:
        await conn.close()


async def _rows(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM dedup_relay_fingerprints"))
    finally:
        await conn.close()


async def test_cleanup_deletes_expired_rows_in_bounded_batches(url: str) -> None:
    """One cleanup round deletes at most batch x max_batches expired rows and never a live
    one; the next rounds take the rest."""
    await _expired_rows(url, 250, live=5)
    store = await PostgresStore.open(url, cleanup_interval_s=None)
    try:
        assert await store.delete_expired(batch=100, max_batches=2) == 200
        assert await _rows(url) == 55
        assert await store.delete_expired(batch=100, max_batches=2) == 50
        assert await store.delete_expired(batch=100, max_batches=2) == 0
    finally:
        await store.close()
    assert await _rows(url) == 5


async def test_the_cleanup_task_runs_while_open_and_stops_at_close(url: str) -> None:
    """The store's own task deletes expired rows every interval; after close it is gone."""
    await _expired_rows(url, 30, live=2)
    store = await PostgresStore.open(url, cleanup_interval_s=0.05)
    try:
        await until(lambda: _rows_is(url, 2), what="the cleanup of the expired rows")
    finally:
        await store.close()
    assert store._cleanup is not None and store._cleanup.done()
    await _expired_rows(url, 3)
    assert await _rows(url) == 5  # nothing deletes them any more


async def _rows_is(url: str, count: int) -> bool:
    return await _rows(url) == count


async def test_closed_store_raises_store_error(url: str) -> None:
    """A call after close raises StoreError naming the operation."""
    store = await PostgresStore.open(url, cleanup_interval_s=None)
    await store.close()
    with pytest.raises(StoreError, match="reserve"):
        await store.reserve(["k"], token="t", lease_s=60)


async def test_unreachable_database_raises_store_error() -> None:
    """A database that refuses connections: open logs and returns, every call raises
    StoreError within the op timeout."""
    store = await PostgresStore.open(
        f"postgresql://postgres@127.0.0.1:{free_port()}/postgres", op_timeout_s=0.5,
        cleanup_interval_s=None)
    try:
        with pytest.raises(StoreError, match="ping"):
            await store.ping()
    finally:
        await store.close()


_UNDER_FAKETIME = """
import asyncio, sys
from relay.core.interfaces import Settle, SettleOp
from relay.store.postgres.store import PostgresStore

async def main(url):
    store = await PostgresStore.open(url, cleanup_interval_s=None)
    await store.reserve(["lease", "sent"], token="t", lease_s=60)
    await store.settle([SettleOp("sent", Settle.SENT, "250 ok")], token="t", window_s=600)
    await store.close()

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="libfaketime")
async def test_a_process_an_hour_ahead_does_not_change_leases_or_times(url: str) -> None:
    """A process whose wall clock is an hour ahead (libfaketime) reserves and marks SENT: the
    lease and the window count from the database's now, and the record's time is the
    database's, so another process reads the normal lease and age."""
    env = {"LD_PRELOAD": _libfaketime(), "FAKETIME": "+1h", "PATH": "/usr/bin:/bin"}
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", _UNDER_FAKETIME, url], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    store = await PostgresStore.open(url, cleanup_interval_s=None)
    try:
        pending = await store.inspect("lease")
        sent = await store.inspect("sent")
    finally:
        await store.close()
    assert pending.state is State.PENDING and pending.ttl_s is not None
    assert 50 < pending.ttl_s <= 60, pending
    assert sent.state is State.SENT and sent.at is not None and sent.ttl_s is not None
    assert abs(sent.at - time.time()) < 30, sent
    assert 590 < sent.ttl_s <= 600, sent


async def test_settle_uses_each_ops_own_window(url: str) -> None:
    """SettleOp.window_s > 0 is that op's window; 0 takes the call's."""
    store = await PostgresStore.open(url, cleanup_interval_s=None)
    try:
        await store.reserve(["a", "b"], token="t", lease_s=60)
        assert await store.settle([SettleOp("a", Settle.SENT, window_s=120.0),
                                   SettleOp("b", Settle.UNKNOWN)], token="t",
                                  window_s=3600) == [True, True]
        a, b = await store.inspect("a"), await store.inspect("b")
    finally:
        await store.close()
    assert a.ttl_s is not None and 110 < a.ttl_s <= 120, a
    assert b.ttl_s is not None and 3590 < b.ttl_s <= 3600, b


def test_check_config_takes_a_postgres_url_without_connecting(tmp_path: Path) -> None:
    """`check-config` accepts a postgresql:// URL on a closed port (no connection is opened)
    and refuses a TLS file the URL names that does not exist, naming it."""
    port = free_port()
    done = run_cli("check-config", "--upstream", "maildir:md", "--store",
                   f"postgresql://relay:pw@127.0.0.1:{port}/relay?sslmode=verify-full",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    missing = run_cli("check-config", "--upstream", "maildir:md", "--store",
                      f"postgresql://relay@127.0.0.1:{port}/relay?sslrootcert=/nope/ca.pem",
                      cwd=tmp_path)
    assert missing.returncode == 78, missing.stderr
    assert "sslrootcert=/nope/ca.pem" in missing.stderr


def test_store_setting_takes_both_schemes_and_wants_a_database() -> None:
    """``postgres://`` is ``postgresql://``; a URL naming no database is refused."""
    settings = Settings.model_validate({"store": "postgres://u@h:5432/db",
                                        "upstream": "maildir:md"})
    assert settings.store == "postgres://u@h:5432/db"
    with pytest.raises(ValidationError, match="must name its database"):
        Settings.model_validate({"store": "postgresql://u@h:5432", "upstream": "maildir:md"})


def test_redact_url_masks_a_postgres_password() -> None:
    """The password of a postgresql:// URL never reaches a log line."""
    assert redact_url("postgresql://relay:s3cret@db:5432/relay?sslmode=require") == \
        "postgresql://relay:***@db:5432/relay?sslmode=require"
    assert "s3cret" not in redact_url("postgres://relay@db/relay?password=s3cret")


async def test_concurrent_reserves_of_one_key_have_one_winner(url: str) -> None:
    """Twenty attempts on two pools reserve the same keys at once: each key has exactly one
    holder, and every loser is told the winner's PENDING. (A generous op timeout: twenty
    reserves queue on one row's lock, which a loaded runner serves slowly.)"""
    stores = [await PostgresStore.open(url, op_timeout_s=30.0, cleanup_interval_s=None)
              for _ in range(2)]
    keys = ["race:b", "race:a", "race:c"]
    try:
        results = await asyncio.gather(*(
            stores[i % 2].reserve(keys, token=f"t{i}", lease_s=60) for i in range(20)))
    finally:
        for store in stores:
            await store.close()
    for index, key in enumerate(keys):
        answers = [(f"t{i}", result[index]) for i, result in enumerate(results)]
        winners = [token for token, answer in answers if answer.reserved]
        assert len(winners) == 1, (key, winners)
        for token, answer in answers:
            if token != winners[0]:
                assert answer.found is not None and answer.found.state is State.PENDING
                assert answer.found.token == winners[0]


async def test_count_states_counts_live_rows_by_state_under_the_prefix(url: str) -> None:
    """`dedup-relay stats`'s count: by state, under the prefix only, SENDING past its lease
    and UNKNOWN in doubt, a foreign state counted as SENT and foreign."""
    store = await PostgresStore.open(url, cleanup_interval_s=None)
    try:
        await store.reserve(["p:pend", "p:sent", "p:unk", "p:send", "q:other"], token="t",
                            lease_s=60)
        await store.settle([SettleOp("p:sent", Settle.SENT, "250 ok"),
                            SettleOp("p:unk", Settle.UNKNOWN),
                            SettleOp("p:send", Settle.SENDING, lease_s=0.001)],
                           token="t", window_s=3600)
        await store._pool.execute(
            "INSERT INTO dedup_relay_fingerprints (key, state, expires_at) "
            "VALUES ('p:foreign', 'x', 'infinity'), ('p:gone', 'sent', now() - interval '1s')")
        await until(lambda: _in_doubt(store), what="the SENDING row past its 1 ms lease")
        counts = await store.count_states("p:", lease_s=60, older_than_s=3600)
    finally:
        await store.close()
    assert (counts.pending, counts.sending, counts.sent, counts.unknown, counts.foreign) == \
        (1, 1, 2, 1, 1), counts
    assert counts.sending_past_lease == 1 and counts.in_doubt == 2, counts
    assert counts.scanned == 5 and counts.in_doubt_older == 0, counts
    assert counts.oldest_in_doubt_at is not None and abs(counts.oldest_in_doubt_at
                                                         - time.time()) < 30, counts


async def _in_doubt(store: PostgresStore) -> bool:
    counts = await store.count_states("p:", lease_s=60, older_than_s=3600)
    return counts.sending_past_lease == 1


async def test_rate_limits_on_the_postgres_store_are_enforced(
        url: str, tmp_path: Path, make_relay: MakeRelay, sink: Sink) -> None:
    """A ``[[rate_limit]]`` with a PostgreSQL store passes `check-config` (it was refused, exit
    78, while the store kept no counters), and a relay on the store enforces it: 2 messages a
    minute, the third is answered 451 4.7.0 and not sent."""
    config = tmp_path / "relay.toml"
    config.write_text('upstream = "maildir:md"\n'
                      f'store = "postgresql://relay@127.0.0.1:{free_port()}/relay"\n'
                      '[[rate_limit]]\nscope = "upstream"\nmessages = 10\nper = 60\n')
    done = run_cli("check-config", "--config", str(config), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=url,
                             rate_limit=(RateLimit(scope="upstream", messages=2, per=60,
                                                   name="pg-quota"),))
    replies = [await send(relay.port, ["user@example.net"], message(key=f"PG-RL-{n}"))
               for n in range(3)]
    assert [r.code for r in replies] == [250, 250, 451], replies
    assert replies[2].text.startswith("4.7.0 rate limit pg-quota reached"), replies[2]
    assert len(sink.handler.delivered) == 2


def test_admin_commands_on_a_missing_schema_exit_3_naming_db_upgrade(
        empty_url: str, tmp_path: Path) -> None:
    """`inspect` on a PostgreSQL store with no schema: exit 3, the message names the command."""
    done = run_cli("inspect", "--store", empty_url, "--store-key", "email:fp:x", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert "dedup-relay db upgrade" in done.stderr, done.stderr
