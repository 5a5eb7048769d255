"""A relay process serving /metrics, and a scrape of it over real HTTP."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass
class ServedRelay:
    """A relay process: its SMTP and metrics ports, the process, and when it was started
    (``time.time()`` seconds just before the spawn)."""

    port: int
    metrics_port: int
    proc: subprocess.Popen[str]
    started_at: float


def scrape(metrics_port: int) -> Samples:
    """GET /metrics on 127.0.0.1:``metrics_port``: {sample name: [(labels, value), ...]}."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:  # loopback only
        assert response.status == 200
        body = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def readyz(metrics_port: int) -> tuple[int, dict[str, Any]]:
    """GET /readyz on 127.0.0.1:``metrics_port``: its status code and JSON body (a 503 too)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz",
                                    timeout=5) as reply:  # loopback only
            return int(reply.status), json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), json.loads(exc.read())


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with ``labels`` in an in-process relay's
    ``registry`` (0 when it has none yet)."""
    value = registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value
