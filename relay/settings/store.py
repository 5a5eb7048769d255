"""The fingerprint store: which one (a URL of a kind of :mod:`relay.store.registry`: Redis, a
Redis Cluster or Sentinel, embedded SQLite, PostgreSQL), its key prefix and key form, its
round-trip timeout, and the settle journal that carries settles the store did not take across
a restart; built into a :class:`relay.core.interfaces.FingerprintStore`. Nothing here changes
on reload. Nothing here knows a kind of store: each is asked through its
:class:`relay.store.kinds.StoreKind`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, field_validator

from relay.core.errors import ConfigError
from relay.settings.common import (
    FileCheck,
    Section,
    check_named_files,
    kind_extra_missing,
    redact_url,
    writable_file,
)
from relay.store.kinds import OpenOptions, StoreKind
from relay.store.registry import kind_of, url_forms

if TYPE_CHECKING:
    from relay.core.interfaces import FingerprintStore, RateLimiter

DEFAULT_STORE_URL = "sqlite:///data/dedup-relay.db"


class StoreSettings(Section):
    """Where fingerprints are kept, under which keys, and how long a store call may take."""

    TITLE: ClassVar[str] = "Store"

    store: str = Field(DEFAULT_STORE_URL, description=url_forms())
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
        kind = kind_of(value)
        if kind is None:
            raise ValueError(f"store must be one of: {url_forms()}, got {value!r}")
        missing = kind_extra_missing(kind)
        if missing is not None:
            raise ValueError(f"a {kind.schemes[0]} store needs {kind.name}'s driver: {missing}")
        kind.check_url(value, "store")  # its ValueError names the fault, never the password
        return value

    @property
    def store_kind(self) -> str:
        """The store's kind as the start-up line names it: ``redis``, ``embedded sqlite``,
        ``postgresql`` (:attr:`relay.store.kinds.StoreKind.label`)."""
        return _kind(self.store).label

    @property
    def store_data_file(self) -> Path | None:
        """The file an embedded store (SQLite) keeps its data in; None for a server's."""
        data_file = _kind(self.store).data_file
        return None if data_file is None else data_file(self.store)

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
        """Raise ConfigError unless the files the store URL names are usable (a Redis URL's TLS
        files, a SQLite file's directory and format, a PostgreSQL URL's TLS and password
        files: :attr:`relay.store.kinds.StoreKind.files`)."""
        check_named_files(_kind(self.store).files(self.store))

    async def open_store(self, *, window_s: float) -> FingerprintStore:
        """Open the store its URL's kind names (:attr:`relay.store.kinds.StoreKind.open`).
        ``window_s``: the dedup window (Redis's idle-key check). Raises StoreError, or
        StartupError (a PostgreSQL schema missing or old), or ConfigError naming the URL for a
        setting only the store could find wrong (a Redis database number the server does not
        have)."""
        options = OpenOptions(op_timeout_s=self.store_timeout, window_s=window_s)
        try:
            return await _kind(self.store).open(self.store, options)
        except ConfigError as exc:
            raise ConfigError(f"store: {exc} ({redact_url(self.store)})") from exc

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


def _kind(url: str) -> StoreKind:
    """The kind of the store URL ``url`` (a validated setting: one kind takes it)."""
    kind = kind_of(url)
    if kind is None:  # only a URL the validator refused has none
        raise ConfigError(f"store: no kind of store takes {redact_url(url)}")
    return kind
