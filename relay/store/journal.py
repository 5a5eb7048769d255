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

import asyncio
import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from relay.core.errors import StartupError, StoreError
from relay.core.interfaces import FingerprintStore, Settle, SettleOp

log = logging.getLogger("relay.store.journal")

Owed = tuple[str, SettleOp]  # (the attempt's token, the settle it owes)
_Entry = tuple[str, str, SettleOp]  # (the store it is owed to, token, settle)


class OwesSettles(Protocol):
    """What owes settles: the dedup core (:class:`relay.core.dedup.DedupCore`)."""

    @property
    def background(self) -> set[asyncio.Task[Any]]:
        """The settle retries running in the background."""
        ...

    def owed_settles(self) -> list[Owed]:
        """The settles not landed yet."""
        ...

    async def pay_owed(self, owed: Sequence[Owed]) -> list[Owed]:
        """Apply ``owed``; the ones that did not land (retried in the background)."""
        ...


class SettleJournal:
    """The settle journal of one relay process: the file ``path`` (None: off), the ``store``
    its lines are owed to (named by :meth:`names`), paid at start and written at stop."""

    def __init__(self, path: Path | None, store: FingerprintStore, *, prefix: str,
                 url_name: str) -> None:
        self.path = path
        self._store = store
        self._prefix = prefix
        self._url_name = url_name
        self._store_id: str | None = None  # FingerprintStore.identity, once the store answered

    async def names(self) -> tuple[str, ...]:
        """The names journal lines may be owed to this store under: its identity (asked of
        the store until it once answers) with the key prefix, then its URL name."""
        if self._store_id is None:
            try:
                self._store_id = await self._store.identity()
            except StoreError as exc:
                log.warning("the store's identity is unknown (%s): the settle journal names "
                            "it by its URL", exc)
        named = () if self._store_id is None else (f"{self._store_id} prefix={self._prefix}",)
        return (*named, self._url_name)

    async def pay(self, core: OwesSettles) -> None:
        """Apply the settles the last run could not land (compare-token: always safe); what
        is left stays in the file and is retried by ``core`` in the background. Raises
        :class:`StartupError` when the file cannot be read."""
        path = self.path
        if path is None:
            return
        try:
            names = await self.names()
            owed = await asyncio.to_thread(read_journal, path, *names)
        except OSError as exc:
            raise StartupError(f"cannot read the settle journal {path}: {exc}") from exc
        if not owed:
            return
        left = await core.pay_owed(owed)
        log.warning("settle journal %s: %d settle(s) owed by the last run, %d landed now, "
                    "the rest retried in the background", path.resolve(), len(owed),
                    len(owed) - len(left))
        # what is left stays in the file (and is owed in memory): a crash before the next stop
        # loses nothing, and applying a settle again later changes nothing
        pending = {(token, op.key, op.action) for token, op in left}
        paid = [(t, op) for t, op in owed if (t, op.key, op.action) not in pending]
        await asyncio.to_thread(remove_from_journal, path, paid, *names)

    async def write(self, core: OwesSettles) -> None:
        """Stop ``core``'s background settle retries and write what they still owe, for the
        next start (the store did not answer in time). Logs; never raises."""
        for task in list(core.background):
            task.cancel()
        await asyncio.gather(*core.background, return_exceptions=True)
        owed = core.owed_settles()
        if not owed:
            return
        path = self.path
        if path is None:
            log.error("%d settle(s) still owed at exit and settle_journal is off: those "
                      "records read as in doubt after their lease", len(owed))
            return
        try:
            owner = (await self.names())[0]
            await asyncio.to_thread(add_to_journal, path, owed, owner)
        except OSError as exc:
            log.error("cannot write %d owed settle(s) to %s: %s", len(owed), path, exc)
            return
        log.error("%d settle(s) still owed at exit: written to %s for the next start",
                  len(owed), path.resolve())


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
