"""The fingerprint store: which one (Redis, a Redis Cluster or Sentinel, embedded SQLite,
PostgreSQL), its key prefix and key form, its round-trip timeout, and the settle journal that
carries settles the store did not take across a restart; built into a
:class:`relay.core.interfaces.FingerprintStore`. Nothing here changes on reload."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal
from urllib.parse import parse_qsl, urlsplit

from pydantic import Field, field_validator

from relay.core.errors import ConfigError, StoreError
from relay.settings.common import (
    FileCheck,
    Section,
    check_postgres_url,
    extra_missing,
    is_postgres_url,
    postgres_files,
    readable,
    redact_url,
    writable_file,
)

if TYPE_CHECKING:
    from relay.core.interfaces import FingerprintStore, RateLimiter

log = logging.getLogger("relay.app")

DEFAULT_STORE_URL = "sqlite:///data/dedup-relay.db"
# redis-py URL options that name a file (the CA bundle, a client certificate and its key)
_STORE_FILE_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")
_SQLITE_HEADER = b"SQLite format 3\x00"


class StoreSettings(Section):
    """Where fingerprints are kept, under which keys, and how long a store call may take."""

    TITLE: ClassVar[str] = "Store"

    store: str = Field(DEFAULT_STORE_URL, description=(
        "redis://, rediss://, redis+cluster://H:P,..., redis+sentinel://H:P,.../SERVICE or "
        "sqlite:///PATH (relative to the working directory; sqlite:////abs/path.db)"))
    store_prefix: str = Field("email:fp:", description="key prefix of every fingerprint")
    store_key_format: Literal["hex", "compact"] = Field("hex", description=(
        "fingerprint form in a store key: hex (64 characters, the seed formula an application "
        "can compute) or compact (base64url, 43 characters: less store memory)"))
    store_timeout: float = Field(default=2.0, gt=0, description=(
        "seconds per store round trip; a timeout counts as the store being down"))
    settle_journal: str = Field("data/owed-settles.jsonl", description=(
        "file for the settles the store did not take at once: written before the client's "
        "reply, dropped once they land, applied by the next start (relative to the working "
        "directory); empty: kept in memory only (a crash loses them)"))

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        schemes = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://",
                   "redis+sentinel://", "rediss+sentinel://", "sqlite:///", "postgresql://",
                   "postgres://")
        if not value.startswith(schemes):
            raise ValueError(
                "store must be a redis://, rediss:// or sqlite:///path URL, a postgresql:// "
                "URL, or a redis+cluster://host:port,... or "
                "redis+sentinel://host:port,.../service URL (rediss+ for TLS), got " + repr(value)
            )
        if is_postgres_url(value):
            missing = extra_missing("asyncpg")
            if missing is not None:
                raise ValueError(f"a postgresql:// store needs PostgreSQL's driver: {missing}")
            return check_postgres_url(value)
        # imported here: only this validator uses it (a pure parser, no I/O library)
        from relay.store.redis.urls import is_multi_host_url, parse_multi_host_url

        if is_multi_host_url(value):
            parse_multi_host_url(value)  # its ValueError names the fault, never the password
        elif value.startswith("sqlite:///"):
            from relay.store.sqlite import sqlite_path_from_url

            sqlite_path_from_url(value)  # "sqlite:///" alone names no file
        else:  # redis:// or rediss://: redis-py would quietly take db 0 for /abc
            parts = urlsplit(value)
            db = parts.path.strip("/")
            if db and not db.isdigit():
                raise ValueError(f"store URL database must be a number, got /{db}")
            try:
                parts.port  # noqa: B018  # raises ValueError for a port that is no number
            except ValueError:
                raise ValueError("store URL port must be a number from 0 to 65535") from None
        return value

    @property
    def store_kind(self) -> str:
        """``redis``, ``postgresql`` or ``embedded sqlite``."""
        if self.store.startswith("redis"):
            return "redis"
        return "postgresql" if is_postgres_url(self.store) else "embedded sqlite"

    def file_checks(self, *, live: bool) -> list[FileCheck]:
        """The files the store URL names (``ssl_ca_certs=`` ..., an existing SQLite file's
        format, its directory) and that the settle journal can be written. ``live`` (a
        reload: the store cannot change live) leaves the store's files alone: a process that
        has the SQLite file open must never open and close it again, because closing any
        descriptor of a file drops every POSIX lock the process holds on it (fcntl(2)), and
        another process closing its connection would then delete the live WAL."""
        checks: list[FileCheck] = []
        if not live:
            checks.append((("store",), self._store_files))
        if self.settle_journal:
            journal = Path(self.settle_journal)
            checks.append((("settle_journal",),
                           lambda: writable_file(journal, "the settle journal")))
        return checks

    def _store_files(self) -> None:
        """Raise ConfigError unless the files the store URL names are usable: a Redis URL's
        TLS files readable and its ``ssl_ca_certs`` PEM certificates; a SQLite file's
        directory and format; a PostgreSQL URL's TLS and password files."""
        if is_postgres_url(self.store):
            postgres_files(self.store)
            return
        if not self.store.startswith("redis"):
            from relay.store.sqlite import sqlite_path_from_url

            _sqlite_file(Path(sqlite_path_from_url(self.store)))
            return
        for name, value in parse_qsl(urlsplit(self.store).query):
            if name in _STORE_FILE_OPTIONS:
                readable(Path(value), f"{name}={value}")
            if name == "ssl_ca_certs":
                try:
                    ssl.create_default_context(cafile=value)
                except (ssl.SSLError, OSError) as exc:
                    raise ConfigError(f"ssl_ca_certs={value}: not a PEM CA certificate file "
                                      f"({exc})") from exc

    async def open_store(self, *, window_s: float) -> FingerprintStore:
        """Open the store: sqlite:///, one Redis server (redis://, rediss://), a Redis Cluster
        (redis+cluster://) or a Sentinel-managed master (redis+sentinel://), the last two also
        as rediss+ (TLS), or PostgreSQL (postgresql://, postgres://: raises StartupError when
        its schema is missing or old). ``window_s``: the dedup window (Redis's idle-key
        check). Raises ConfigError for a Redis database number the server does not have."""
        from relay.store.redis.store import RedisStore
        from relay.store.sqlite import SqliteStore, sqlite_path_from_url

        if is_postgres_url(self.store):  # the postgres extra: imported only here
            from relay.store.postgres.store import PostgresStore

            return await PostgresStore.open(self.store, op_timeout_s=self.store_timeout)
        if self.store.startswith("redis"):  # redis, rediss and their +cluster, +sentinel forms
            store = RedisStore.from_url(self.store, op_timeout_s=self.store_timeout,
                                        window_s=window_s)
            try:
                await store.ping()
                for warning in await store.check_server():
                    log.warning("redis: %s", warning)
            except StoreError as exc:
                if "DB index is out of range" in str(exc):  # a setting error, not an outage
                    await store.close()
                    raise ConfigError(f"store: the Redis server has no database of that "
                                      f"number ({redact_url(self.store)})") from exc
                log.warning("redis not reachable at start-up (%s); will fail closed until it "
                            "is", exc)
            return store
        return await SqliteStore.open(
            sqlite_path_from_url(self.store), op_timeout_s=self.store_timeout)

    def rate_limiter(self, store: FingerprintStore) -> RateLimiter | None:
        """The store's rate limiter (its counters under ``store_prefix``), built even with no
        limit configured (a reload may add some); None for a store that has none."""
        make: Callable[[str], RateLimiter] | None = getattr(store, "rate_limiter", None)
        return make(self.store_prefix) if make is not None else None

    def describe_store(self) -> str:
        """The store for the start-up line: its URL (password masked) and kind."""
        return f"{redact_url(self.store)} ({self.store_kind})"

    @property
    def store_url_name(self) -> str:
        """The store's name in the settle journal when its identity is unknown: its URL
        (password masked) and key prefix."""
        return f"{redact_url(self.store)} prefix={self.store_prefix}"


def _sqlite_file(path: Path) -> None:
    """Raise ConfigError unless ``path`` is a SQLite database, empty, or can be made."""
    writable_file(path, "the SQLite file")
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as file:
            if file.read(len(_SQLITE_HEADER)) != _SQLITE_HEADER:
                raise ConfigError(f"{path} is not a SQLite database")
