"""``dedup-relay db upgrade``: create or upgrade the relay's PostgreSQL schema.

The relay never changes a schema by itself: it refuses to start on a missing or old one
(exit 69, naming this command). ``--store URL`` (or ``RELAY_STORE``) names the fingerprint
store's database, ``--ledger URL`` (or ``RELAY_LEDGER``) the audit ledger's (either or both;
a ``RELAY_STORE`` that is no PostgreSQL URL is passed over when ``--ledger`` names one);
``--sql`` prints the SQL instead of running it (for a DBA to apply with
``psql``). Exit codes: 0 the schema is current afterwards (or the SQL was printed); 2 the URL is
not a postgresql:// one; 3 the database failed or did not answer; 78 the database holds a newer
schema than this relay.
"""

from __future__ import annotations

import asyncio

import click
from click.core import ParameterSource

from relay.cli.exit_codes import ExitCode, epilog
from relay.cli.options import fail
from relay.core.errors import StoreError
from relay.settings import extra_missing, is_postgres_url, redact_url
from relay.store.postgres import migrations


def register(main: click.Group) -> None:
    """Add the ``db`` group (``db upgrade``) to ``main``."""

    @main.group("db", epilog=epilog())
    def db() -> None:
        """The relay's PostgreSQL schema."""

    @db.command("upgrade", epilog=epilog())
    @click.option("--store", "store", envvar="RELAY_STORE", metavar="URL",
                  help="The store's database: postgresql://USER@HOST:PORT/DB (also "
                       "postgres://; env RELAY_STORE).")
    @click.option("--ledger", "ledger", envvar="RELAY_LEDGER", metavar="URL",
                  help="The audit ledger's database: postgresql://USER@HOST:PORT/DB (env "
                       "RELAY_LEDGER).")
    @click.option("--sql", "sql", is_flag=True,
                  help="Print the SQL that creates the schema instead of running it.")
    @click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=30.0,
                  show_default=True, help="Seconds to wait for the database.")
    def upgrade(store: str | None, ledger: str | None, sql: bool, timeout_s: float) -> None:
        """Create or upgrade the store's and/or the audit ledger's schema; exit 0 when each
        named is current afterwards."""
        targets = _targets(click.get_current_context(), store, ledger)
        if sql:
            for component, _ in targets:
                click.echo(migrations.script(component), nl=False)
            return
        for component, url in targets:
            _upgrade_one(component, url, timeout_s)


def _targets(ctx: click.Context, store: str | None,
             ledger: str | None) -> list[tuple[str, str]]:
    """The (component, URL) pairs to upgrade; exits 2 for a URL given as a flag that is no
    postgresql:// one, or when none is named (an env var's other kind of store is passed
    over when the other component is named)."""
    targets: list[tuple[str, str]] = []
    for component, url, other in (("store", store, ledger), ("ledger", ledger, store)):
        if not url:
            continue
        if not is_postgres_url(url):
            if ctx.get_parameter_source(component) is ParameterSource.ENVIRONMENT and other:
                continue  # RELAY_STORE=redis://... beside --ledger: only the ledger has one
            fail(ExitCode.USAGE, f"--{component}: not a postgresql:// URL: {redact_url(url)} "
                                 f"(only a PostgreSQL {component} has a schema to upgrade)")
        targets.append((component, url))
    if not targets:
        fail(ExitCode.USAGE, "name a PostgreSQL database: --store URL and/or --ledger URL")
    return targets


def _upgrade_one(component: str, url: str, timeout_s: float) -> None:
    """Upgrade ``component``'s schema at ``url`` and say so; exits 3 (database failed) or 78
    (a newer schema) on failure."""
    missing = extra_missing("asyncpg")
    if missing is not None:
        fail(ExitCode.CONFIG, f"{component}: PostgreSQL's driver is needed: {missing}")
    from relay.store.postgres.store import upgrade_schema

    try:
        before, after = asyncio.run(upgrade_schema(url, component, timeout_s=timeout_s))
    except StoreError as exc:
        fail(ExitCode.STORE_FAILED, f"{component} database failed: {exc}")
    except migrations.SchemaError as exc:
        fail(ExitCode.CONFIG, str(exc))
    where = redact_url(url)
    if before == after:
        click.echo(f"{component} schema at {where}: version {after}, current")
    else:
        click.echo(f"{component} schema at {where}: upgraded from version {before} to {after}")
