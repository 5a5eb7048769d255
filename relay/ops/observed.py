"""The dedup core with its ports observed: each store reserve and upstream transaction timed
(:mod:`relay.ops.measured`) and, when tracing is on, the spans of a message
(:mod:`relay.ops.traced`). The composition root builds the core here, and so do the tests that
measure it."""

from __future__ import annotations

from collections.abc import Sequence

from relay.core.dedup import DedupCore
from relay.core.gates import Gates
from relay.core.interfaces import FingerprintStore, Metrics, SettleLog, Upstream
from relay.core.message import DecisionObserver, MessageCore
from relay.core.policy import Policy
from relay.core.settlement import Settler
from relay.core.tracing import Tracer
from relay.ops.measured import MeasuredStore, MeasuredUpstream
from relay.ops.traced import TracedCore, TracedSettler, TracedStore, TracedUpstream


def observed_core(*, store: FingerprintStore, upstream: Upstream, metrics: Metrics,
                  policy: Policy, tracer: Tracer | None = None, gates: Gates | None = None,
                  observers: Sequence[DecisionObserver] = (),
                  journal: SettleLog | None = None) -> tuple[DedupCore, MessageCore]:
    """The core over ``store`` and ``upstream`` (its settles owed kept in ``journal``; None:
    in memory only), and what the listener hands each message to: the core itself, or with a
    ``tracer`` (None: tracing off) the core in its span. A rate limiter in ``gates`` is timed
    by its builder (:class:`relay.ops.measured.MeasuredLimiter`)."""
    measured_store = MeasuredStore(store, metrics)
    measured_upstream = MeasuredUpstream(upstream, metrics)
    if tracer is None:
        core = DedupCore(store=measured_store, upstream=measured_upstream, metrics=metrics,
                         policy=policy, gates=gates, observers=observers,
                         settler=Settler(store=store, metrics=metrics, window_s=policy.window_s,
                                         lease_s=policy.lease_s, journal=journal))
        return core, core
    core = DedupCore(store=TracedStore(measured_store, tracer),
                     upstream=TracedUpstream(measured_upstream, tracer), metrics=metrics,
                     policy=policy, gates=gates, observers=observers,
                     settler=TracedSettler(tracer, store=store, metrics=metrics,
                                           window_s=policy.window_s, lease_s=policy.lease_s,
                                           journal=journal))
    return core, TracedCore(core, tracer)
