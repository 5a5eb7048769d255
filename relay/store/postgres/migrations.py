"""Versioned schema of the relay's PostgreSQL tables, per component, and the one way to apply it.

The table ``dedup_relay_schema(component text primary key, version int)`` records how far each
component's schema went. A component (``store``: the fingerprint table; ``ledger``: the audit
ledger's) has ordered SQL steps in :data:`STEPS`; step ``n``
(1-based) takes the schema from version ``n - 1`` to ``n``. :func:`upgrade` applies the missing
steps in one transaction under an advisory lock (two relays upgrading at once wait for each
other); :func:`check` raises :class:`SchemaError` naming ``dedup-relay db upgrade`` when the
schema is missing or older than this code. Tables are created unqualified, in the first schema
of the connection's ``search_path``.

The relay never changes the schema by itself: ``dedup-relay db upgrade --store URL`` runs
:func:`upgrade`, ``--sql`` prints :func:`script` for a DBA to apply.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

SCHEMA_TABLE = "dedup_relay_schema"
FINGERPRINTS = "dedup_relay_fingerprints"
LEDGER = "dedup_relay_ledger"

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
)

# The audit ledger (issue 13): one row per recipient decision, appended through the relay's
# bounded queue (relay.ledger.postgres), or per operator action (release, mark-sent). ``row_id``
# is the relay's, so a batch written again after a lost reply adds nothing. ``decided_at`` is the
# relay's clock when it answered (or the admin command's); ``recorded_at`` the database's when
# the row landed (retention counts from it). ``store_key`` is NULL for a decision without a
# fingerprint (no key, an exempt template, a message refused before one was derived).
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
CREATE INDEX IF NOT EXISTS {LEDGER}_unknown ON {LEDGER} (decided_at)
    WHERE outcome = 'unknown' AND store_key IS NOT NULL;""",
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
                "ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version",
                component, want)
    return have, want


def script(component: str) -> str:
    """The SQL that :func:`upgrade` runs on an empty database, as one transaction a DBA can
    apply with ``psql`` (each step is idempotent: ``IF NOT EXISTS``)."""
    want = latest(component)
    parts = ["BEGIN;", f"SELECT pg_advisory_xact_lock({_LOCK_KEY});", _SCHEMA_TABLE_SQL + ";"]
    for number, step in enumerate(STEPS[component], start=1):
        parts.append(f"-- {component} step {number}")
        parts.append(step)
    parts.append(f"INSERT INTO {SCHEMA_TABLE} (component, version) VALUES ('{component}', "
                 f"{want}) ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version;")
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"
