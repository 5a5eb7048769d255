"""``dedup-relay db upgrade``: create or upgrade the relay's PostgreSQL schema.

The relay never changes a schema by itself: it refuses to start on a missing or old one
(exit 69, naming this command). ``--store URL`` (or ``RELAY_STORE``) names the fingerprint
store's database; ``--sql`` prints the SQL instead of running it (for a DBA to apply with
``psql``). Exit codes: 0 the schema is current afterwards (or the SQL was printed); 2 the URL is
not a postgresql:// one; 3 the database failed or did not answer; 78 the database holds a newer
schema than this relay.
"""

from __future__ import annotations

import asyncio

import click

from relay.cli.exit_codes import ExitCode, epilog
from relay.cli.options import fail
from relay.config import redact_url
from relay.core.errors import StoreError
from relay.store.postgres import migrations
from relay.store.postgres.store import is_postgres_url, upgrade_schema


def register(main: click.Group) -> None:
    """Add the ``db`` group (``db upgrade``) to ``main``."""

    @main.group("db", epilog=epilog())
    def db() -> None:
        """The relay's PostgreSQL schema."""

    @db.command("upgrade", epilog=epilog())
    @click.option("--store", "store", envvar="RELAY_STORE", required=True, metavar="URL",
                  help="The store's database: postgresql://USER@HOST:PORT/DB (also "
                       "postgres://; env RELAY_STORE).")
    @click.option("--sql", "sql", is_flag=True,
                  help="Print the SQL that creates the schema instead of running it.")
    @click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=30.0,
                  show_default=True, help="Seconds to wait for the database.")
    def upgrade(store: str, sql: bool, timeout_s: float) -> None:
        """Create or upgrade the store's schema; exit 0 when it is current afterwards."""
        if not is_postgres_url(store):
            fail(ExitCode.USAGE, f"--store: not a postgresql:// URL: {redact_url(store)} (only "
                                 "a PostgreSQL store has a schema to upgrade)")
        if sql:
            click.echo(migrations.script("store"), nl=False)
            return
        try:
            before, after = asyncio.run(upgrade_schema(store, "store", timeout_s=timeout_s))
        except StoreError as exc:
            fail(ExitCode.STORE_FAILED, f"store failed: {exc}")
        except migrations.SchemaError as exc:
            fail(ExitCode.CONFIG, str(exc))
        where = redact_url(store)
        if before == after:
            click.echo(f"store schema at {where}: version {after}, current")
        else:
            click.echo(f"store schema at {where}: upgraded from version {before} to {after}")
