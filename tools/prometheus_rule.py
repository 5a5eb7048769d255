"""Write deploy/kubernetes/monitoring/prometheusrule.yaml from the shipped alert rules
(config/prometheus/alerts.yml): the same groups in a PrometheusRule of the Prometheus Operator.
Run after changing the rules; tests/cli/test_packaging.py fails until the two are equal."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "config" / "prometheus" / "alerts.yml"
RULE = REPO / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml"
HEADER = ("# The shipped alert rules (config/prometheus/alerts.yml, `dedup-relay example alerts`) "
          "as a\n# PrometheusRule of the Prometheus Operator, written by "
          "tools/prometheus_rule.py; a test keeps\n# the two equal.\n")


def render() -> str:
    """The PrometheusRule's YAML text."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "dedup-relay", "labels": {"app": "dedup-relay"}},
            "spec": {"groups": groups}}
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=100, allow_unicode=True)


if __name__ == "__main__":
    RULE.write_text(render())
