"""Versioned schema of the relay's PostgreSQL tables, per component, and the one way to apply it.

The table ``dedup_relay_schema(component text primary key, version int)`` records how far each
component's schema went. A component (``store``: the fingerprint table, from version 2 the
rate-limit counters, from version 3 each row's content digest; ``ledger``: the audit
ledger's) has ordered SQL steps in :data:`STEPS`; step ``n`` (1-based) takes the schema from
version ``n - 1`` to ``n``. :func:`upgrade` applies
the missing steps in one transaction under an advisory lock (two relays upgrading at once wait
for each other); :func:`check` raises :class:`SchemaError` naming ``dedup-relay db upgrade``
when the schema is missing or older than this code. Tables are created unqualified, in the
first schema of the connection's ``search_path``.

The relay never changes the schema by itself: ``dedup-relay db upgrade --store URL`` runs
:func:`upgrade`, ``--sql`` prints :func:`script` for a DBA to apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

SCHEMA_TABLE = "dedup_relay_schema"
FINGERPRINTS = "dedup_relay_fingerprints"
LEDGER = "dedup_relay_ledger"
RECONCILE_LOOKS = "dedup_relay_reconcile_looks"
RATE_EVENTS = "dedup_relay_rate_events"
RATE_GIVEN_BACK = "dedup_relay_rate_given_back"
RATE_ACQUIRE = "dedup_relay_rate_acquire"
RATE_GIVE_BACK = "dedup_relay_rate_give_back"
RATE_LOCK_SPACE = 0x646C7274
"""The first key of the two-key ``pg_advisory_xact_lock(space, hashtext(bucket))`` that
serializes the calls on one rate-limit bucket ("dlrt"; the two-key form never meets the
one-key locks of :func:`upgrade`)."""

_SCHEMA_TABLE_SQL = (
    f"CREATE TABLE IF NOT EXISTS {SCHEMA_TABLE} "
    "(component text PRIMARY KEY, version integer NOT NULL)"
)

# One row per fingerprint. ``expires_at`` decides whether the row is live (a row past it counts
# as absent and is taken by the next reserve, then deleted by the cleanup); ``at`` is the time of
# SENT / UNKNOWN, or the last heartbeat of SENDING; ``lease_ms`` the SENDING attempt's lease.
# Every time is the database's clock (now()), never a relay's.
_STORE_STEPS: tuple[str, ...] = (
    f"""CREATE TABLE IF NOT EXISTS {FINGERPRINTS} (
    key text PRIMARY KEY,
    state text NOT NULL,
    token text,
    at timestamptz,
    reply text,
    expires_at timestamptz NOT NULL,
    lease_ms bigint
);
CREATE INDEX IF NOT EXISTS {FINGERPRINTS}_expires_at ON {FINGERPRINTS} (expires_at);""",
    # 2: rate limits (design.md §4.7, relay.store.postgres.limits). One row per acquire and bucket
    # (the sliding-window log of the SQLite store's rate_events), ``at`` the database's clock
    # read after the bucket's lock; ``call_id`` the relay's call, so a call given back after a
    # timeout (a row in RATE_GIVEN_BACK, its tombstone) takes nothing when it lands later.
    # The two functions run a call in one statement, one round trip: the advisory locks of its
    # buckets in the order of their hashes (never a deadlock between two calls), then, under
    # READ COMMITTED, statements that each see what the last holder of the locks committed.
    f"""CREATE TABLE IF NOT EXISTS {RATE_EVENTS} (
    bucket text NOT NULL,
    at timestamptz NOT NULL,
    cost integer NOT NULL,
    expires_at timestamptz NOT NULL,
    call_id text NOT NULL
);
CREATE INDEX IF NOT EXISTS {RATE_EVENTS}_bucket ON {RATE_EVENTS} (bucket, at) INCLUDE (cost);
CREATE INDEX IF NOT EXISTS {RATE_EVENTS}_expires_at ON {RATE_EVENTS} (expires_at);
CREATE TABLE IF NOT EXISTS {RATE_GIVEN_BACK} (
    call_id text PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS {RATE_GIVEN_BACK}_expires_at ON {RATE_GIVEN_BACK} (expires_at);
-- p_buckets[i], p_windows_ms[i], p_limits[i], p_costs[i]: the i-th check; p_call_id the call.
-- Returns {{0, 0}} when every check had room and took its cost, else {{i, ms}}: the i-th check
-- refused (nothing taken from any bucket), room again in ms milliseconds (-1: never, its
-- cost alone is over its limit). A call given back takes nothing and returns {{0, 0}}.
CREATE OR REPLACE FUNCTION {RATE_ACQUIRE}(p_buckets text[], p_windows_ms bigint[],
        p_limits bigint[], p_costs bigint[], p_call_id text) RETURNS bigint[]
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    h integer;
    t timestamptz;
    used bigint;
    need bigint;
    freed bigint;
    row_at timestamptz;
    row_cost bigint;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- a snapshot taken before the locks would not see the last holder's rows
        RAISE EXCEPTION 'rate limits need READ COMMITTED, not %',
            current_setting('transaction_isolation');
    END IF;
    FOR h IN SELECT DISTINCT hashtext(b) FROM unnest(p_buckets) AS b ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock({RATE_LOCK_SPACE}, h);
    END LOOP;
    IF EXISTS (SELECT 1 FROM {RATE_GIVEN_BACK} g WHERE g.call_id = p_call_id) THEN
        RETURN ARRAY[0, 0]::bigint[];
    END IF;
    t := clock_timestamp();
    DELETE FROM {RATE_EVENTS} e WHERE e.bucket = ANY(p_buckets) AND e.expires_at <= t;
    FOR i IN 1 .. cardinality(p_buckets) LOOP
        IF p_costs[i] > p_limits[i] THEN
            RETURN ARRAY[i, -1]::bigint[];
        END IF;
        SELECT coalesce(sum(e.cost), 0) INTO used FROM {RATE_EVENTS} e
        WHERE e.bucket = p_buckets[i] AND e.at > t - p_windows_ms[i] * interval '1 millisecond';
        CONTINUE WHEN used + p_costs[i] <= p_limits[i];
        -- room once the oldest rows holding ``need`` units left (each holds at least 1)
        need := used + p_costs[i] - p_limits[i];
        freed := 0;
        FOR row_at, row_cost IN
            SELECT e.at, e.cost FROM {RATE_EVENTS} e
            WHERE e.bucket = p_buckets[i]
              AND e.at > t - p_windows_ms[i] * interval '1 millisecond'
            ORDER BY e.at LIMIT need
        LOOP
            freed := freed + row_cost;
            IF freed >= need THEN
                RETURN ARRAY[i, greatest(1, ceil(extract(epoch FROM row_at - t) * 1000)
                                            + p_windows_ms[i])]::bigint[];
            END IF;
        END LOOP;
        RETURN ARRAY[i, p_windows_ms[i]]::bigint[];
    END LOOP;
    INSERT INTO {RATE_EVENTS} (bucket, at, cost, expires_at, call_id)
    SELECT u.b, t, u.c, t + u.w * interval '1 millisecond', p_call_id
    FROM unnest(p_buckets, p_costs, p_windows_ms) AS u(b, c, w);
    RETURN ARRAY[0, 0]::bigint[];
END
$fn$;
-- Takes back what the call p_call_id took in p_buckets (after any call holding their locks
-- ended) and leaves its tombstone for p_keep_ms milliseconds. Returns the rows deleted.
CREATE OR REPLACE FUNCTION {RATE_GIVE_BACK}(p_buckets text[], p_call_id text,
        p_keep_ms bigint) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $fn$
DECLARE
    h integer;
    n integer;
BEGIN
    FOR h IN SELECT DISTINCT hashtext(b) FROM unnest(p_buckets) AS b ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock({RATE_LOCK_SPACE}, h);
    END LOOP;
    DELETE FROM {RATE_EVENTS} e WHERE e.bucket = ANY(p_buckets) AND e.call_id = p_call_id;
    GET DIAGNOSTICS n = ROW_COUNT;
    INSERT INTO {RATE_GIVEN_BACK} (call_id, expires_at)
    VALUES (p_call_id, clock_timestamp() + p_keep_ms * interval '1 millisecond')
    ON CONFLICT (call_id) DO UPDATE SET expires_at = greatest(
        {RATE_GIVEN_BACK}.expires_at, EXCLUDED.expires_at);
    RETURN n;
END
$fn$;""",
    # 3: the content digest of the message that wrote a row (design.md §2.2), kept through
    # every state; NULL in the rows written before (never a key reused, §4.9)
    f"ALTER TABLE {FINGERPRINTS} ADD COLUMN IF NOT EXISTS content_digest text;",
)

# The audit ledger (design.md §6.7): one row per recipient decision, appended through the relay's
# bounded queue (relay.store.postgres.ledger), or per operator action (release, mark-sent).
# ``row_id`` is the relay's, so a batch written again after a lost reply adds nothing.
# ``decided_at`` is the relay's clock when it answered (or the admin command's);
# ``recorded_at`` the database's when the row landed (retention counts from it).
# ``store_key`` is NULL for a decision without a fingerprint (no key, an exempt template, a
# message refused before one was derived).
_LEDGER_STEPS: tuple[str, ...] = (
    f"""CREATE TABLE IF NOT EXISTS {LEDGER} (
    row_id uuid PRIMARY KEY,
    decided_at timestamptz NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    action text NOT NULL,
    outcome text NOT NULL,
    store_key text,
    recipient text NOT NULL,
    template text NOT NULL DEFAULT '',
    dedupe_key text,
    reply text NOT NULL DEFAULT '',
    upstream_queue_id text NOT NULL DEFAULT '',
    upstream text NOT NULL DEFAULT '',
    message_id text NOT NULL DEFAULT '',
    queue_id text NOT NULL DEFAULT '',
    client_reply text NOT NULL DEFAULT '',
    instance text NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS {LEDGER}_store_key ON {LEDGER} (store_key, decided_at);
CREATE INDEX IF NOT EXISTS {LEDGER}_recorded_at ON {LEDGER} (recorded_at);
CREATE INDEX IF NOT EXISTS {LEDGER}_in_doubt ON {LEDGER} (decided_at)
    WHERE outcome IN ('unknown', 'suppressed_unknown', 'held') AND store_key IS NOT NULL;""",
    # 2: where each decision's key came from: header, rule:NAME (a [[key_rule]]); '' before
    f"ALTER TABLE {LEDGER} ADD COLUMN IF NOT EXISTS key_source text NOT NULL DEFAULT '';",
    # 3: the recipient's key held a record of other content (design.md §4.9); false before
    f"ALTER TABLE {LEDGER} ADD COLUMN IF NOT EXISTS key_reused boolean NOT NULL DEFAULT false;",
    # 4: what support looks a message up by (design.md §6.7, docs/ledger.md). recipient_digest:
    # the keyed digest of the normalized recipient (relay.core.fingerprint.recipient_digest),
    # so an address finds its rows while the ledger keeps it masked; NULL in the rows written
    # before (the address is not in them to digest) and in the operators' rows without one.
    # received_at: when the message came in; sending_at: when its records were marked SENDING,
    # right before the final dot went upstream (NULL: not sent with a reservation, or before).
    # Each index ends in (decided_at, row_id), the order and the key of the lookups' pages.
    # Building them locks the table against writes until the upgrade commits: relays queue
    # their rows meanwhile (docs/ledger.md says how long for a million rows).
    f"""ALTER TABLE {LEDGER} ADD COLUMN IF NOT EXISTS recipient_digest text;
ALTER TABLE {LEDGER} ADD COLUMN IF NOT EXISTS received_at timestamptz;
ALTER TABLE {LEDGER} ADD COLUMN IF NOT EXISTS sending_at timestamptz;
CREATE INDEX IF NOT EXISTS {LEDGER}_recipient_digest
    ON {LEDGER} (recipient_digest, decided_at, row_id) WHERE recipient_digest IS NOT NULL;
CREATE INDEX IF NOT EXISTS {LEDGER}_message_id
    ON {LEDGER} (message_id, decided_at, row_id) WHERE message_id <> '';
CREATE INDEX IF NOT EXISTS {LEDGER}_queue_id
    ON {LEDGER} (queue_id, decided_at, row_id) WHERE queue_id <> '';
CREATE INDEX IF NOT EXISTS {LEDGER}_upstream_queue_id
    ON {LEDGER} (upstream_queue_id, decided_at, row_id) WHERE upstream_queue_id <> '';
CREATE INDEX IF NOT EXISTS {LEDGER}_template ON {LEDGER} (template, decided_at, row_id);
CREATE INDEX IF NOT EXISTS {LEDGER}_decided_at ON {LEDGER} (decided_at, row_id);""",
    # 5: the reconciler's looks (docs/operating/reconciliation.md): one row per store key in
    # doubt it asked the evidence sources about. ``row_id``: the in-doubt ledger row looked at
    # (a new doubt of the key starts the count again); ``looks``: how many rounds asked;
    # ``looked_at``: the last (the database's clock); ``answer``: what the last round found
    f"""CREATE TABLE IF NOT EXISTS {RECONCILE_LOOKS} (
    store_key text PRIMARY KEY,
    row_id uuid NOT NULL,
    first_looked_at timestamptz NOT NULL DEFAULT now(),
    looked_at timestamptz NOT NULL DEFAULT now(),
    looks integer NOT NULL DEFAULT 1,
    answer text NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS {RECONCILE_LOOKS}_looked_at ON {RECONCILE_LOOKS} (looked_at);""",
)

STEPS: Mapping[str, Sequence[str]] = {"store": _STORE_STEPS, "ledger": _LEDGER_STEPS}
"""Each component's ordered SQL steps (step ``n`` makes version ``n``)."""

# pg_advisory_xact_lock key of an upgrade (any fixed bigint: "dedup-re" in ASCII)
_LOCK_KEY = 0x6465647570_2D7265


class SchemaError(Exception):
    """The schema of a component is missing or older (or newer) than this relay's code."""


class Connection(Protocol):
    """The part of an asyncpg connection this module uses."""

    async def execute(self, query: str, *args: object) -> str: ...

    async def fetchval(self, query: str, *args: object) -> object: ...

    def transaction(self) -> _Transaction: ...


class _Transaction(Protocol):
    async def __aenter__(self) -> object: ...

    async def __aexit__(self, *exc: object) -> None: ...


def latest(component: str) -> int:
    """The schema version this code needs for ``component``; KeyError for an unknown one."""
    return len(STEPS[component])


async def current(conn: Connection, component: str) -> int:
    """The version the database holds for ``component`` (0: none, or no schema table)."""
    exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", SCHEMA_TABLE)
    if not exists:
        return 0
    version = await conn.fetchval(
        f"SELECT version FROM {SCHEMA_TABLE} WHERE component = $1", component)
    return int(version) if isinstance(version, int) else 0


async def check(conn: Connection, component: str) -> None:
    """Raise :class:`SchemaError` unless ``component``'s schema is exactly this code's version
    (the message names ``dedup-relay db upgrade``); asyncpg errors pass through."""
    have, want = await current(conn, component), latest(component)
    if have == want:
        return
    if have == 0:
        raise SchemaError(f"the PostgreSQL {component} schema is missing (version {want} "
                          f"needed): run `dedup-relay db upgrade --{component} URL` first")
    if have < want:
        raise SchemaError(f"the PostgreSQL {component} schema is at version {have}, this relay "
                          f"needs {want}: run `dedup-relay db upgrade --{component} URL`")
    raise SchemaError(f"the PostgreSQL {component} schema is at version {have}, newer than "
                      f"this relay's {want}: upgrade the relay (`dedup-relay db upgrade` "
                      "never downgrades)")


async def upgrade(conn: Connection, component: str) -> tuple[int, int]:
    """Apply ``component``'s missing steps in one transaction; return (version before, after).

    Raises :class:`SchemaError` when the database is newer than this code; asyncpg errors
    pass through (nothing applied then)."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK_KEY)
        await conn.execute(_SCHEMA_TABLE_SQL)
        have, want = await current(conn, component), latest(component)
        if have > want:
            raise SchemaError(f"the PostgreSQL {component} schema is at version {have}, newer "
                              f"than this relay's {want}")
        for step in STEPS[component][have:]:
            await conn.execute(step)
        if have < want:
            await conn.execute(
                f"INSERT INTO {SCHEMA_TABLE} (component, version) VALUES ($1, $2) "
                "ON CONFLICT (component) DO UPDATE SET "
                f"version = greatest({SCHEMA_TABLE}.version, EXCLUDED.version)",
                component, want)
    return have, want


def script(component: str) -> str:
    """The SQL that :func:`upgrade` runs, as one transaction a DBA can apply with ``psql`` on
    a database at any version up to this code's: every step, each idempotent (``IF NOT
    EXISTS``, ``CREATE OR REPLACE``), so the steps a database already has change nothing. On a
    database whose schema is newer than this code it stops at its start (an exception: nothing
    applied, as :func:`upgrade` refuses), and the version it records is never lower than the
    one it found (``greatest``)."""
    want = latest(component)
    parts = ["BEGIN;", f"SELECT pg_advisory_xact_lock({_LOCK_KEY});", _SCHEMA_TABLE_SQL + ";",
             f"""DO $guard$
DECLARE have integer;
BEGIN
    SELECT version INTO have FROM {SCHEMA_TABLE} WHERE component = '{component}';
    IF have > {want} THEN
        RAISE EXCEPTION 'the PostgreSQL {component} schema is at version %, newer than this '
                        'script''s {want}: nothing applied', have;
    END IF;
END
$guard$;"""]
    for number, step in enumerate(STEPS[component], start=1):
        parts.append(f"-- {component} step {number}")
        parts.append(step)
    parts.append(f"INSERT INTO {SCHEMA_TABLE} (component, version) VALUES ('{component}', "
                 f"{want}) ON CONFLICT (component) DO UPDATE SET version = "
                 f"greatest({SCHEMA_TABLE}.version, EXCLUDED.version);")
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"
