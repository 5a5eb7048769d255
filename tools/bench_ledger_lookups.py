"""How fast the audit ledger answers support's lookups among a million rows, and how long
`db upgrade --ledger` takes a million rows of the previous schema (version 3) to version 4.

    .venv/bin/python tools/bench_ledger_lookups.py [--rows N] [--repeat R] [--url URL]

In a schema of its own (dropped at the end) on the PostgreSQL at ``--url`` (default
``RELAY_TEST_POSTGRES_URL``, else ``postgresql://postgres@127.0.0.1:5432/postgres``):

1. the ledger at schema version 3 with version 4's three columns added (no index of them
   yet) and N rows written as relays write them now (a recipient's digest in every row):
   100,000 recipients of about 10 rows each over 30 days, one bulk recipient with N/200
   rows, 20 templates; then :func:`relay.store.postgres.migrations.upgrade` to version 4,
   timed: it builds the lookups' indexes over the N rows while holding the table (a real
   ledger's older rows have no digest, so its digest index is smaller: this is an upper
   bound), with the rate of a relay's writes (500 rows a statement) before and after; then
   VACUUM ANALYZE;
2. each lookup the console and ``dedup-relay history`` make
   (:meth:`relay.store.postgres.ledger_read.LedgerReader.search`, a page of 50, as a client on
   this host sees it: one round trip on an open connection), ``--repeat`` times with other
   values, and the plan PostgreSQL chose for a lookup by recipient.

Prints the seconds of the upgrade, the milliseconds of each lookup (median, 95th percentile,
most) and the plan. No relay runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import asyncpg

from relay.core.fingerprint import RECIPIENT_DIGEST_CONTEXT, recipient_digest
from relay.core.interfaces import LedgerEntry
from relay.store.postgres import migrations
from relay.store.postgres.ledger import BATCH_ROWS, LedgerOptions, insert_rows, row_of
from relay.store.postgres.ledger_query import LedgerQuery, Position, search_sql
from relay.store.postgres.ledger_read import LedgerReader

RECIPIENTS = 100_000
BULK_EVERY = 200  # every 200th row is the bulk recipient's (user0)
TEMPLATES = 20
DAYS = 30
CHUNK = 250_000
PAGE = 50

# $1 first i, $2 last i; the recipient of row i: user0 for every BULK_EVERY-th, else one of
# RECIPIENTS spread by a multiplier; decided at a random time in the last DAYS days
_ROWS = f"""
SELECT i, CASE WHEN i % {BULK_EVERY} = 0 THEN 0 ELSE (i * 7919) % {RECIPIENTS} + 1 END AS r,
       now() - random() * {DAYS} * interval '1 day' AS t
FROM generate_series($1::bigint, $2::bigint) AS i
"""
_V2_COLUMNS = ("row_id, decided_at, recorded_at, action, outcome, store_key, recipient, "
               "template, dedupe_key, reply, upstream_queue_id, upstream, message_id, queue_id, "
               "client_reply, instance, key_source")
_V2_VALUES = ("gen_random_uuid(), t, t, 'relay', CASE WHEN i % 97 = 0 THEN 'suppressed' ELSE "
              "'relayed' END, 'email:fp:' || md5(r || ':' || i), 'u***@example.net', "
              f"'template-' || (i % {TEMPLATES}), md5(i::text), "
              "'250 2.0.0 Ok: queued as Q' || i, 'Q' || i, 'smarthost.example:25', "
              "'<' || i || '.' || md5(i::text) || '@app.example>', lpad(to_hex(i), 12, '0'), "
              "'250 2.0.0 Ok: relayed 1; id=' || lpad(to_hex(i), 12, '0'), 'relay-a/1', "
              "'header'")
_V4_EXTRA = ("recipient_digest, received_at, sending_at",
             "encode(sha256(decode($3, 'hex') || convert_to('user' || r || '@example.net', "
             "'UTF8')), 'hex'), t - interval '40 ms', t - interval '15 ms'")


def _insert(version: int) -> str:
    columns, values = _V2_COLUMNS, _V2_VALUES
    if version >= 4:
        columns, values = f"{columns}, {_V4_EXTRA[0]}", f"{values}, {_V4_EXTRA[1]}"
    return f"INSERT INTO dedup_relay_ledger ({columns}) SELECT {values} FROM ({_ROWS}) AS s"


async def fill(conn: asyncpg.Connection, rows: int, version: int) -> float:
    """Write ``rows`` rows in chunks; seconds taken."""
    started = time.monotonic()
    sql = _insert(version)
    for lo in range(1, rows + 1, CHUNK):
        hi = min(rows, lo + CHUNK - 1)
        args: list[object] = [lo, hi]
        if version >= 4:
            args.append(RECIPIENT_DIGEST_CONTEXT.hex())
        await conn.execute(sql, *args)
        print(f"  {hi:,} rows written ({time.monotonic() - started:.0f} s)", flush=True)
    return time.monotonic() - started


async def write_rate(conn: asyncpg.Connection, rows: int = 20_000) -> float:
    """Rows per second a relay's writer lands (:func:`relay.store.postgres.ledger.insert_rows`,
    500 rows a statement, as :data:`relay.store.postgres.ledger.BATCH_ROWS`), each row with
    its digest and times; the rows are deleted again."""
    now = time.time()
    entries = [LedgerEntry(decided_at=now - i, outcome="relayed", recipient=f"w{i}@example.net",
                           store_key=f"email:fp:w{i}", template="receipt", dedupe_key=f"k{i}",
                           message_id=f"<w{i}@app.example>", queue_id=f"w{i:011x}",
                           received_at=now - i - 0.04, sending_at=now - i - 0.015)
               for i in range(rows)]
    batches = [[row_of(e, LedgerOptions(instance="bench/1")) for e in entries[lo:lo + BATCH_ROWS]]
               for lo in range(0, rows, BATCH_ROWS)]
    started = time.monotonic()
    for batch in batches:
        await insert_rows(conn, batch)
    rate = rows / (time.monotonic() - started)
    await conn.execute("DELETE FROM dedup_relay_ledger WHERE instance = 'bench/1'")
    return rate


async def previous_schema(conn: asyncpg.Connection) -> None:
    """The ledger at schema version 3, as the previous relay's `db upgrade --ledger` left it."""
    async with conn.transaction():
        await conn.execute("CREATE TABLE dedup_relay_schema "
                           "(component text PRIMARY KEY, version integer NOT NULL)")
        for step in migrations.STEPS["ledger"][:3]:
            await conn.execute(step)
        await conn.execute("INSERT INTO dedup_relay_schema VALUES ('ledger', 3)")


async def timed(repeat: int, call: Callable[[int], Awaitable[object]]) -> list[float]:
    """Milliseconds of ``call(n)`` for n in range(repeat)."""
    out = []
    for n in range(repeat):
        started = time.perf_counter()
        await call(n)
        out.append((time.perf_counter() - started) * 1000)
    return out


def report(label: str, ms: list[float], found: int) -> None:
    ordered = sorted(ms)
    p95 = ordered[max(0, round(0.95 * len(ordered)) - 1)]
    print(f"  {label:<44} median {statistics.median(ms):7.2f} ms   p95 {p95:7.2f} ms   "
          f"most {max(ms):7.2f} ms   ({found} rows on its first page)")


def _recipient_of(i: int) -> int:
    """The recipient number of row ``i`` (as :data:`_ROWS` picks it)."""
    return 0 if i % BULK_EVERY == 0 else (i * 7919) % RECIPIENTS + 1


def _message_id(i: int) -> str:
    """The Message-ID of row ``i`` (as :data:`_V2_VALUES` writes it)."""
    return f"<{i}.{hashlib.md5(str(i).encode()).hexdigest()}@app.example>"  # noqa: S324


async def lookups(url: str, rows: int, repeat: int) -> None:
    """Time each lookup ``repeat`` times on one open connection, each time with another
    row's values."""
    rng = random.Random(7)
    now = datetime.now(tz=UTC)
    week = now - timedelta(days=7)

    def any_row() -> int:
        return rng.randrange(1, rows + 1)

    def digest_of(address: str) -> str:
        digest = recipient_digest(address)
        assert digest is not None
        return digest

    def someone() -> str:
        i = any_row()
        while _recipient_of(i) == 0:
            i = any_row()
        return digest_of(f"user{_recipient_of(i)}@example.net")

    bulk = digest_of("user0@example.net")
    reader = await LedgerReader.open(url)
    try:
        first_bulk = await reader.search(LedgerQuery(recipient_digests=[bulk], since=week),
                                         limit=PAGE)
        cases: list[tuple[str, Callable[[int], LedgerQuery], Position | None]] = [
            ("recipient, last 7 days (the default)",
             lambda n: LedgerQuery(recipient_digests=[someone()], since=week), None),
            ("recipient, all 30 days", lambda n: LedgerQuery(recipient_digests=[someone()]), None),
            (f"bulk recipient ({rows // BULK_EVERY:,} rows), 7 days",
             lambda n: LedgerQuery(recipient_digests=[bulk], since=week), None),
            ("bulk recipient, its next page",
             lambda n: LedgerQuery(recipient_digests=[bulk], since=week), first_bulk.next),
            ("Message-ID (with and without brackets)", lambda n: LedgerQuery(
                message_ids=[m := _message_id(any_row()), m[1:-1]]), None),
            ("relay queue id", lambda n: LedgerQuery(queue_id=f"{any_row():012x}"), None),
            ("smarthost queue id", lambda n: LedgerQuery(queue_id=f"Q{any_row()}"), None),
            (f"template ({rows // TEMPLATES:,} rows), 7 days", lambda n: LedgerQuery(
                template=f"template-{n % TEMPLATES}", since=week), None),
            ("period alone, one hour", lambda n: LedgerQuery(
                since=now - timedelta(hours=n + 2), until=now - timedelta(hours=n + 1)), None),
        ]
        for label, query_of, after in cases:
            found: list[int] = []

            async def once(n: int, query_of: Callable[[int], LedgerQuery] = query_of,
                           after: Position | None = after, found: list[int] = found) -> None:
                page = await reader.search(query_of(n), after=after, limit=PAGE)
                found.append(len(page.rows))
            report(label, await timed(repeat, once), found[0])
    finally:
        await reader.close()
    sql, args = search_sql(LedgerQuery(recipient_digests=[someone()], since=week), None, PAGE + 1)
    conn = await asyncpg.connect(url)
    try:
        plan = await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS) {sql}", *args)
    finally:
        await conn.close()
    print("\nThe plan of a lookup by recipient (7 days, a page of 50):")
    for line in plan:
        print("  " + line[0])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--url", default=os.environ.get(
        "RELAY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    args = parser.parse_args()
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(args.url)
    await admin.execute(f"CREATE SCHEMA {schema}")
    url = f"{args.url}{'&' if '?' in args.url else '?'}search_path={schema}"
    conn = await asyncpg.connect(url, command_timeout=600)
    try:
        print(f"PostgreSQL {await conn.fetchval('SHOW server_version')}, "
              f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {args.rows:,} rows")
        print("1. N rows in the ledger at schema version 3 (with version 4's columns, no index "
              "of them yet), then `db upgrade --ledger`:")
        await previous_schema(conn)
        for column in ("recipient_digest text", "received_at timestamptz",
                       "sending_at timestamptz"):
            await conn.execute(f"ALTER TABLE dedup_relay_ledger ADD COLUMN {column}")
        await fill(conn, args.rows, 4)
        print(f"  relays' writes before it: {await write_rate(conn):,.0f} rows/s")
        started = time.monotonic()
        before, after = await migrations.upgrade(conn, "ledger")
        print(f"  upgraded from version {before} to {after} in "
              f"{time.monotonic() - started:.1f} s (the table held meanwhile)")
        print(f"  relays' writes after it: {await write_rate(conn):,.0f} rows/s")
        await conn.execute("VACUUM ANALYZE dedup_relay_ledger")
        first = 7919 % RECIPIENTS + 1  # the recipient of row 1
        check = await conn.fetchval(
            "SELECT count(*) FROM dedup_relay_ledger WHERE recipient_digest = $1",
            recipient_digest(f"USER{first}@Example.NET"))
        assert check and check > 0, "the SQL digest is not the relay's"
        print(f"2. lookups ({args.repeat} each, other values each time):")
        await lookups(url, args.rows, args.repeat)
    finally:
        await conn.close()
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.close()


if __name__ == "__main__":
    asyncio.run(main())
