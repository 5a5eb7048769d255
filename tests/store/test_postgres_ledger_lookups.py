"""The audit ledger's lookups on a real PostgreSQL (relay/store/postgres/ledger_query.py,
ledger_read.py): `db upgrade --ledger` takes a ledger at schema version 3, rows in it, to
version 4 (the recipient digest column and the lookups' indexes; the old rows kept); a
recipient is found by its digest alone while the row keeps it masked; a Message-ID with or
without its brackets, the relay's and the smarthost's queue id, a template and a period each
find their rows, newest first, in keyset pages that neither repeat nor skip a row; a
message's timeline holds its rows and the later ones of its store keys, oldest first.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from relay.core.fingerprint import recipient_digest as digest_or_none
from relay.core.interfaces import LedgerAction, LedgerEntry
from relay.store.postgres import migrations
from relay.store.postgres.ledger import LedgerOptions, insert_rows, row_of
from relay.store.postgres.ledger_query import LedgerQuery, Position
from relay.store.postgres.ledger_read import LedgerReader
from tests.support.postgres import private_schema

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
CUSTOMER = "Jane.Roe@Example.NET"


@pytest.fixture
async def reader(ledger_url: str) -> AsyncIterator[LedgerReader]:
    r = await LedgerReader.open(ledger_url)
    yield r
    await r.close()


def entry(i: int, *, rcpt: str = "someone@example.org", outcome: str = "relayed",
          message_id: str = "", queue_id: str = "", upstream_queue_id: str = "",
          template: str = "receipt", store_key: str | None = None,
          at: datetime | None = None) -> LedgerEntry:
    decided = (at or T0 + timedelta(minutes=i)).timestamp()
    return LedgerEntry(decided_at=decided, outcome=outcome, recipient=rcpt,
                       store_key=store_key or f"email:fp:{i:064x}", template=template,
                       message_id=message_id, queue_id=queue_id or f"q{i:011x}",
                       upstream_queue_id=upstream_queue_id, received_at=decided - 0.5,
                       sending_at=decided - 0.2)


def recipient_digest(address: str, *, secret: bytes | None = None) -> str:
    """The ledger's digest of ``address`` (one the relay takes)."""
    digest = digest_or_none(address, secret=secret)
    assert digest is not None
    return digest


async def write(url: str, entries: list[LedgerEntry], options: LedgerOptions | None = None
                ) -> None:
    conn = await asyncpg.connect(url, timeout=10)
    try:
        await insert_rows(conn, [row_of(e, options or LedgerOptions()) for e in entries])
    finally:
        await conn.close()


async def test_db_upgrade_takes_a_ledger_with_rows_from_version_3_to_4() -> None:
    """A ledger made by the previous relay (schema version 3) with rows in it: `db upgrade
    --ledger` adds the digest and time columns and the lookups' indexes, keeps every row
    (their digest NULL: the address is not in them to digest; their key source and
    ``key_reused`` as written), and the rows written after it are found by recipient."""
    with private_schema(upgraded=False) as url:
        conn = await asyncpg.connect(url, timeout=10)
        try:
            async with conn.transaction():
                await conn.execute(f"CREATE TABLE {migrations.SCHEMA_TABLE} "
                                   "(component text PRIMARY KEY, version integer NOT NULL)")
                for step in migrations.STEPS["ledger"][:3]:
                    await conn.execute(step)
                await conn.execute("INSERT INTO dedup_relay_schema VALUES ('ledger', 3)")
            await conn.executemany(
                "INSERT INTO dedup_relay_ledger (row_id, decided_at, action, outcome, "
                "store_key, recipient, message_id, queue_id, key_source, key_reused) "
                "VALUES ($1, $2, 'relay', 'relayed', $3, 'j***@example.net', $4, $5, "
                "'header', true)",
                [(uuid.uuid4(), T0 + timedelta(minutes=i), f"email:fp:{i}", f"<old-{i}@a>",
                  f"old{i}") for i in range(20)])
            with pytest.raises(migrations.SchemaError, match="version 3"):
                await migrations.check(conn, "ledger")
            upgraded = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "relay", "db", "upgrade", "--ledger", url],
                capture_output=True, text=True, timeout=60, check=False,
                env={"PATH": "/usr/bin:/bin"})
            assert upgraded.returncode == 0, upgraded.stderr
            assert f"from version 3 to {migrations.latest('ledger')}" in upgraded.stdout
            await migrations.check(conn, "ledger")
            indexes = {r["indexname"] for r in await conn.fetch(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'dedup_relay_ledger'")}
            assert {f"dedup_relay_ledger_{name}" for name in (
                "recipient_digest", "message_id", "queue_id", "upstream_queue_id",
                "template", "decided_at")} <= indexes
            old = await conn.fetch("SELECT recipient, recipient_digest, received_at, "
                                   "key_source, key_reused FROM dedup_relay_ledger")
            assert len(old) == 20
            assert {(r["recipient"], r["recipient_digest"], r["received_at"], r["key_source"],
                     r["key_reused"])
                    for r in old} == {("j***@example.net", None, None, "header", True)}
        finally:
            await conn.close()
        await write(url, [entry(100, rcpt=CUSTOMER, message_id="<new@a>")])
        async with await LedgerReader.open(url) as reader:
            page = await reader.search(LedgerQuery(recipient_digests=[recipient_digest(
                "jane.roe@example.net")]), limit=10)
            assert [r.message_id for r in page.rows] == ["<new@a>"]
            assert page.rows[0].recipient == "J***@Example.NET"  # masked as written
            old_page = await reader.search(LedgerQuery(message_ids=["<old-3@a>"]), limit=10)
            assert [r.queue_id for r in old_page.rows] == ["old3"]


async def test_a_recipient_is_found_by_its_digest_alone(
        ledger_url: str, reader: LedgerReader) -> None:
    """Three spellings of one address find the same rows, newest first; the rows hold it
    masked; with a fingerprint secret the digest is keyed (the unkeyed one finds nothing)."""
    await write(ledger_url, [entry(1, rcpt=CUSTOMER), entry(2, rcpt="other@example.net"),
                             entry(3, rcpt="<jane.roe@example.net>")])
    for spelling in (CUSTOMER, "jane.roe@example.net", " <JANE.ROE@example.net> "):
        page = await reader.search(LedgerQuery(recipient_digests=[recipient_digest(spelling)]),
                                   limit=10)
        assert [r.queue_id for r in page.rows] == [f"q{3:011x}", f"q{1:011x}"], spelling
        assert all("jane" not in r.recipient.lower() for r in page.rows)
        assert page.next is None
    secret = b"s3cret"
    await write(ledger_url, [entry(4, rcpt="keyed@example.net")], LedgerOptions(secret=secret))
    keyed = recipient_digest("keyed@example.net", secret=secret)
    assert keyed != recipient_digest("keyed@example.net")
    assert len((await reader.search(LedgerQuery(recipient_digests=[keyed]), limit=5)).rows) == 1
    assert not (await reader.search(LedgerQuery(
        recipient_digests=[recipient_digest("keyed@example.net")]), limit=5)).rows


async def test_each_lookup_finds_its_rows(ledger_url: str, reader: LedgerReader) -> None:
    """By Message-ID (as written, with brackets), by the relay's queue id and by the
    smarthost's, by template, by a period alone; the times of a row come back moved with
    its decision time."""
    await write(ledger_url, [
        entry(1, message_id="<pay-1@app.example>", queue_id="aaaa11112222",
              upstream_queue_id="4Xb2Lk1Zz9z3"),
        entry(2, message_id="<pay-2@app.example>", template="welcome"),
        entry(3, template="welcome"),
        entry(40)])
    assert [r.queue_id for r in (await reader.search(LedgerQuery(
        message_ids=["pay-1@app.example", "<pay-1@app.example>"]), limit=5)).rows] == [
        "aaaa11112222"]
    for queue_id in ("aaaa11112222", "4Xb2Lk1Zz9z3"):
        [row] = (await reader.search(LedgerQuery(queue_id=queue_id), limit=5)).rows
        assert row.message_id == "<pay-1@app.example>"
        assert row.received_at is not None and row.sending_at is not None
        assert row.received_at < row.sending_at < row.decided_at
        assert row.decided_at - row.received_at == timedelta(seconds=0.5)
    welcome = (await reader.search(LedgerQuery(template="welcome"), limit=5)).rows
    assert [r.queue_id for r in welcome] == [f"q{3:011x}", f"q{2:011x}"]
    period = (await reader.search(LedgerQuery(since=T0 + timedelta(minutes=2),
                                              until=T0 + timedelta(minutes=4)), limit=5)).rows
    assert [r.queue_id for r in period] == [f"q{3:011x}", f"q{2:011x}"]
    both = (await reader.search(LedgerQuery(template="welcome", since=T0 + timedelta(
        minutes=3)), limit=5)).rows
    assert [r.queue_id for r in both] == [f"q{3:011x}"]


async def test_keyset_pages_neither_repeat_nor_skip_a_row(
        ledger_url: str, reader: LedgerReader) -> None:
    """250 rows of one recipient, 20 of them decided in the same microsecond: pages of 40
    newest first, then oldest first, each the next after the last's position (its token
    read back), hold every row once; the last page says there is none after it."""
    same = T0 + timedelta(hours=1)
    await write(ledger_url, [entry(i, rcpt=CUSTOMER, at=same if i % 12 == 0 else None)
                             for i in range(250)] + [entry(999, rcpt="else@example.net")])
    digest = recipient_digest(CUSTOMER)
    for oldest_first in (False, True):
        query = LedgerQuery(recipient_digests=[digest], oldest_first=oldest_first)
        seen: list[str] = []
        after: Position | None = None
        pages = 0
        while True:
            page = await reader.search(query, after=after, limit=40)
            pages += 1
            seen += [r.queue_id for r in page.rows]
            if page.next is None:
                break
            after = Position.parse(page.next.token())
            assert after == page.next
        assert pages == 7 and len(seen) == 250 == len(set(seen))
        times = [(r.decided_at, r.row_id) for r in (await reader.search(
            query, limit=250)).rows]
        assert times == sorted(times, reverse=not oldest_first)


def test_a_page_position_reads_back_only_its_own_form() -> None:
    at = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
    position = Position(at, uuid.UUID(int=7))
    assert Position.parse(position.token()) == position
    for bad in ("", "12", "x.y", f"1.{'0' * 31}", "1." + "g" * 32, "9" * 30 + "." + "0" * 32):
        with pytest.raises(ValueError):
            Position.parse(bad)


async def test_a_messages_timeline_holds_its_rows_and_its_keys_later_ones(
        ledger_url: str, reader: LedgerReader) -> None:
    """The message's own rows (two recipients), the retry of one of them (another message,
    suppressed) and an operator's row on the other's store key, oldest first; a row of an
    unrelated key is not in it."""
    key_a, key_b = "email:fp:" + "a" * 64, "email:fp:" + "b" * 64
    await write(ledger_url, [
        entry(1, rcpt="a@example.net", queue_id="msg000000001", store_key=key_a),
        entry(1, rcpt="b@example.net", queue_id="msg000000001", store_key=key_b,
              outcome="unknown"),
        entry(2, rcpt="a@example.net", queue_id="msg000000002", store_key=key_a,
              outcome="suppressed"),
        entry(3, rcpt="c@example.net", queue_id="msg000000003")])
    await write(ledger_url, [LedgerEntry(decided_at=(T0 + timedelta(minutes=5)).timestamp(),
                                         outcome="marked_sent", recipient="", store_key=key_b,
                                         action=LedgerAction.MARK_SENT)])
    rows = await reader.timeline("msg000000001")
    assert sorted((r.outcome, r.queue_id) for r in rows[:2]) == [
        ("relayed", "msg000000001"), ("unknown", "msg000000001")]
    assert [(r.outcome, r.queue_id) for r in rows[2:]] == [
        ("suppressed", "msg000000002"), ("marked_sent", "")]
    assert await reader.timeline("nothing") == []
