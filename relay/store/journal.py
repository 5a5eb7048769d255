"""The journal of settles still owed when the relay stops (docs/design.md §3, "The settle
journal"; README "Graceful shutdown").

One JSON object per line: ``{"store", "token", "key", "action", "reply"}`` (and ``window_s``,
seconds, when the settle's message had a dedup window of its own), ``store`` naming
the store the settle is owed to: its identity (``FingerprintStore.identity``: the same
under any spelling of its URL) and key prefix, or, when the store never answered, its URL
(password masked) and key prefix; a relay reads only the lines owed to either name of its
store. The next start applies them (compare-token writes: applying one
late, or twice, is safe) and keeps in the file only what still did not land. Every change is a
read-modify-write under an exclusive lock (``flock`` on ``<name>.lock``) that keeps the other
lines, so relays started from one directory can share the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from relay.core.interfaces import Settle, SettleOp

log = logging.getLogger("relay.store.journal")

Owed = tuple[str, SettleOp]  # (the attempt's token, the settle it owes)
_Entry = tuple[str, str, SettleOp]  # (the store it is owed to, token, settle)


def read_journal(path: Path, *stores: str) -> list[Owed]:
    """The settles in ``path`` owed to any of ``stores`` (the names of one store: its identity
    and its URL, each with the key prefix), each once; none when the file does not exist. A
    line that is not a valid entry is logged and skipped. Raises :class:`OSError` when the
    file cannot be read."""
    owed: dict[tuple[str, str, str], Owed] = {}
    for owner, token, op in _read_all(path):
        if owner in stores:
            owed.setdefault((token, op.key, op.action.value), (token, op))
    return list(owed.values())


def add_to_journal(path: Path, owed: Sequence[Owed], store: str) -> None:
    """Add ``owed`` (owed to ``store``) to the journal at ``path``, keeping what is there
    (several relays, on this store or others, may share the file). Raises :class:`OSError`."""
    with _locked(path):
        _write(path, _merged(_read_all(path), [(store, t, op) for t, op in owed]))


def remove_from_journal(path: Path, paid: Sequence[Owed], *stores: str) -> None:
    """Remove the settles ``paid`` to any of ``stores`` (the names of one store) from the
    journal at ``path``, keeping every other line (another relay's, another store's). Raises
    :class:`OSError`."""
    with _locked(path):
        done = {_ident((store, t, op)) for t, op in paid for store in stores}
        _write(path, [e for e in _read_all(path) if _ident(e) not in done])


def _read_all(path: Path) -> list[_Entry]:
    if not path.exists():
        return []
    entries: list[_Entry] = []
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


def _ident(entry: _Entry) -> tuple[str, str, str, str]:
    store, token, op = entry
    return store, token, op.key, op.action.value


def _merged(old: Sequence[_Entry], new: Sequence[_Entry]) -> list[_Entry]:
    seen: dict[tuple[str, str, str, str], _Entry] = {}
    for entry in (*old, *new):
        seen.setdefault(_ident(entry), entry)
    return list(seen.values())


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


def _write(path: Path, entries: Sequence[_Entry]) -> None:
    """Replace ``path`` with ``entries`` (deleted when none), atomically (write, fsync, rename)."""
    if not entries:
        path.unlink(missing_ok=True)
        return
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as out:
        for store, token, op in entries:
            line: dict[str, object] = {"store": store, "token": token, "key": op.key,
                                       "action": op.action.value, "reply": op.reply}
            if op.window_s:
                line["window_s"] = op.window_s
            out.write(json.dumps(line) + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
