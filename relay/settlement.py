"""Settling reservations after the upstream answered (DESIGN sections 3 and 4).

:class:`Settler` writes SENT / UNKNOWN / release for one attempt's keys in one store round
trip, retries briefly, and when the store still fails keeps retrying the SENT and UNKNOWN
marks in the background until the lease ends (a mark that never lands would let a retry send
again once the lease lapses). It also undoes a reserve that landed but reported a failure, and
settles a transaction that shutdown cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from relay.errors import StoreError
from relay.interfaces import FingerprintStore, Metrics, Settle, SettleOp

log = logging.getLogger("relay.settlement")


class Settler:
    """Settles one attempt's reservations; ``window_s`` is the dedup window in seconds."""

    def __init__(self, *, store: FingerprintStore, metrics: Metrics, window_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._metrics = metrics
        self._window_s = window_s
        self._clock = clock
        self.background: set[asyncio.Task[None]] = set()

    async def settle(self, ops: list[SettleOp], token: str, lease_ends: float) -> None:
        """Apply ``ops`` (one round trip, 3 quick tries), else keep trying in the background.

        ``lease_ends`` is the ``time.monotonic()`` at which the reservations lapse. Never
        raises: the client's reply depends on the upstream's verdict, not on this write.
        """
        applied = await self._settle_with_retry(ops, token)
        if applied is None:
            self._settle_later(ops, token, lease_ends)
            return
        for op, ok in zip(ops, applied, strict=True):
            if not ok:
                log.warning("settle %s found another attempt's reservation (lease ran out?)",
                            op.action.value)

    def sending_marker(self, first_rcpt: Mapping[str, str],
                       token: str) -> Callable[[Sequence[str]], Awaitable[bool]]:
        """The ``before_dot`` hook: mark the keys of the accepted recipients SENDING.

        ``first_rcpt`` maps store key -> the recipient sent upstream for it. The hook returns
        False (abort, send no dot) when the store fails or a key is no longer this attempt's.
        """

        async def mark(accepted: Sequence[str]) -> bool:
            wanted = set(accepted)
            ops = [SettleOp(key=k, action=Settle.SENDING)
                   for k, rcpt in first_rcpt.items() if rcpt in wanted]
            try:
                applied = await self._timed_settle(ops, token)
            except StoreError as exc:
                log.error("cannot mark SENDING before the final dot (%s): not sending", exc)
                return False
            if not all(applied):
                log.error("a reservation is no longer ours before the final dot: not sending")
            return all(applied)

        return mark

    async def _timed_settle(self, ops: list[SettleOp], token: str) -> list[bool]:
        """One settle round trip, its latency and outcome recorded; raises StoreError."""
        started = time.perf_counter()
        try:
            applied = await self._store.settle(ops, token=token, window_s=self._window_s,
                                               now=self._clock())
        except StoreError:
            self._metrics.store_call("settle", time.perf_counter() - started, False)
            raise
        self._metrics.store_call("settle", time.perf_counter() - started, True)
        return applied

    async def release_quietly(self, keys: list[str], token: str) -> None:
        """Undo whatever part of a failed reserve did land (compare-token, so always safe).

        A reserve that timed out may still have run on the server; without this its keys
        would answer every retry with 450 until the lease ends.
        """
        ops = [SettleOp(key=k, action=Settle.RELEASE) for k in keys]
        with contextlib.suppress(StoreError):  # the store is down: the lease will free them
            await self._store.settle(ops, token=token, window_s=self._window_s,
                                     now=self._clock())

    async def settle_cut(self, keys: list[str], token: str, dot_written: bool) -> None:
        """Settle a transaction that was cancelled (shutdown past its grace).

        Before the final dot went out nothing can have been delivered: release, so the
        client's retry is relayed. After it, the outcome is unknown: mark UNKNOWN.
        Shielded from a second cancellation; bounded by the store's own timeout.
        """
        action = Settle.UNKNOWN if dot_written else Settle.RELEASE
        ops = [SettleOp(key=k, action=action) for k in keys]
        log.warning("transaction cut by shutdown %s the final dot: %s", "after" if dot_written
                    else "before", "marked UNKNOWN" if dot_written else "released")
        with contextlib.suppress(StoreError):
            await asyncio.shield(self._store.settle(
                ops, token=token, window_s=self._window_s, now=self._clock()))

    def _settle_later(self, ops: list[SettleOp], token: str, lease_ends: float) -> None:
        """Keep trying SENT/UNKNOWN marks in the background until the lease ends.

        While the mark is missing the key stays PENDING (retries get 450). This is more than
        DESIGN's "retry the write briefly": a mark lost for good would let a retry send again
        once the lease lapses. Releases are retried too: a key already marked SENDING would not
        lapse with the lease but turn UNKNOWN.
        """
        marks = list(ops)
        log.error("settle failed; retrying %d mark(s) in the background until the lease ends",
                  len(marks))
        task = asyncio.create_task(self._keep_settling(marks, token, lease_ends))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _keep_settling(self, ops: list[SettleOp], token: str, lease_ends: float) -> None:
        attempts = 0
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_delay(max(0.0, lease_ends - time.monotonic() - 1.0)),
                wait=wait_exponential(multiplier=0.2, max=5.0),
                retry=retry_if_exception_type(StoreError),
                reraise=True,
            ):
                with attempt:
                    attempts += 1
                    await self._store.settle(ops, token=token, window_s=self._window_s,
                                             now=self._clock())
        except StoreError:
            if any(op.action is Settle.SENT for op in ops):
                self._metrics.mark_sent_failed()
            log.error("settle never landed before the lease ended: a retry may be sent again")
        else:
            log.warning("settle landed after %d background attempt(s)", attempts)

    async def _settle_with_retry(self, ops: list[SettleOp], token: str) -> list[bool] | None:
        """Settle in one round trip, retried briefly (3 tries, 0.1-1 s apart); None on failure."""
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(3),
                wait=wait_exponential(multiplier=0.1, max=1.0),
                retry=retry_if_exception_type(StoreError),
                reraise=True,
            ):
                with attempt:
                    return await self._timed_settle(ops, token)
        except StoreError as exc:
            log.error("settle failed: %s", exc)
        return None
