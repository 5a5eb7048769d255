"""The embedded SQLite store as a :class:`relay.store.kinds.StoreKind`: ``sqlite:///PATH``
URLs (SQLAlchemy's form), the file they name, and its opening. Imports no more than the
standard library: :mod:`relay.store.sqlite.store` is imported when a store is opened."""

from __future__ import annotations

from pathlib import Path

from relay.core.errors import ConfigError
from relay.core.interfaces import FingerprintStore
from relay.store.kinds import NamedFile, OpenOptions, StoreKind

_PREFIX = "sqlite:///"
_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def sqlite_path_from_url(url: str) -> str:
    """Return the file path of a ``sqlite:///`` URL (SQLAlchemy convention).

    ``sqlite:///relative/path.db`` gives ``relative/path.db`` (relative to the working
    directory) and ``sqlite:////abs/path.db`` gives ``/abs/path.db``. Raises
    :class:`ValueError` for any other form.
    """
    if not url.startswith(_PREFIX):
        raise ValueError(
            f"store URL {url!r} is not a SQLite URL: use sqlite:///relative/path.db "
            "or sqlite:////absolute/path.db"
        )
    path = url[len(_PREFIX) :]
    if not path or path.endswith("/") or "?" in path or "#" in path:
        raise ValueError(f"store URL {url!r} does not name a database file")
    return path


def _check_url(url: str, _setting: str) -> None:
    """Raise ValueError unless ``url`` names a file (``sqlite:///`` alone names none)."""
    sqlite_path_from_url(url)


def _data_file(url: str) -> Path:
    """The database file ``url`` names."""
    return Path(sqlite_path_from_url(url))


def _check_header(path: Path) -> None:
    """Raise ConfigError unless ``path`` is empty, missing or a SQLite database."""
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as file:
            if file.read(len(_HEADER)) != _HEADER:
                raise ConfigError(f"{path} is not a SQLite database")


def _files(url: str) -> list[NamedFile]:
    """The database file: writable (or makeable), and a SQLite database when it holds data."""
    path = _data_file(url)
    return [NamedFile(path, "the SQLite file", "write", check=lambda: _check_header(path))]


def _shown(url: str) -> str:
    """``url`` with a relative path made absolute (it depends on the working directory)."""
    path = url[len(_PREFIX) :]
    return f"{_PREFIX}{Path(path).absolute()}" if path and not path.startswith("/") else url


async def _open(url: str, options: OpenOptions) -> FingerprintStore:
    """Open (creating when missing) the database file ``url`` names; StoreError when it
    cannot be opened or set up."""
    from relay.store.sqlite.store import SqliteStore

    return await SqliteStore.open(sqlite_path_from_url(url), op_timeout_s=options.op_timeout_s)


SQLITE = StoreKind(
    name="SQLite",
    label="embedded sqlite",
    schemes=(_PREFIX,),
    forms="sqlite:///PATH (relative to the working directory; sqlite:////abs/path.db)",
    check_url=_check_url,
    files=_files,
    open=_open,
    data_file=_data_file,
    shown=_shown,
)
