"""Settling reservations after the upstream answered (docs/design.md §3, §4.2).

:class:`Settler` writes SENT / UNKNOWN / release for one attempt's keys in one store round trip,
retries briefly, then keeps retrying in the background until the write lands; a settle owed so
is written to the settle journal (:class:`relay.core.interfaces.SettleLog`) before the client
is answered, and dropped from it once it lands. What is still owed on a key is applied first
when a later attempt reserves it (:meth:`Settler.flush`), so a retry never races the background
loop, and a reserve is refused rather than answered from a record whose settle is owed. It
also marks SENDING before the final dot, renews a working attempt's leases, undoes a reserve
that landed but reported a failure, and settles a transaction that shutdown cut short. Why
the retries outlive the lease: docs/design.md §7.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from relay.core import replies, rules
from relay.core.cancellation import run_to_end
from relay.core.errors import StoreError
from relay.core.interfaces import (
    DeliveryProgress,
    FingerprintStore,
    Metrics,
    Settle,
    SettleLog,
    SettleOp,
)

log = logging.getLogger("relay.core.settlement")



class Settler:
    """Settles one attempt's reservations; ``window_s`` is the dedup window and ``lease_s`` the
    reservation lease, in seconds. No time of this host's clock is ever written: the store
    records its own (design.md §3: clocks of relays sharing a store may disagree). ``journal``
    keeps what is owed across a crash (None: in memory only)."""

    def __init__(self, *, store: FingerprintStore, metrics: Metrics, window_s: float,
                 lease_s: float = 900.0, journal: SettleLog | None = None) -> None:
        self._store = store
        self._journal = journal
        self._metrics = metrics
        self._window_s = window_s
        self._lease_s = lease_s
        self.background: set[asyncio.Task[None]] = set()
        self._renewers: set[asyncio.Task[None]] = set()  # lease renewals of working attempts
        # (store key, token) -> the settle still owed on it, until it lands or is given up
        self._owed: dict[tuple[str, str], SettleOp] = {}

    async def flush(self, keys: Sequence[str]) -> None:
        """Apply now whatever settle is still owed on ``keys``, one try each.

        Called before a reserve reads ``keys``: the retry of a message whose release (or SENT
        mark) is still owed must see the settled state, not the SENDING record that reads as
        UNKNOWN past the lease. Settles an earlier run journaled that this process does not
        hold yet are taken from the journal first. Raises :class:`StoreError` when an owed
        settle on ``keys`` cannot be applied now: the caller answers as for a failed reserve
        (design.md §3), never from the record the settle would change.
        """
        if self._journal is not None:
            found = await self._journal.unpaid(keys)
            for token, ops in _by_token(found).items():  # on disk already: owed from now on
                self._hold(ops, token)
                self._retry_later(ops, token, time.monotonic())
        wanted = set(keys)
        owed = [(token, op) for (key, token), op in self._owed.items() if key in wanted]
        for token, ops in _by_token(owed).items():
            await self._timed_settle(ops, token)
            self._paid(ops, token)
            log.warning("settle owed on %d key(s) landed before a retry's reserve", len(ops))

    def owed(self) -> list[tuple[str, SettleOp]]:
        """Every settle still owed, as ``(token, op)``: what shutdown writes to the journal."""
        return [(token, op) for (_key, token), op in self._owed.items()]

    async def pay(self, owed: Sequence[tuple[str, SettleOp]]) -> list[tuple[str, SettleOp]]:
        """Apply settles owed by an earlier run (the journal: they are on disk), one round
        trip per token; what does not land now is retried in the background like any owed
        settle. All are owed from the call on, so a reserve meanwhile applies them first.
        Returns what did not land. Never raises."""
        grouped = _by_token(owed)
        for token, ops in grouped.items():
            self._hold(ops, token)
        left: list[tuple[str, SettleOp]] = []
        for token, ops in grouped.items():
            try:
                await self._timed_settle(ops, token)
            except StoreError:
                left.extend((token, op) for op in ops)
                self._retry_later(ops, token, time.monotonic())
            else:
                self._paid(ops, token)
        return left

    def _window(self, ops: Sequence[SettleOp]) -> float:
        """The dedup window (seconds) of ``ops``: their message policy's (the ops of one
        attempt share it), else the relay's."""
        return max((op.window_s for op in ops), default=0.0) or self._window_s

    def _hold(self, ops: Sequence[SettleOp], token: str) -> None:
        """Count ``ops`` as owed (what :meth:`flush` applies before a reserve)."""
        for op in ops:
            self._owed[(op.key, token)] = op

    def _paid(self, ops: Sequence[SettleOp], token: str) -> None:
        """``ops`` landed or were given up: owed no more, and dropped from the journal."""
        gone = [op for op in ops if self._owed.pop((op.key, token), None) is not None]
        if gone and self._journal is not None:
            self._journal.landed([(token, op) for op in gone])

    async def settle(self, ops: list[SettleOp], token: str, lease_ends: float) -> None:
        """Apply ``ops`` (one round trip, 3 quick tries), else keep trying in the background.

        ``lease_ends`` is the ``time.monotonic()`` at which the reservations lapse. Never
        raises: the client's reply depends on the upstream's verdict, not on this write. A
        settle after a definite upstream reply is never cut short: when the caller is
        cancelled (shutdown past its grace) the write still runs to its end, and only then
        does the cancellation go on.
        """
        # not in ``background``: a shutdown cancels those, and this one must never be cut
        await run_to_end(asyncio.ensure_future(self._settle_or_owe(ops, token, lease_ends)))

    async def _settle_or_owe(self, ops: list[SettleOp], token: str, lease_ends: float) -> None:
        applied = await self._settle_with_retry(ops, token)
        if applied is None:
            log.error("settle failed; retrying %d write(s) in the background until they land",
                      len(ops))
            self._hold(ops, token)
            if self._journal is not None:  # on disk before the client's reply (design.md §3)
                await self._journal.owe([(token, op) for op in ops])
            self._retry_later(ops, token, lease_ends)
            return
        for op, ok in zip(ops, applied, strict=True):
            if not ok:
                log.warning("settle %s not applied: the key no longer holds this attempt's "
                            "reservation (its lease ran out, or a resent write had landed "
                            "already)", op.action.value)

    def sending_marker(self, first_rcpt: Mapping[str, str], token: str,
                       progress: DeliveryProgress, window_s: float = 0.0,
                       ) -> Callable[[Sequence[str]], Awaitable[bool]]:
        """The ``before_dot`` hook: mark the keys of the accepted recipients SENDING.

        ``first_rcpt`` maps store key -> the recipient sent upstream for it; ``window_s`` is
        the message policy's dedup window (0: the relay's), the SENDING record's TTL. The hook
        returns False (abort, send no dot) when the store fails, or when a key is no longer
        this attempt's; it then sets ``progress.abort_reply`` to the reply that says which.
        """

        async def mark(accepted: Sequence[str]) -> bool:
            wanted = set(accepted)
            ops = [SettleOp(key=k, action=Settle.SENDING, lease_s=self._lease_s,
                            window_s=window_s)
                   for k, rcpt in first_rcpt.items() if rcpt in wanted]
            if not ops:  # only unreserved shadow copies were accepted: nothing to mark
                return True
            try:
                applied = await self._timed_settle(ops, token)
            except StoreError as exc:
                log.error("cannot mark SENDING before the final dot (%s): not sending", exc)
                progress.abort_reply = replies.STORE_DOWN
                return False
            if not all(applied):
                log.error("a reservation is no longer ours before the final dot "
                          "(its lease lapsed): not sending")
                progress.abort_reply = replies.RESERVATION_LOST
            return all(applied)

        return mark

    @contextlib.asynccontextmanager
    async def kept_alive(self, keys: Sequence[str], token: str,
                         window_s: float = 0.0) -> AsyncIterator[None]:
        """Renew this attempt's reservations on ``keys`` every third of the lease while the
        body runs (compare-token, in the store's clock), so a transaction longer than the lease
        keeps its keys: PENDING does not expire under it and SENDING never reads as in doubt
        while its relay still waits for the upstream's reply; SENDING also lives at least
        ``window_s`` (the message's dedup window; 0: the relay's) past each heartbeat, so a
        transfer longer than the window never outlives its record. A failed renewal is logged
        and tried again at the next tick.

        On exit the renewer is told to stop and cancelled, and not waited for: a renewal still
        under way when the attempt settles changes nothing (it is compare-token, and the settle
        took the token's record away), and the attempt must never hang on its renewer.
        """
        stop = asyncio.Event()
        task = asyncio.create_task(
            self._renew_every(list(keys), token, self._lease_s / 3, stop,
                              window_s or self._window_s))
        self._renewers.add(task)
        task.add_done_callback(self._renewers.discard)
        try:
            yield
        finally:
            stop.set()
            task.cancel()

    async def _renew_every(self, keys: list[str], token: str, interval_s: float,
                           stop: asyncio.Event, window_s: float) -> None:
        """Renew ``keys`` every ``interval_s`` seconds until ``stop`` is set (checked after
        every await, so the loop ends even if its cancellation was lost)."""
        while keys:
            await asyncio.sleep(interval_s)
            if stop.is_set():
                return
            started = time.perf_counter()
            try:
                held = await self._store.renew(keys, token=token, lease_s=self._lease_s,
                                               window_s=window_s)
            except StoreError as exc:
                self._metrics.store_call("renew", time.perf_counter() - started, False)
                if not stop.is_set():
                    log.warning("cannot renew %d reservation(s) (%s): trying again in %.1f s",
                                len(keys), exc, interval_s)
                continue
            self._metrics.store_call("renew", time.perf_counter() - started, True)
            lost = [k for k, ok in zip(keys, held, strict=True) if not ok]
            if lost and not stop.is_set():
                log.error("%d reservation(s) no longer this attempt's while it works", len(lost))
            keys = [k for k in keys if k not in lost]

    async def _timed_settle(self, ops: list[SettleOp], token: str) -> list[bool]:
        """One settle round trip, its latency and outcome recorded; raises StoreError."""
        started = time.perf_counter()
        try:
            applied = await self._store.settle(ops, token=token, window_s=self._window(ops))
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
            await run_to_end(asyncio.ensure_future(
                self._store.settle(ops, token=token, window_s=self._window(ops))))

    async def settle_cut(self, keys: list[str], token: str, dot_written: bool,
                         lease_ends: float, window_s: float = 0.0) -> None:
        """Settle a transaction that was cancelled (shutdown past its grace).

        Before the final dot went out nothing can have been delivered: release, so the
        client's retry is relayed. After it, the outcome is unknown: mark UNKNOWN. Runs to its
        end whatever cancels the caller, and what does not land is owed like any settle.
        """
        action = rules.after_cut(dot_written).settle
        ops = [SettleOp(key=k, action=action, window_s=window_s) for k in keys]
        log.warning("transaction cut by shutdown %s the final dot: %s", "after" if dot_written
                    else "before", "marked UNKNOWN" if dot_written else "released")
        await self.settle(ops, token, lease_ends)

    def _retry_later(self, ops: list[SettleOp], token: str, lease_ends: float) -> None:
        """Keep trying ``ops`` (owed already) in the background until they land or the dedup
        window passes.

        While a SENT mark is missing the key stays PENDING (retries get 450) and, once it was
        marked SENDING, reads as UNKNOWN after the lease. This is more than the first contract's
        "retry the write briefly" (design.md §7): a mark lost for good would let a retry send
        again once the lease lapses, and a lost release would leave a SENDING record that
        suppresses the retry of a message that was never sent. The ops are compare-token
        writes, so landing late is always safe.
        """
        task = asyncio.create_task(self._keep_settling(ops, token, lease_ends))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _keep_settling(self, ops: list[SettleOp], token: str, lease_ends: float) -> None:
        """Retry what is still owed of ``ops`` until it lands (or a reserve's flush paid it).

        Counts ``mark_sent_failed`` once per fingerprint when its SENT mark is still owed at the
        lease's end (from
        then on a retry is answered as in doubt instead of with the original reply), or when it
        is given up (dedup window over, or shutdown cut the loop).
        """
        attempts = 0
        counted = False

        def owed() -> list[SettleOp]:
            return [op for op in ops if (op.key, token) in self._owed]

        def count_lost_mark() -> None:
            nonlocal counted
            marks = sum(1 for op in owed() if op.action is Settle.SENT)
            if not counted and marks:
                counted = True
                self._metrics.mark_sent_failed(marks)

        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_delay(self._window(ops)),
                wait=wait_exponential(multiplier=0.2, max=2.0),
                retry=retry_if_exception_type(StoreError),
                reraise=True,
            ):
                with attempt:
                    if time.monotonic() >= lease_ends:
                        count_lost_mark()
                    left = owed()
                    if not left:
                        return
                    attempts += 1
                    await self._store.settle(left, token=token, window_s=self._window(left))
                    self._paid(left, token)
        except StoreError:
            count_lost_mark()
            log.error("settle never landed within the dedup window: given up")
        except asyncio.CancelledError:
            count_lost_mark()
            log.error("settle still owed at shutdown: left in the settle journal")
            raise  # still owed, and in the journal since it was owed: the next start pays it
        else:
            log.warning("settle landed after %d background attempt(s)", attempts)
        self._paid(ops, token)

    async def _settle_with_retry(self, ops: list[SettleOp], token: str) -> list[bool] | None:
        """Settle in one round trip, retried briefly (3 tries, 0.1-1 s apart); None on failure.

        The first try runs outside the retry loop: a settle that lands (nearly all of them)
        builds no tenacity machinery."""
        with contextlib.suppress(StoreError):
            return await self._timed_settle(ops, token)
        try:
            await asyncio.sleep(0.1)
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(2),
                wait=wait_exponential(multiplier=0.2, max=1.0),
                retry=retry_if_exception_type(StoreError),
                reraise=True,
            ):
                with attempt:
                    return await self._timed_settle(ops, token)
        except StoreError as exc:
            log.error("settle failed: %s", exc)
        return None


def _by_token(owed: Sequence[tuple[str, SettleOp]]) -> dict[str, list[SettleOp]]:
    """``(token, op)`` pairs grouped by token: one store round trip per attempt."""
    grouped: dict[str, list[SettleOp]] = {}
    for token, op in owed:
        grouped.setdefault(token, []).append(op)
    return grouped
