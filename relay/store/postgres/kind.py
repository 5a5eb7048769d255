"""PostgreSQL as a :class:`relay.store.kinds.StoreKind`: ``postgresql://`` URLs (libpq's form),
the files their parameters name, the opening and the schema of ``dedup-relay db upgrade``. The
audit ledger's database is a PostgreSQL one too (:data:`POSTGRES`, component ``ledger``).

Imports no asyncpg (the ``postgres`` extra, which may be missing): :mod:`.store` is imported
when a store is opened or a schema upgraded; :mod:`.migrations` is plain text."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from relay.core.errors import ConfigError
from relay.core.interfaces import FingerprintStore
from relay.store.kinds import Extra, NamedFile, OpenOptions, Schema, StoreKind
from relay.store.postgres import migrations

# libpq URL parameters that name a file (asyncpg reads them at connect time)
_FILE_OPTIONS = ("sslrootcert", "sslcert", "sslkey", "sslcrl", "passfile")


def _check_url(url: str, setting: str) -> None:
    """Raise ValueError unless ``url`` is a usable ``postgresql://USER@HOST:PORT/DB`` URL
    (libpq's query parameters are asyncpg's to judge at connect time); the message names
    ``setting`` and the fault, never the password."""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018  # raises ValueError for a port that is no number
    except ValueError:
        raise ValueError(f"{setting} URL port must be a number from 0 to 65535") from None
    if not parts.path.strip("/") and "dbname=" not in parts.query \
            and "database=" not in parts.query:
        raise ValueError(f"a postgresql:// {setting} URL must name its database: "
                         "postgresql://USER@HOST:PORT/DB")


def _files(url: str) -> list[NamedFile]:
    """The files the URL's libpq parameters name (``sslrootcert=system``: the system's CAs)."""
    return [NamedFile(Path(value).expanduser(), f"{name}={value}", "read")
            for name, value in parse_qsl(urlsplit(url).query)
            if name in _FILE_OPTIONS and value != "system"]


async def _open(url: str, options: OpenOptions) -> FingerprintStore:
    """Open the store's pool; StartupError when its schema is missing or old (or the
    database refuses the URL), StoreError when it fails otherwise."""
    from relay.store.postgres.store import PostgresStore

    return await PostgresStore.open(url, op_timeout_s=options.op_timeout_s)


async def _upgrade(url: str, component: str, timeout_s: float) -> tuple[int, int]:
    """Upgrade ``component``'s schema at ``url``; (version before, after). StoreError when
    the database fails, ConfigError when its schema is newer than this relay's."""
    from relay.store.postgres.store import upgrade_schema

    try:
        return await upgrade_schema(url, component, timeout_s=timeout_s)
    except migrations.SchemaError as exc:
        raise ConfigError(str(exc)) from exc


POSTGRES = StoreKind(
    name="PostgreSQL",
    label="postgresql",
    schemes=("postgresql://", "postgres://"),
    forms="postgresql://USER@HOST:PORT/DB (or postgres://)",
    check_url=_check_url,
    files=_files,
    open=_open,
    extra=Extra(name="postgres", module="asyncpg"),
    schema=Schema(script=migrations.script, upgrade=_upgrade),
)
