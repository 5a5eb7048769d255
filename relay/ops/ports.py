"""Wrappers around the core's ports, as httpx wraps a transport: a wrapper is the port it wraps
(every call forwarded) with one call observed. :mod:`relay.ops.measured` times calls,
:mod:`relay.ops.traced` opens their spans; the composition root (:mod:`relay.app`) builds
them, so the core (:mod:`relay.core.dedup`) holds decisions only."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    FingerprintStore,
    OutboundMessage,
    Record,
    Reservation,
    SettleOp,
    SettleWatch,
    Upstream,
)


def reply_code(result: DeliveryResult) -> int | None:
    """The code that decided an upstream transaction: its final dot's reply, else the first
    reply from the upstream that refused a recipient; None when no reply came from it."""
    if result.final_reply is not None:
        return result.final_reply.code
    return next((r.reply.code for r in result.recipients.values() if r.from_upstream), None)


class StoreWrapper:
    """A :class:`FingerprintStore` that forwards every call to ``inner``; a subclass observes
    the calls it overrides."""

    def __init__(self, inner: FingerprintStore) -> None:
        self.inner = inner

    async def reserve(self, keys: Sequence[str], *, token: str, lease_s: float,
                      resend_unknown: bool = False, content_digest: str = "",
                      replace_other_content: bool = False) -> list[Reservation]:
        return await self.inner.reserve(keys, token=token, lease_s=lease_s,
                                        resend_unknown=resend_unknown,
                                        content_digest=content_digest,
                                        replace_other_content=replace_other_content)

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        return await self.inner.settle(ops, token=token, window_s=window_s)

    async def renew(self, keys: Sequence[str], *, token: str, lease_s: float,
                    window_s: float = 0.0) -> list[bool]:
        return await self.inner.renew(keys, token=token, lease_s=lease_s, window_s=window_s)

    async def inspect(self, key: str) -> Record:
        return await self.inner.inspect(key)

    async def inspect_many(self, keys: Sequence[str]) -> list[Record]:
        return await self.inner.inspect_many(keys)

    async def force_release(self, key: str, *, expected: Record | None = None) -> bool:
        return await self.inner.force_release(key, expected=expected)

    async def force_mark_sent(self, key: str, *, reply: str, window_s: float,
                              expected: Record | None = None) -> bool:
        return await self.inner.force_mark_sent(key, reply=reply, window_s=window_s,
                                                expected=expected)

    def watch_settles(self, keys: Sequence[str]) -> AbstractAsyncContextManager[SettleWatch]:
        return self.inner.watch_settles(keys)

    async def ping(self) -> None:
        await self.inner.ping()

    async def identity(self) -> str:
        return await self.inner.identity()

    async def close(self) -> None:
        await self.inner.close()


class UpstreamWrapper:
    """An :class:`Upstream` that forwards every call to ``inner``; a subclass observes the
    transactions (:meth:`deliver`)."""

    def __init__(self, inner: Upstream) -> None:
        self.inner = inner

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        return await self.inner.deliver(message, progress)

    async def ping(self) -> None:
        await self.inner.ping()

    async def close(self) -> None:
        await self.inner.close()
