"""The settles a SQLite store's waiters hear (design.md §4.8): this process's own settles at
once (:meth:`SqliteSettles.announce`, called by the store's settle path), and those of another
process on the same file by one re-read of every waited-for key each :data:`REREAD_S`
seconds, shared by all the process's waiters (SQLite tells no other process of a write).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager

from relay.core.errors import StoreError
from relay.core.interfaces import Record, SettleWatch, State
from relay.store.settled import KeyWaiters

log = logging.getLogger("relay.store.sqlite")

REREAD_S = 1.0
"""Seconds between two re-reads of the keys this process waits for (one batch of point reads
by primary key, however many messages wait for them)."""

# what a record another process settled reads as: no longer held by an attempt
_SETTLED = frozenset({State.ABSENT, State.SENT, State.UNKNOWN})

ReadKeys = Callable[[list[str]], Awaitable[list[Record]]]


class SqliteSettles:
    """The waiters of one store; ``read`` reads the records of some keys in one call."""

    def __init__(self, read: ReadKeys, reread_s: float = REREAD_S) -> None:
        self._read = read
        self._reread_s = reread_s
        self._rereader: asyncio.Task[None] | None = None
        self.waiters = KeyWaiters(subscribe=self._subscribe)

    def watching(self, keys: Sequence[str]) -> AbstractAsyncContextManager[SettleWatch]:
        """:meth:`relay.core.interfaces.FingerprintStore.watch_settles`."""
        return self.waiters.watching(keys)

    def announce(self, keys: Iterable[str]) -> None:
        """This process settled ``keys``: wake their waiters."""
        for key in keys:
            self.waiters.notify(key)

    async def _subscribe(self, keys: list[str]) -> None:
        del keys  # the re-reader reads every waited-for key
        if self._rereader is None or self._rereader.done():
            self._rereader = asyncio.ensure_future(self._reread())

    async def _reread(self) -> None:
        """While some key is waited for: every ``reread_s`` seconds, read them all once and
        wake the waiters of those no attempt holds any more."""
        while keys := self.waiters.keys:
            await asyncio.sleep(self._reread_s)
            keys = self.waiters.keys
            if not keys:
                return
            try:
                records = await self._read(keys)
            except StoreError as exc:
                log.warning("re-reading the keys waited for failed: %s", exc)
                continue
            self.announce(k for k, r in zip(keys, records, strict=True) if r.state in _SETTLED)

    async def close(self) -> None:
        """Stop re-reading. Never raises."""
        if self._rereader is not None:
            self._rereader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._rereader
