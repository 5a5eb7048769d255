"""Waiting for another attempt that holds a key in flight (design.md §4.8, ``in_flight_wait``).

A recipient whose key another attempt holds (PENDING, or SENDING within its lease) waits,
after the final dot, until that attempt settles, at most ``in_flight_wait`` seconds; then the
core reserves the key again and answers from what it finds. The wait watches the store's
settles (:meth:`relay.core.interfaces.FingerprintStore.watch_settles`): it never polls the
store per waiting message. The order closes the race with a settle: watch first, then read
each record once, then wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from relay.core import rules
from relay.core.errors import StoreError
from relay.core.interfaces import FingerprintStore, SettleWatch, State

log = logging.getLogger("relay.core.waiting")


class InFlightWaits:
    """The waits of one core over ``store``; :meth:`stop` (a shutdown) ends them all."""

    def __init__(self, store: FingerprintStore) -> None:
        self._store = store
        self._stopping: asyncio.Event | None = None

    def _stop_event(self) -> asyncio.Event:
        if self._stopping is None:
            self._stopping = asyncio.Event()
        return self._stopping

    def stop(self) -> None:
        """End every wait now, and let no new one start (the relay is stopping)."""
        self._stop_event().set()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopping is not None and self._stopping.is_set()

    async def until_settled(self, keys: Sequence[str], *, lease_s: float,
                            bound_s: float) -> bool:
        """Return once none of ``keys`` is held by another attempt (True), or ``bound_s``
        seconds passed, or :meth:`stop` was called, or the store cannot watch or read (False;
        the caller's reserve then decides, without waiting again). ``lease_s`` (seconds)
        judges a SENDING record that names no lease. Cancellation is raised as usual."""
        if self.stopping or not keys:
            return False
        try:
            async with self._store.watch_settles(keys) as watch:
                records = await asyncio.gather(*(self._store.inspect(key) for key in keys))
                held = [key for key, record in zip(keys, records, strict=True)
                        if rules.reads_as(record, lease_s) is State.PENDING]
                return await self._wait(watch, held, bound_s)
        except StoreError as exc:
            log.warning("waiting for another attempt's settle failed (%s): deciding now", exc)
            return False

    async def _wait(self, watch: SettleWatch, held: list[str], bound_s: float) -> bool:
        """Wait for a settle of every key of ``held``, within ``bound_s`` seconds or until
        :meth:`stop`; True when every one settled."""
        if not held:
            return True
        settles: asyncio.Future[object] = asyncio.ensure_future(
            asyncio.gather(*(watch.settled(key) for key in held)))
        stopped: asyncio.Future[object] = asyncio.ensure_future(self._stop_event().wait())
        try:
            await asyncio.wait({settles, stopped}, timeout=bound_s,
                               return_when=asyncio.FIRST_COMPLETED)
            return settles.done() and not self.stopping
        finally:
            for waiting in (settles, stopped):
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
