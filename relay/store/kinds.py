"""What a kind of fingerprint store tells the relay (:class:`StoreKind`): the URLs it takes,
their check, the files they name, how a store of that kind is opened, and what else it has (a
pip extra, a database schema, a data file of its own).

Each store package exports one :class:`StoreKind` from its ``kind`` module
(``relay/store/sqlite/kind.py``); :mod:`relay.store.registry` lists them, and the settings and
the command line ask the registry, never a URL's scheme. A kind module imports no driver: its
store module (and the driver, which may be a missing extra) is imported by :attr:`StoreKind.open`
and :class:`Schema` when a store of that kind is used. How a kind is added: docs/layout.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from relay.core.interfaces import FingerprintStore


@dataclass(frozen=True)
class NamedFile:
    """A file a store URL names, as the store will use it (nothing opened yet).

    ``what`` names it in an error (``ssl_ca_certs=/etc/ca.pem``, ``the SQLite file``). ``use``:
    ``read`` a file the store reads, ``ca`` PEM CA certificates the store reads, ``write`` the
    store's own data file, made with its directory when missing. ``check`` (raises
    :class:`relay.core.errors.ConfigError`) judges its content once it is usable; None: none.
    The settings check each (:func:`relay.settings.common.check_named_files`)."""

    path: Path
    what: str
    use: Literal["read", "ca", "write"]
    check: Callable[[], None] | None = None


@dataclass(frozen=True)
class Extra:
    """The pip extra a store kind needs: ``name`` (``postgres``: ``pip install
    'dedup-relay[postgres]'``) and ``module``, the driver it installs (``asyncpg``)."""

    name: str
    module: str


@dataclass(frozen=True)
class OpenOptions:
    """What every store is opened with: ``op_timeout_s`` bounds each store call (seconds,
    the ``store_timeout`` setting), ``window_s`` is the dedup window (seconds)."""

    op_timeout_s: float
    window_s: float


@dataclass(frozen=True)
class Schema:
    """The database schema of a store kind, which ``dedup-relay db upgrade`` creates or
    upgrades (a store opened on a missing or old one refuses to start).

    ``script(component)`` is the SQL of the upgrade (``component``: ``store``, or ``ledger``
    for the audit ledger's database), for a DBA to apply. ``upgrade(url, component,
    timeout_s)`` applies it and returns (version before, after); it raises
    :class:`relay.core.errors.StoreError` when the database fails or does not answer within
    ``timeout_s`` seconds, :class:`relay.core.errors.ConfigError` when it holds a newer schema
    than this relay."""

    script: Callable[[str], str]
    upgrade: Callable[[str, str, float], Coroutine[Any, Any, tuple[int, int]]]


@dataclass(frozen=True)
class StoreKind:
    """One kind of fingerprint store, as the settings and the command line see it.

    ``name`` is how a message names it (``PostgreSQL``: ``PostgreSQL's driver``), ``label``
    its kind in the start-up line and the admin commands' ``store:`` line (``embedded
    sqlite``). ``schemes`` are the beginnings of the URLs it takes (``sqlite:///``), the first
    the one a message names; ``forms`` the URL forms for ``--help``, docs/settings.md and the
    refusal of any other URL. ``check_url(url, setting)`` raises :class:`ValueError` naming the
    fault (and ``setting``, ``store`` or ``ledger``), never a password. ``files(url)`` lists
    the files the URL names. ``open(url, options)`` opens a store: it raises
    :class:`relay.core.errors.StoreError` when the store fails in a way a retry may mend,
    :class:`relay.core.errors.StartupError` when it never will as configured (a schema missing
    or old), :class:`relay.core.errors.ConfigError` for a setting that only the store could
    find wrong (the settings name the URL). ``extra``: the pip extra its driver comes from
    (None: a core dependency). ``schema``: its database schema (None: it has none to upgrade).
    ``data_file(url)``: the file an embedded store keeps its data in (None: a server's store),
    which the admin commands refuse to make. ``shown(url)``: the URL as logs show it, when
    more than its passwords change (None: only those)."""

    name: str
    label: str
    schemes: tuple[str, ...]
    forms: str
    check_url: Callable[[str, str], None]
    files: Callable[[str], Sequence[NamedFile]]
    open: Callable[[str, OpenOptions], Awaitable[FingerprintStore]]
    extra: Extra | None = None
    schema: Schema | None = None
    data_file: Callable[[str], Path] | None = None
    shown: Callable[[str], str] | None = None

    def takes(self, url: str) -> bool:
        """Whether ``url`` is one of this kind's (begins with one of its :attr:`schemes`)."""
        return url.startswith(self.schemes)
