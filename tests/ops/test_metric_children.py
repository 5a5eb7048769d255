"""The metric children of PrometheusMetrics are made once (a profile showed a
``.labels()`` lookup per message), and the values still land on the right series."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from relay.core.interfaces import DsnResult, Outcome, Result
from relay.ops.metrics import (
    OTHER_TEMPLATES,
    REUSE_TEMPLATES,
    ConfigReloadMetrics,
    PrometheusMetrics,
)


def test_counting_a_message_looks_up_no_label(monkeypatch: pytest.MonkeyPatch) -> None:
    """After construction no call to ``.labels()`` is made, and every value is counted."""
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry=registry)
    metrics.declare_upstreams(["primary", "backup"])
    collectors = [metrics._messages, metrics._recipients, metrics._store_errors,
                  metrics._store_seconds, metrics._upstream_replies, metrics._up, metrics._dsn,
                  metrics._upstream_up, metrics._failovers]

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError(".labels() called per message")

    for collector in collectors:
        monkeypatch.setattr(collector, "labels", refuse)
    metrics.message(Result.RELAYED)
    metrics.message("relayed")  # type: ignore[arg-type]  # the value spelling counts too
    metrics.recipients(Outcome.RELAYED, 3)
    metrics.store_call("reserve", 0.002, ok=False)
    metrics.upstream_call(0.1, 250, "primary")
    metrics.upstream_call(0.1, None, "backup")
    metrics.upstream_up("backup", False)
    metrics.failover("primary")
    metrics.component_up("store", True)
    metrics.dsn(DsnResult.SENT)
    value = registry.get_sample_value
    assert value("relay_messages_total", {"result": "relayed"}) == 2
    assert value("relay_recipients_total", {"outcome": "relayed"}) == 3
    assert value("relay_store_errors_total", {"op": "reserve"}) == 1
    assert value("relay_store_seconds_count", {"op": "reserve"}) == 1
    assert value("relay_upstream_replies_total", {"code_class": "2xx", "upstream": "primary"}) == 1
    assert value("relay_upstream_replies_total", {"code_class": "none", "upstream": "backup"}) == 1
    assert value("relay_upstream_replies_total", {"code_class": "4xx", "upstream": "backup"}) == 0
    assert value("relay_upstream_up", {"upstream": "backup"}) == 0
    assert value("relay_upstream_failovers_total", {"from_upstream": "primary"}) == 1
    assert value("relay_upstream_failovers_total", {"from_upstream": "backup"}) == 0
    assert value("relay_component_up", {"component": "store"}) == 1
    assert value("relay_dsn_total", {"result": "sent"}) == 1


def test_a_value_outside_the_enums_is_still_refused() -> None:
    """A typo is a ValueError, not a new series."""
    metrics = PrometheusMetrics(registry=CollectorRegistry())
    with pytest.raises(ValueError):
        metrics.message("relayd")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        metrics.recipients("nope")  # type: ignore[arg-type]


def test_the_reload_metrics_exist_at_start_and_count_without_a_lookup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """relay_config_reloads_total has both results at 0 from the start, the timestamp is 0;
    a reload is counted without a ``.labels()`` call; only an applied one sets the time."""
    registry = CollectorRegistry()
    reloads = ConfigReloadMetrics(registry=registry)
    value = registry.get_sample_value
    assert value("relay_config_reloads_total", {"result": "applied"}) == 0
    assert value("relay_config_reloads_total", {"result": "refused"}) == 0
    assert value("relay_config_last_reload_timestamp_seconds") == 0

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError(".labels() called per reload")

    monkeypatch.setattr(Counter, "labels", refuse)
    monkeypatch.setattr(Gauge, "labels", refuse)
    reloads.reloaded(applied=False, now=100.0)
    reloads.reloaded(applied=True, now=200.0)
    reloads.reloaded(applied=False, now=300.0)
    assert value("relay_config_reloads_total", {"result": "applied"}) == 1
    assert value("relay_config_reloads_total", {"result": "refused"}) == 2
    assert value("relay_config_last_reload_timestamp_seconds") == 200.0


def test_key_reuse_counts_by_template_within_a_bounded_label_set() -> None:
    """relay_key_reuse_total{template}: each template its own series (several values
    comma-joined), at most REUSE_TEMPLATES of them; the templates after count as _other."""
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry=registry)
    metrics.key_reused("receipt", 2)
    metrics.key_reused("a\x1fb")
    for n in range(REUSE_TEMPLATES + 5):
        metrics.key_reused(f"t{n}")
    value = registry.get_sample_value
    assert value("relay_key_reuse_total", {"template": "receipt"}) == 2
    assert value("relay_key_reuse_total", {"template": "a,b"}) == 1
    assert value("relay_key_reuse_total", {"template": "t0"}) == 1
    assert value("relay_key_reuse_total", {"template": OTHER_TEMPLATES}) == 7
    series = {s.labels["template"] for family in registry.collect()
              if family.name == "relay_key_reuse" for s in family.samples}
    assert len(series) == REUSE_TEMPLATES + 1
