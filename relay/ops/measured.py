"""The timing of the core's store and upstream calls (design.md §6.2): wrappers around its
ports (:mod:`relay.ops.ports`) that observe each call's seconds in the metrics
(``relay_store_seconds{op}``, ``relay_store_errors_total{op}``, ``relay_upstream_seconds``),
built by the composition root. A settle and a lease renewal are timed by the
:class:`relay.core.settlement.Settler`, which knows which of its writes count (its quick tries
and renewals, not a quiet release or a background retry)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from relay.core.errors import StoreError
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    FingerprintStore,
    LimitCheck,
    LimitVerdict,
    Metrics,
    OutboundMessage,
    RateLimiter,
    Reservation,
    Upstream,
)
from relay.ops.ports import StoreWrapper, UpstreamWrapper, reply_code


class MeasuredStore(StoreWrapper):
    """``inner`` with each reserve timed under ``op="reserve"`` (a :class:`StoreError`
    counted as an error, then raised)."""

    def __init__(self, inner: FingerprintStore, metrics: Metrics) -> None:
        super().__init__(inner)
        self._metrics = metrics

    async def reserve(self, keys: Sequence[str], *, token: str, lease_s: float,
                      resend_unknown: bool = False, content_digest: str = "",
                      replace_other_content: bool = False) -> list[Reservation]:
        started = time.perf_counter()
        try:
            out = await self.inner.reserve(keys, token=token, lease_s=lease_s,
                                           resend_unknown=resend_unknown,
                                           content_digest=content_digest,
                                           replace_other_content=replace_other_content)
        except StoreError:
            self._metrics.store_call("reserve", time.perf_counter() - started, False)
            raise
        self._metrics.store_call("reserve", time.perf_counter() - started, True)
        return out


class MeasuredLimiter:
    """A :class:`RateLimiter` whose round trips are timed under ``op="rate_limit"``."""

    def __init__(self, inner: RateLimiter, metrics: Metrics) -> None:
        self.inner = inner
        self._metrics = metrics

    async def acquire(self, checks: Sequence[LimitCheck]) -> LimitVerdict:
        started = time.perf_counter()
        try:
            verdict = await self.inner.acquire(checks)
        except StoreError:
            self._metrics.store_call("rate_limit", time.perf_counter() - started, False)
            raise
        self._metrics.store_call("rate_limit", time.perf_counter() - started, True)
        return verdict


class MeasuredUpstream(UpstreamWrapper):
    """``inner`` with each transaction timed, with its deciding reply code and the upstream
    that gave it (:meth:`relay.core.interfaces.Metrics.upstream_call`)."""

    def __init__(self, inner: Upstream, metrics: Metrics) -> None:
        super().__init__(inner)
        self._metrics = metrics

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        started = time.perf_counter()
        result = await self.inner.deliver(message, progress)
        self._metrics.upstream_call(time.perf_counter() - started, reply_code(result),
                                    result.upstream)
        return result
