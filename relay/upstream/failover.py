"""Several upstreams in a fixed order, failing over only where no duplicate can come of it.

:class:`FailoverUpstream` implements :class:`relay.core.interfaces.Upstream` over N named
upstreams (:class:`relay.upstream.smtp.SmtpUpstream`, or one Maildir). A message goes to the
first upstream that is not cooling down; it moves on to the next one only when the result
says ``failover`` (:attr:`relay.core.interfaces.DeliveryResult.failover`: the transaction
failed definitely before any recipient was accepted and before DATA: connect refused or timed
out, greeting, EHLO, TLS or AUTH failure, 421, a 4yz to MAIL). Never after a recipient was
accepted, never once the before-dot hook ran, never after the final dot: the upstream that got
that far decides the attempt, as a single upstream does (docs/design.md §5.4).

An upstream that failed cools down for ``cooldown_s`` seconds, doubling with each consecutive
failure up to ``cooldown_max_s``; a background probe (connect, EHLO, QUIT:
:meth:`SmtpUpstream.ping`) at the end of the cool-down brings it back, a failed one starts the
next, longer cool-down. A delivery that did not fail over resets it. When every upstream cools
down, each is tried in turn anyway, the one whose cool-down ends first first. A single
upstream never cools down: it is always tried, its state is its last readiness probe's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    OutboundMessage,
    RcptStatus,
    Upstream,
)

log = logging.getLogger("relay.upstream.failover")

READY = "ready"
COOLING = "cooling down"
DOWN = "down"


class FailoverMetrics(Protocol):
    """What the failover reports (implemented by :class:`relay.ops.metrics.PrometheusMetrics`)."""

    def upstream_up(self, upstream: str, up: bool) -> None:
        """Set ``relay_upstream_up{upstream}``: 1 ready, 0 cooling down or down."""
        ...

    def failover(self, from_upstream: str) -> None:
        """Count one message moved on from ``from_upstream`` to the next upstream."""
        ...


@dataclass(frozen=True)
class UpstreamState:
    """One upstream as ``/readyz`` shows it: ``state`` is ``ready``, ``cooling down`` or
    ``down``; ``until`` the unix time in seconds its cool-down ends (``cooling down`` only);
    ``failures`` the consecutive failures; ``error`` the last one's text."""

    state: str
    until: float | None = None
    failures: int = 0
    error: str | None = None


@dataclass
class _Member:
    name: str
    upstream: Upstream
    failures: int = 0
    until: float | None = None  # monotonic end of the cool-down; None: not cooling
    ready: bool = True
    error: str | None = None
    probe: asyncio.Task[None] | None = None
    counted_at: float | None = None  # monotonic time its last failure was counted


class FailoverUpstream:
    """Ordered upstreams with failover and cool-down; see the module doc.

    ``upstreams``: ``(name, upstream)`` pairs in the order they are tried (names unique).
    ``cooldown_s`` / ``cooldown_max_s``: seconds; ``probe_timeout_s`` bounds a recovery probe
    (as long as a delivery's connect may take); ``readiness_timeout_s`` bounds each upstream's
    share of a readiness probe (:meth:`ping`: one slower than it is not counted ready for that
    round, and not cooled down either).
    ``clock``: monotonic seconds (tests). Raises ``ValueError`` for no upstream or a name twice.
    """

    def __init__(self, upstreams: Sequence[tuple[str, Upstream]], *, cooldown_s: float = 30.0,
                 cooldown_max_s: float = 600.0, probe_timeout_s: float = 5.0,
                 readiness_timeout_s: float | None = None,
                 metrics: FailoverMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        names = [name for name, _ in upstreams]
        if not names:
            raise ValueError("at least one upstream is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"upstream names must be unique, got {names}")
        self._members = [_Member(name, upstream) for name, upstream in upstreams]
        self._cooldown_s = cooldown_s
        self._cooldown_max_s = max(cooldown_max_s, cooldown_s)
        self._probe_timeout_s = probe_timeout_s
        self._readiness_timeout_s = (probe_timeout_s if readiness_timeout_s is None
                                     else min(readiness_timeout_s, probe_timeout_s))
        self._metrics = metrics
        self._clock = clock
        self._closed = False
        for member in self._members:
            self._report(member)

    @property
    def names(self) -> list[str]:
        """The configured names, in order."""
        return [m.name for m in self._members]

    def preferred_name(self) -> str:
        """The upstream the next message is tried on first: the first not cooling down, else
        the one whose cool-down ends first (the rate limiter's ``upstream`` scope)."""
        return self._order()[0].name

    def states(self) -> dict[str, UpstreamState]:
        """Each upstream's state by name, in order (``/readyz``)."""
        now, wall = self._clock(), time.time()
        result = {}
        for m in self._members:
            if m.until is not None and m.until > now:
                result[m.name] = UpstreamState(COOLING, wall + (m.until - now), m.failures,
                                               m.error)
            elif m.ready:
                result[m.name] = UpstreamState(READY, None, m.failures, m.error)
            else:
                result[m.name] = UpstreamState(DOWN, None, m.failures, m.error)
        return result

    def _cooling(self, member: _Member, now: float) -> bool:
        return len(self._members) > 1 and (
            (member.until is not None and member.until > now) or not member.ready)

    def _order(self) -> list[_Member]:
        """The upstreams to try, in order: those not cooling down (nor down); when none is
        left, every one, the one whose cool-down ends first first (one may have come back
        before its probe saw it: mail is never refused while one takes it; each failure is
        before anything was sent, so trying the next risks no duplicate)."""
        now = self._clock()
        usable = [m for m in self._members if not self._cooling(m, now)]
        if usable:
            return usable
        return sorted(self._members, key=lambda m: m.until if m.until is not None else now)

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        """Deliver through the first usable upstream; move on to the next one only when the
        result says ``failover`` and nothing of the transaction went further (no recipient
        accepted, the before-dot hook not run, no dot written). Returns the result of the
        last upstream tried, named (``upstream``)."""
        progress = progress if progress is not None else DeliveryProgress()
        hooked = False
        hook = progress.before_dot
        if hook is not None:
            inner = hook

            async def marked(accepted: Sequence[str]) -> bool:
                nonlocal hooked
                hooked = True
                return await inner(accepted)

            progress.before_dot = marked
        order = self._order()
        try:
            for index, member in enumerate(order):
                began = self._clock()
                forced = self._cooling(member, began)  # every upstream cools down
                result = await member.upstream.deliver(message, progress)
                if result.upstream != member.name:
                    result = dataclasses.replace(result, upstream=member.name)
                moved_on = result.failover and not hooked and not progress.dot_written and all(
                    r.status is RcptStatus.REFUSED for r in result.recipients.values())
                if not result.failover:
                    self._succeeded(member)
                    return result
                if not moved_on:  # said failover although it went further: it stands
                    return result
                self._failed(member, _why(result), again=forced, began=began)
                if index + 1 < len(order):
                    log.warning("upstream %s failed before any recipient was accepted (%s): "
                                "trying %s", member.name, _why(result), order[index + 1].name)
                    if self._metrics is not None:
                        self._metrics.failover(member.name)
                    continue
                return result
        finally:
            progress.before_dot = hook
        raise AssertionError("unreachable: the last upstream's result is returned")

    def _succeeded(self, member: _Member) -> None:
        """A transaction (or probe) that reached the upstream: it is ready again."""
        if member.ready and member.until is None and member.error is None:
            return  # the common case, per message: nothing changes, nothing is written
        if member.failures or member.until is not None or not member.ready:
            log.warning("upstream %s answers again: ready", member.name)
        member.failures, member.until, member.ready, member.error = 0, None, True, None
        probe = member.probe
        if probe is not None and probe is not asyncio.current_task():
            probe.cancel()
            member.probe = None
        self._report(member)

    def _failed(self, member: _Member, error: str, *, again: bool = True,
                began: float | None = None) -> None:
        """A definite failure: start the cool-down (or, ``again``, the next, longer one: a
        failed probe, or a try while it cooled down), and the probe at its end. A failure of
        a transaction begun (``began``, monotonic) before another failure was counted (one of
        many messages at once, forced onto it or not) adds nothing. A single upstream keeps no
        cool-down (it is always tried): only its state changes."""
        member.error = error
        if len(self._members) == 1:
            member.ready = False
            self._report(member)
            return
        if began is not None and member.counted_at is not None and member.counted_at >= began:
            return  # counted while this transaction ran: the same outage, once
        if not again and member.until is not None and member.until > self._clock():
            return  # already cooling down: the same outage, counted once
        member.counted_at = self._clock()
        member.failures += 1
        cooldown = min(self._cooldown_s * 2 ** (member.failures - 1), self._cooldown_max_s)
        member.until = self._clock() + cooldown
        member.ready = False
        log.warning("upstream %s cools down for %g s (failure %d: %s)", member.name, cooldown,
                    member.failures, error)
        self._report(member)
        if member.probe is None and not self._closed:
            member.probe = asyncio.create_task(self._recover(member),
                                               name=f"upstream-probe-{member.name}")

    async def _recover(self, member: _Member) -> None:
        """Probe ``member`` at the end of each cool-down until it answers (a delivery that
        reaches it meanwhile ends this)."""
        try:
            while member.until is not None:
                wait_s = member.until - self._clock()
                if wait_s > 0:  # lengthened meanwhile: wait for the new end
                    await asyncio.sleep(wait_s)
                    continue
                error = await self._probe(member)
                if error is None:
                    self._succeeded(member)
                    return
                self._failed(member, error)  # the next, longer cool-down; this probe goes on
        finally:
            if member.probe is asyncio.current_task():
                member.probe = None

    async def _probe(self, member: _Member, timeout_s: float | None = None) -> str | None:
        """Ping ``member`` within ``timeout_s`` (default the probe timeout): None when it
        answered, else why not. Raises TimeoutError when ``timeout_s`` is given and passes
        (a slow upstream, not a failed one)."""
        try:
            async with asyncio.timeout(self._probe_timeout_s if timeout_s is None
                                       else timeout_s):
                await member.upstream.ping()
        except TimeoutError:
            if timeout_s is not None:
                raise
            return "TimeoutError: no answer within the probe timeout"
        except Exception as exc:  # any failure: not ready, reported
            return f"{type(exc).__name__}: {exc}"[:300]
        return None

    async def _readiness_probe(self, member: _Member) -> str | None:
        """:meth:`_probe` within the readiness share: ``_SLOW`` when it did not answer in
        time (no verdict: a delivery waits longer)."""
        try:
            return await self._probe(member, self._readiness_timeout_s)
        except TimeoutError:
            return _SLOW

    def _report(self, member: _Member) -> None:
        if self._metrics is not None:
            self._metrics.upstream_up(member.name, member.ready)

    async def ping(self) -> None:
        """The readiness probe: ping every upstream that is not cooling down, concurrently,
        each within the readiness share; one that refuses or fails starts cooling down (a
        single one is marked down); one slower than the share gets no verdict (a delivery
        waits up to the connect timeout). Raises :class:`ConnectionError` unless some upstream
        answered now, or is ready and was not probed (a recovery probe runs)."""
        now = self._clock()
        members = [m for m in self._members
                   if len(self._members) == 1 or m.until is None or m.until <= now]
        members = [m for m in members if m.probe is None]  # a recovery probe is under way
        errors = await asyncio.gather(*(self._readiness_probe(m) for m in members))
        answered = False
        for member, error in zip(members, errors, strict=True):
            if error is None:
                answered = True
                if len(self._members) == 1 or member.until is None:
                    self._succeeded(member)
            elif error is not _SLOW:  # a delivery may have found it down meanwhile: the same
                self._failed(member, error, again=False)  # outage
        probed = {m.name for m in members}
        states = self.states()
        if not answered and not any(s.state == READY and name not in probed
                                    for name, s in states.items()):
            raise ConnectionError("no upstream answered: " + "; ".join(
                f"{name} {s.state}" + (" (slower than the readiness probe)"
                                        if name in probed and s.state == READY else
                                        f" ({s.error})" if s.error else "")
                for name, s in states.items()))

    async def close(self) -> None:
        """Stop the probes and close every upstream."""
        self._closed = True
        probes = [m.probe for m in self._members if m.probe is not None]
        for probe in probes:
            probe.cancel()
        for probe in probes:
            with contextlib.suppress(asyncio.CancelledError):
                await probe
        for member in self._members:
            await member.upstream.close()


_SLOW = "slow"  # a readiness probe's share passed without an answer (no verdict)


def _why(result: DeliveryResult) -> str:
    """The reply that failed ``result`` (the first recipient's), for logs."""
    for rcpt in result.recipients.values():
        return str(rcpt.reply)
    return "no recipient"


__all__ = ["COOLING", "DOWN", "READY", "FailoverMetrics", "FailoverUpstream", "UpstreamState"]
