"""``dedup-relay db upgrade``: create or upgrade the relay's database schema (PostgreSQL's).

The relay never changes a schema by itself: it refuses to start on a missing or old one
(exit 69, naming this command). ``--store URL`` (or ``RELAY_STORE``) names the fingerprint
store's database (a store kind with a schema, :attr:`relay.store.kinds.StoreKind.schema`),
``--ledger URL`` (or ``RELAY_LEDGER``) the audit ledger's (either or both; a ``RELAY_STORE``
of a kind without a schema is passed over when ``--ledger`` names one); ``--sql`` prints the
SQL instead of running it (for a DBA to apply with ``psql``). Exit codes: 0 the schema is
current afterwards (or the SQL was printed); 2 the URL is not a postgresql:// one; 3 the
database failed or did not answer; 78 the database holds a newer schema than this relay.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import click
from click.core import ParameterSource

from relay.cli.exit_codes import ExitCode, epilog
from relay.cli.options import fail
from relay.core.errors import ConfigError, StoreError
from relay.settings import kind_extra_missing, redact_url
from relay.store import registry
from relay.store.kinds import Schema, StoreKind
from relay.store.postgres.kind import POSTGRES


def _kinds(component: str) -> tuple[StoreKind, ...]:
    """The kinds of database ``component`` (``store`` or ``ledger``) may be in that have a
    schema: the audit ledger's is PostgreSQL's."""
    return (POSTGRES,) if component == "ledger" else tuple(k for k in registry.KINDS if k.schema)


class _Target(NamedTuple):
    """A schema to upgrade: ``component``'s (``store`` or ``ledger``) at ``url``, of ``kind``."""

    component: str
    url: str
    kind: StoreKind
    schema: Schema


def _either(words: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


def register(main: click.Group) -> None:
    """Add the ``db`` group (``db upgrade``) to ``main``."""

    @main.group("db", epilog=epilog())
    def db() -> None:
        """The relay's database schema (PostgreSQL's)."""

    @db.command("upgrade", epilog=epilog())
    @click.option("--store", "store", envvar="RELAY_STORE", metavar="URL",
                  help=f"The store's database: "
                       f"{'; '.join(k.forms for k in _kinds('store'))} (env RELAY_STORE).")
    @click.option("--ledger", "ledger", envvar="RELAY_LEDGER", metavar="URL",
                  help=f"The audit ledger's database: "
                       f"{'; '.join(k.forms for k in _kinds('ledger'))} (env RELAY_LEDGER).")
    @click.option("--sql", "sql", is_flag=True,
                  help="Print the SQL that creates the schema instead of running it.")
    @click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=30.0,
                  show_default=True, help="Seconds to wait for the database.")
    def upgrade(store: str | None, ledger: str | None, sql: bool, timeout_s: float) -> None:
        """Create or upgrade the store's and/or the audit ledger's schema; exit 0 when each
        named is current afterwards."""
        targets = _targets(click.get_current_context(), store, ledger)
        if sql:
            for target in targets:
                click.echo(target.schema.script(target.component), nl=False)
            return
        for target in targets:
            _upgrade_one(target, timeout_s)


def _targets(ctx: click.Context, store: str | None,
             ledger: str | None) -> list[_Target]:
    """The schemas to upgrade; exits 2 for a URL given as a flag whose kind has no schema, or
    when none is named (an env var's other kind of store is passed over when the other
    component is named)."""
    targets: list[_Target] = []
    for component, url, other in (("store", store, ledger), ("ledger", ledger, store)):
        if not url:
            continue
        kinds = _kinds(component)
        kind = next((k for k in kinds if k.takes(url)), None)
        if kind is None or kind.schema is None:
            if ctx.get_parameter_source(component) is ParameterSource.ENVIRONMENT and other:
                continue  # RELAY_STORE=redis://... beside --ledger: only the ledger has one
            fail(ExitCode.USAGE, f"--{component}: not a "
                                 f"{_either([k.schemes[0] for k in kinds])} URL: "
                                 f"{redact_url(url)} (only a {_either([k.name for k in kinds])} "
                                 f"{component} has a schema to upgrade)")
        targets.append(_Target(component, url, kind, kind.schema))
    if not targets:
        names = _either(sorted({k.name for c in ("store", "ledger") for k in _kinds(c)}))
        fail(ExitCode.USAGE, f"name a {names} database: --store URL and/or --ledger URL")
    return targets


def _upgrade_one(target: _Target, timeout_s: float) -> None:
    """Upgrade ``target``'s schema and say so; exits 78 (its driver's extra missing, or a newer
    schema) or 3 (the database failed) on failure."""
    component, url = target.component, target.url
    missing = kind_extra_missing(target.kind)
    if missing is not None:
        fail(ExitCode.CONFIG, f"{component}: {target.kind.name}'s driver is needed: {missing}")
    try:
        before, after = asyncio.run(target.schema.upgrade(url, component, timeout_s))
    except StoreError as exc:
        fail(ExitCode.STORE_FAILED, f"{component} database failed: {exc}")
    except ConfigError as exc:
        fail(ExitCode.CONFIG, str(exc))
    where = redact_url(url)
    if before == after:
        click.echo(f"{component} schema at {where}: version {after}, current")
    else:
        click.echo(f"{component} schema at {where}: upgraded from version {before} to {after}")
