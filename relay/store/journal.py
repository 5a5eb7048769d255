"""The settle journal of one relay process (docs/design.md §3, "The settle journal"; README
"Graceful shutdown"): the settles it owes, on disk from before the client's reply until they
land, so that no crash loses one.

A settle whose quick tries failed is appended to the file (:mod:`relay.store.journal_file`)
and fsynced before the client is answered (:meth:`SettleJournal.owe`); once it lands (or is
given up with the dedup window) it is dropped (:meth:`SettleJournal.landed`). A settle that
lands at once never touches the file. This process's changes run one at a time in a task of
their own (:class:`_Changes`), in the order they were asked for: appends that queue while one
runs share one write and one fsync, landed settles that queue share one rewrite.

Each line names the store it is owed to: its identity (``FingerprintStore.identity``: the same
under any spelling of its URL) with the key prefix, or, while the store has not answered, its
URL (password masked) with the prefix. Every start of a process (each worker too, and a worker
restarted after a crash) reads the file: the lines owed to either name of its store are paid
(compare-token writes: applying one late, or twice, is safe; the lines of a live process are
paid twice, harmlessly). When the store does not answer at the start, lines written under an
identity (the usual case) might be this store's: they are kept, the identity is asked again
every few seconds, and they are paid as soon as it answers; meanwhile a reserve of one of
their keys first asks for the identity, and is refused as for a store failure when it does
not come (:meth:`SettleJournal.unpaid`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from relay.core.errors import StartupError, StoreError
from relay.core.interfaces import FingerprintStore
from relay.store.journal_file import (
    Entry,
    Ident,
    Owed,
    change_journal,
    idents,
    read_entries,
)

log = logging.getLogger("relay.store.journal")

CONFIRM_FIRST_S = 0.2  # the first wait before the store's identity is asked again (seconds)
CONFIRM_MAX_S = 2.0  # the longest wait between two asks


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
    """The settle journal of one relay process: the file ``path`` (None: off, settles owed
    are kept in memory only), the ``store`` its lines are owed to, known as ``url_name`` (its
    URL and key prefix) until its identity answers. Implements
    :class:`relay.core.interfaces.SettleLog` for the dedup core."""

    def __init__(self, path: Path | None, store: FingerprintStore, *, prefix: str,
                 url_name: str) -> None:
        self.path = path
        self._store = store
        self._prefix = prefix
        self._url_name = url_name
        self._store_id: str | None = None  # FingerprintStore.identity, once the store answered
        self._changes = _Changes(path) if path is not None else None
        self._unsaved: set[tuple[str, str, str]] = set()  # owed, but the append failed
        # lines an earlier run owed under a store identity that may be this store's
        self._unconfirmed: list[Entry] = []
        self._unconfirmed_keys: set[str] = set()
        self._confirming: asyncio.Task[None] | None = None

    def names(self) -> tuple[str, ...]:
        """The names this store's lines may be written under: its identity with the key
        prefix (once known), then its URL name."""
        named = () if self._store_id is None else (self._identity_name(self._store_id),)
        return (*named, self._url_name)

    def _identity_name(self, store_id: str) -> str:
        return f"{store_id} prefix={self._prefix}"

    async def _ask_identity(self) -> str | None:
        """The store's identity, asked of it until it once answered; None while it does not."""
        if self._store_id is None:
            try:
                self._store_id = await self._store.identity()
            except StoreError as exc:
                log.debug("the store's identity is unknown (%s)", exc)
        return self._store_id

    async def pay(self, core: OwesSettles) -> None:
        """At this process's start: apply the settles the file holds for this store (what
        does not land stays in the file and is retried by ``core`` in the background), and,
        when the store's identity is unknown, hold the lines that may be its own until it
        answers. Raises :class:`StartupError` when the file cannot be read."""
        path = self.path
        if path is None:
            return
        if await self._ask_identity() is None:
            log.warning("the store's identity is unknown: the settle journal names it by its "
                        "URL until it answers")
        try:
            entries = await asyncio.to_thread(read_entries, path)
        except OSError as exc:
            raise StartupError(f"cannot read the settle journal {path}: {exc}") from exc
        names = self.names()
        owed = _unique((token, op) for owner, token, op in entries if owner in names)
        if self._store_id is None:
            suffix = f" prefix={self._prefix}"
            self._hold([e for e in entries if e[0] not in names and e[0].endswith(suffix)])
            self._confirming = asyncio.create_task(self._confirm_until_known(core))
        if owed:
            left = await core.pay_owed(owed)
            log.warning("settle journal %s: %d settle(s) owed by an earlier run, %d landed "
                        "now, the rest retried in the background", path.resolve(), len(owed),
                        len(owed) - len(left))
        await self.drain()  # the lines paid are gone before the next worker reads the file

    def _hold(self, entries: Sequence[Entry]) -> None:
        if entries:
            self._unconfirmed = list(entries)
            self._unconfirmed_keys = {op.key for _owner, _token, op in entries}
            log.warning("settle journal %s: %d settle(s) owed under a store identity that may "
                        "be this store's: paid once the store answers; their keys are not "
                        "reserved until then", self.path, len(entries))

    async def _confirm(self) -> list[Owed] | None:
        """Ask the store's identity; None when it does not answer, else the held lines that
        are owed to it (each taken once: the caller applies them; the others are let go)."""
        store_id = await self._ask_identity()
        if store_id is None:
            return None
        taken, self._unconfirmed, self._unconfirmed_keys = self._unconfirmed, [], set()
        mine = self._identity_name(store_id)
        return _unique((token, op) for owner, token, op in taken if owner == mine)

    async def _confirm_until_known(self, core: OwesSettles) -> None:
        """Ask the store's identity again, every 0.2 s doubling to 2 s, until it answers;
        then pay the held lines owed to it."""
        wait_s = CONFIRM_FIRST_S
        while True:
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, CONFIRM_MAX_S)
            found = await self._confirm()
            if found is None:
                continue
            log.info("the store answered: settles are journaled under its identity")
            if found:
                left = await core.pay_owed(found)
                log.warning("settle journal %s: the store answered; %d settle(s) owed under "
                            "its identity, %d landed now, the rest retried in the background",
                            self.path, len(found), len(found) - len(left))
            return

    async def unpaid(self, keys: Sequence[str]) -> list[Owed]:
        """See :meth:`relay.core.interfaces.SettleLog.unpaid`: [] at once unless a held line
        touches ``keys``; then the store's identity is asked, and every held line owed to it
        is returned. Raises :class:`StoreError` (op ``identity``) when it does not answer."""
        if not self._unconfirmed_keys or self._unconfirmed_keys.isdisjoint(keys):
            return []
        found = await self._confirm()
        if found is None:
            raise StoreError("identity", "the store does not answer, and a settle an earlier "
                             "run owed on this key may be its own: not reserved before it is "
                             "applied")
        return found

    async def owe(self, owed: Sequence[Owed]) -> bool:
        """See :meth:`relay.core.interfaces.SettleLog.owe`: appended and fsynced under this
        store's name. Never raises."""
        if self._changes is None:
            return False
        owner = self.names()[0]
        try:
            await self._changes.append([(owner, token, op) for token, op in owed])
        except OSError as exc:
            self._unsaved |= {_key(o) for o in owed}
            log.error("cannot write %d owed settle(s) to the settle journal %s (%s): kept in "
                      "memory only", len(owed), self.path, exc)
            return False
        return True

    def landed(self, paid: Sequence[Owed]) -> None:
        """See :meth:`relay.core.interfaces.SettleLog.landed`: dropped from the file by the
        next change this process makes (at once when none runs)."""
        self._unsaved -= {_key(o) for o in paid}
        if self._changes is not None:
            self._changes.drop(idents(paid, self.names()))

    async def drain(self) -> None:
        """Wait until the changes asked for so far are made."""
        if self._changes is not None:
            await self._changes.drain()

    async def write(self, core: OwesSettles) -> None:
        """At this process's stop: stop ``core``'s background settle retries (what they owe
        stays in the file for the next start), write what could not be written when it was
        owed, and wait for the file's changes. Logs; never raises."""
        if self._confirming is not None:
            self._confirming.cancel()
            await asyncio.gather(self._confirming, return_exceptions=True)
        for task in list(core.background):
            task.cancel()
        await asyncio.gather(*core.background, return_exceptions=True)
        owed, path = core.owed_settles(), self.path
        if owed and path is None:
            log.error("%d settle(s) still owed at exit and settle_journal is off: those "
                      "records read as in doubt after their lease", len(owed))
        elif owed and path is not None:
            unsaved = [o for o in owed if _key(o) in self._unsaved]
            if unsaved and await self.owe(unsaved):
                self._unsaved -= {_key(o) for o in unsaved}
            log.error("%d settle(s) still owed at exit: in %s for the next start", len(owed),
                      path.resolve())
        await self.drain()


class _Changes:
    """One process's changes to the journal file at ``path``, made one at a time in a task of
    their own, in the order asked: the appends queued meanwhile in one write and one fsync,
    the drops queued meanwhile in one rewrite (after those appends)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._adds: list[tuple[list[Entry], asyncio.Future[None]]] = []
        self._drops: set[Ident] = set()
        self._task: asyncio.Task[None] | None = None

    async def append(self, entries: list[Entry]) -> None:
        """Append ``entries``; returns once they are on disk. Raises :class:`OSError`."""
        done = asyncio.get_running_loop().create_future()
        self._adds.append((entries, done))
        self._start()
        await done

    def drop(self, gone: set[Ident]) -> None:
        """Drop the lines ``gone`` (after every append asked for before)."""
        self._drops |= gone
        self._start()

    async def drain(self) -> None:
        """Wait until every change asked for so far is made."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while self._adds or self._drops:
            adds, self._adds = self._adds, []
            drops, self._drops = self._drops, set()
            entries = [entry for batch, _done in adds for entry in batch]
            try:
                await asyncio.to_thread(change_journal, self._path, entries, drops)
            except OSError as exc:
                for _batch, done in adds:
                    if not done.done():
                        done.set_exception(exc)
                if drops:
                    log.warning("cannot drop %d landed settle(s) from %s (%s): the next start "
                                "applies them again, which changes nothing", len(drops),
                                self._path, exc)
            else:
                for _batch, done in adds:
                    if not done.done():
                        done.set_result(None)


def _key(owed: Owed) -> tuple[str, str, str]:
    token, op = owed
    return token, op.key, op.action.value


def _unique(owed: Iterable[Owed]) -> list[Owed]:
    """``owed`` (an iterable of ``(token, op)``) with each (token, key, action) once."""
    seen: dict[tuple[str, str, str], Owed] = {}
    for item in owed:
        seen.setdefault(_key(item), item)
    return list(seen.values())
