"""The journal of settles still owed when the relay stops (issue 8 item 2; docs: README
"Graceful shutdown").

A settle after a definite upstream reply (SENT after a 250, release after a refusal, UNKNOWN
after a cut past the final dot) that has not landed when the relay exits, because the store did
not answer, is written here, one JSON object per line: ``{"token", "key", "action", "reply"}``.
The next start applies every line (the writes are compare-token, so applying them late, or
twice, is always safe) and keeps in the file only what still did not land. Several relays
started from one directory share the file: every change is a read-modify-write under an
exclusive lock (``flock`` on ``<name>.lock``) that keeps the others' lines. Without it the
record would stay SENDING and read as in doubt once its lease ran out, although the relay knew
the answer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from relay.interfaces import Settle, SettleOp

log = logging.getLogger("relay.settle_journal")

Owed = tuple[str, SettleOp]  # (the attempt's token, the settle it owes)


def read_journal(path: Path) -> list[Owed]:
    """Every owed settle in ``path`` (none when it does not exist); a line that is not a valid
    entry is logged and skipped. Raises :class:`OSError` when the file cannot be read."""
    if not path.exists():
        return []
    owed: list[Owed] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            owed.append((str(entry["token"]), SettleOp(
                key=str(entry["key"]), action=Settle(entry["action"]),
                reply=str(entry.get("reply", "")))))
        except (ValueError, KeyError, TypeError):
            log.error("settle journal %s line %d is not an owed settle: skipped", path, number)
    return owed


def add_to_journal(path: Path, owed: Sequence[Owed]) -> None:
    """Add ``owed`` to the journal at ``path``, keeping what is there (several relays started
    from one directory may share the file). Raises :class:`OSError`."""
    with _locked(path):
        _write(path, _merged(read_journal(path), owed))


def remove_from_journal(path: Path, paid: Sequence[Owed]) -> None:
    """Remove the settles ``paid`` from the journal at ``path``, keeping any another relay added
    meanwhile. Raises :class:`OSError`."""
    with _locked(path):
        done = {_ident(entry) for entry in paid}
        _write(path, [e for e in read_journal(path) if _ident(e) not in done])


def _ident(entry: Owed) -> tuple[str, str, str]:
    token, op = entry
    return token, op.key, op.action.value


def _merged(old: Sequence[Owed], new: Sequence[Owed]) -> list[Owed]:
    seen: dict[tuple[str, str, str], Owed] = {}
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


def _write(path: Path, owed: Sequence[Owed]) -> None:
    """Replace ``path`` with ``owed`` (deleted when empty), atomically (write, fsync, rename)."""
    if not owed:
        path.unlink(missing_ok=True)
        return
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as out:
        for token, op in owed:
            out.write(json.dumps({"token": token, "key": op.key, "action": op.action.value,
                                  "reply": op.reply}) + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
