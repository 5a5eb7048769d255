"""The standard ``process_*`` and ``python_*`` series on /metrics, scraped from a relay process
over real HTTP."""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, generate_latest

from relay.ops.metrics import PrometheusMetrics
from tests.support.metrics import ServedRelay, scrape


def test_a_serving_relay_exports_process_and_python_series(served_relay: ServedRelay) -> None:
    """/metrics of a `serve` process describes that process: its memory, CPU, descriptors,
    start time (between the spawn and now) and interpreter."""
    samples = scrape(served_relay.metrics_port)
    (_, rss), = samples["process_resident_memory_bytes"]
    assert 10 * 2**20 < rss < 2 * 2**30  # an interpreter with the relay loaded: tens of MiB
    (_, started), = samples["process_start_time_seconds"]
    assert served_relay.started_at - 2 <= started <= served_relay.started_at + 30
    assert samples["process_cpu_seconds_total"][0][1] > 0
    assert samples["process_open_fds"][0][1] >= 3  # at least the two listeners and the store
    (python, value), = samples["python_info"]
    assert value == 1 and python["version"] == platform.python_version()
    assert {labels["generation"] for labels, _ in samples["python_gc_collections_total"]} == {
        "0", "1", "2"}


def test_each_injected_registry_gets_its_own_collectors() -> None:
    """Two relays in one process (as in the tests) each register the standard collectors on
    their own registry without a duplicate-timeseries error."""
    first, second = CollectorRegistry(), CollectorRegistry()
    PrometheusMetrics(registry=first)
    PrometheusMetrics(registry=second)
    for registry in (first, second):
        text = generate_latest(registry).decode()
        assert "\nprocess_resident_memory_bytes " in text
        assert "\npython_info{" in text
