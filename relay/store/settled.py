"""The waiters of one process for other attempts' settles, shared per store key (design.md
§4.8): however many messages wait for a key, the store is subscribed to it once.

A store keeps one :class:`KeyWaiters`; its settle path (or what the store hears of another
relay's settles) calls :meth:`KeyWaiters.notify`. ``subscribe`` / ``unsubscribe`` are the
store's: called with the keys that got their first waiter (awaited before the watch is
handed out, so a settle after that is never missed) and with those whose last waiter left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from relay.core.errors import StoreError
from relay.core.interfaces import SettleWatch

log = logging.getLogger("relay.store.settled")

KeysCall = Callable[[list[str]], Awaitable[None]]


async def _nothing(keys: list[str]) -> None:
    """A store that hears every settle in process subscribes to nothing."""


class _Watch:
    """One message's watch: the events of its keys as they were when it began."""

    def __init__(self, events: dict[str, asyncio.Event]) -> None:
        self._events = events

    async def settled(self, key: str) -> None:
        event = self._events.get(key)
        if event is None:  # not a watched key: nothing will tell
            await asyncio.Event().wait()
            return
        await event.wait()


class KeyWaiters:
    """Per store key: one event every waiter shares, set (and replaced) by :meth:`notify`,
    and how many wait; ``subscribe`` / ``unsubscribe`` as in the module's text."""

    def __init__(self, *, subscribe: KeysCall = _nothing, unsubscribe: KeysCall = _nothing
                 ) -> None:
        self._subscribe = subscribe
        self._unsubscribe = unsubscribe
        self._events: dict[str, asyncio.Event] = {}
        self._count: dict[str, int] = {}
        self._ready: dict[str, asyncio.Future[None]] = {}  # a key's subscription, confirmed

    @property
    def keys(self) -> list[str]:
        """The keys some message waits for now."""
        return list(self._count)

    def notify(self, key: str) -> None:
        """A settle of ``key`` was announced: wake its waiters (a later waiter gets a new
        event)."""
        event = self._events.get(key)
        if event is not None:
            event.set()
            self._events[key] = asyncio.Event()

    @contextlib.asynccontextmanager
    async def watching(self, keys: Sequence[str]) -> AsyncIterator[SettleWatch]:
        """Wait for ``keys``' settles inside the block; raises :class:`StoreError` when the
        subscription of a key does not succeed."""
        keys = list(dict.fromkeys(keys))
        first = [key for key in keys if key not in self._count]
        for key in keys:
            self._count[key] = self._count.get(key, 0) + 1
            self._events.setdefault(key, asyncio.Event())
        try:
            if first:
                subscribing = asyncio.ensure_future(self._subscribe(first))
                for key in first:
                    self._ready[key] = subscribing
            await asyncio.gather(*(asyncio.shield(self._ready[key]) for key in keys
                                   if key in self._ready))
            yield _Watch({key: self._events[key] for key in keys})
        finally:
            await self._leave(keys)

    async def _leave(self, keys: list[str]) -> None:
        gone = []
        for key in keys:
            self._count[key] -= 1
            if self._count[key] == 0:
                del self._count[key], self._events[key]
                self._ready.pop(key, None)
                gone.append(key)
        if gone:
            try:
                await self._unsubscribe(gone)
            except StoreError as exc:  # the subscription stays: a settle wakes nobody
                log.warning("could not stop watching %d key(s): %s", len(gone), exc)
