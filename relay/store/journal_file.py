"""The settle journal's file (docs/design.md §3, "The settle journal"): its lines, and every
change to it under one exclusive lock.

One JSON object per line: ``{"store", "token", "key", "action", "reply"}`` (and ``window_s``,
seconds, when the settle's message had a dedup window of its own); ``store`` names the store
the settle is owed to (:class:`relay.store.journal.SettleJournal` chooses the name). A settle
owed is *appended* (one ``write`` per batch, then ``fsync``; the directory is fsynced too when
the append created the file); a settle that landed is *dropped* by rewriting the file without
it (write a ``.partial`` beside it, ``fsync``, rename over it; the file is deleted once empty).
Every change and every read holds an exclusive ``flock`` on ``<name>.lock``, so the processes
of several relays started from one directory share the file: an append never goes to a file
that a rewrite has replaced, and a rewrite keeps every line it was not asked to drop (another
process's, another store's). Each batch starts on a line of its own: a line left half written
by a process killed mid-write is skipped (logged) when read, never glued to the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

from relay.core.interfaces import Settle, SettleOp

log = logging.getLogger("relay.store.journal")

Owed = tuple[str, SettleOp]  # (the attempt's token, the settle it owes)
Entry = tuple[str, str, SettleOp]  # (the store it is owed to, token, settle)
Ident = tuple[str, str, str, str]  # (store, token, key, action): one line, whatever its reply


def ident(entry: Entry) -> Ident:
    """What names one line: its store, token, key and action."""
    store, token, op = entry
    return store, token, op.key, op.action.value


def idents(owed: Sequence[Owed], stores: Sequence[str]) -> set[Ident]:
    """The lines of ``owed`` under each of the names ``stores`` (one store's names)."""
    return {ident((store, token, op)) for token, op in owed for store in stores}


def read_entries(path: Path) -> list[Entry]:
    """Every valid line of ``path``, in file order (none when the file does not exist); a
    line that is not a valid entry is logged and skipped. Raises :class:`OSError` when the
    file cannot be read."""
    with _locked(path):
        return _read_all(path)


def read_journal(path: Path, *stores: str) -> list[Owed]:
    """The settles in ``path`` owed to any of ``stores`` (the names of one store: its identity
    and its URL, each with the key prefix), each once. Raises :class:`OSError`."""
    owed: dict[tuple[str, str, str], Owed] = {}
    for owner, token, op in read_entries(path):
        if owner in stores:
            owed.setdefault((token, op.key, op.action.value), (token, op))
    return list(owed.values())


def add_to_journal(path: Path, owed: Sequence[Owed], store: str) -> None:
    """Append ``owed`` (owed to ``store``) to the journal at ``path`` and fsync it, keeping
    what is there. Raises :class:`OSError`."""
    change_journal(path, [(store, token, op) for token, op in owed], set())


def remove_from_journal(path: Path, paid: Sequence[Owed], *stores: str) -> None:
    """Drop the settles ``paid`` to any of ``stores`` (the names of one store) from the
    journal at ``path``, keeping every other line. Raises :class:`OSError`."""
    change_journal(path, [], idents(paid, stores))


def change_journal(path: Path, add: Sequence[Entry], drop: Collection[Ident]) -> None:
    """One change of the journal at ``path`` under its lock: append ``add`` (fsynced), and
    when ``drop`` is not empty rewrite the file without those lines (``add`` kept). Raises
    :class:`OSError`."""
    with _locked(path):
        if drop:
            kept = [e for e in _read_all(path) if ident(e) not in drop]
            _rewrite(path, [*kept, *add])
        elif add:
            _append(path, add)


def _read_all(path: Path) -> list[Entry]:
    if not path.exists():
        return []
    entries: list[Entry] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            entries.append((str(entry["store"]), str(entry["token"]), SettleOp(
                key=str(entry["key"]), action=Settle(entry["action"]),
                reply=str(entry.get("reply", "")),
                window_s=float(entry.get("window_s", 0.0)))))
        except (ValueError, KeyError, TypeError):
            log.error("settle journal %s line %d is not an owed settle: skipped", path, number)
    return entries


def _line(entry: Entry) -> str:
    store, token, op = entry
    line: dict[str, object] = {"store": store, "token": token, "key": op.key,
                               "action": op.action.value, "reply": op.reply}
    if op.window_s:
        line["window_s"] = op.window_s
    return json.dumps(line) + "\n"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s lock file (``<name>.lock``) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a", encoding="utf-8") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _append(path: Path, entries: Sequence[Entry]) -> None:
    """Append ``entries`` in one write and fsync; a file that did not end its last line (a
    writer killed mid-write) gets a line end first."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        lead = b""
        if size:
            with open(path, "rb") as tail:
                tail.seek(size - 1)
                lead = b"" if tail.read(1) == b"\n" else b"\n"
        os.write(fd, lead + "".join(_line(e) for e in entries).encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    if not size:  # the file is new (or was empty): its name must survive a crash too
        _fsync_dir(path)


def _rewrite(path: Path, entries: Sequence[Entry]) -> None:
    """Replace ``path`` with ``entries`` (deleted when none), atomically (write, fsync,
    rename, fsync the directory)."""
    if not entries:
        if path.exists():
            path.unlink()
            _fsync_dir(path)
        return
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as out:
        out.write("".join(_line(e) for e in entries))
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
