"""The shipped Grafana dashboard as JSON: a data source variable and job/instance variables used
by every panel and query, and the ``__inputs``/``__requires`` an import into an existing Grafana
reads. Its queries are checked by promtool; that they read only exported metrics is checked
against a live relay in test_observability.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.cli import REPO

DASHBOARD = REPO / "grafana" / "dashboards" / "dedup-relay.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCOPE = ('job=~"$job"', 'instance=~"$instance"')
# PromQL words that are not metric names
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "and", "or", "unless"}


def dashboard() -> dict[str, Any]:
    """The dashboard JSON."""
    return dict(json.loads(DASHBOARD.read_text()))


def targets() -> list[dict[str, Any]]:
    """Every query target of every panel."""
    return [t for p in dashboard()["panels"] for t in p["targets"]]


def variables() -> dict[str, dict[str, Any]]:
    """The template variables by name."""
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def selectors(expr: str) -> list[tuple[str, str]]:
    """Every vector selector of a PromQL expression as (metric name, label matchers text);
    a metric named without braces gives empty matchers."""
    masked = re.sub(r'"[^"]*"', lambda m: "'" * len(m.group()), expr)  # label values
    masked = re.sub(r"\[[^\]]*\]", lambda m: " " * len(m.group()), masked)  # ranges
    masked = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",
                    lambda m: " " * len(m.group()), masked)  # grouping label lists
    masked = re.sub(r"\{[^}]*\}", lambda m: "{" + " " * (len(m.group()) - 2) + "}", masked)
    found = []
    for match in re.finditer(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{\s*\})?", masked):
        name = match.group(1)
        after = masked[match.end():].lstrip()
        if name in KEYWORDS or (match.group(2) is None and after.startswith("(")):
            continue  # a keyword or a function call
        braces = match.group(2)
        start = match.start(2)
        found.append((name, expr[start + 1:match.end(2) - 1] if braces else ""))
    return found


def test_selectors_are_found_in_the_shapes_the_dashboard_uses() -> None:
    """The selector parser sees both selectors of a ratio, none of the function names, label
    lists or ranges, and a bare metric name."""
    ratio = ('sum(rate(a_total{x="by (le)", y=~"1|2"}[$__rate_interval])) / '
             'clamp_min(sum by (le, op) (rate(b_bucket[5m])), 1e-9)')
    assert selectors(ratio) == [("a_total", 'x="by (le)", y=~"1|2"'), ("b_bucket", "")]


def test_every_panel_and_query_reads_the_datasource_variable() -> None:
    """No panel or target names a data source uid of its own: all follow ``$datasource``."""
    board = dashboard()
    assert board["panels"]
    for panel in board["panels"]:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, (panel["title"], target["refId"])


def test_every_selector_is_scoped_by_job_and_instance() -> None:
    """Each vector selector of each panel query carries ``job=~"$job"`` and
    ``instance=~"$instance"``, so the variables narrow every panel."""
    checked = 0
    for target in targets():
        found = selectors(target["expr"])
        assert found, target["expr"]
        for name, matchers in found:
            for matcher in SCOPE:
                assert matcher in matchers, f"{name} in {target['expr']!r} lacks {matcher}"
            checked += 1
    assert checked >= len(targets())


def test_the_datasource_job_and_instance_variables() -> None:
    """``datasource`` lists Prometheus data sources; ``job`` and ``instance`` are the label
    values of a relay metric (instances of the chosen jobs), queried through ``$datasource``,
    multi-valued with All."""
    found = variables()
    assert list(found)[:3] == ["datasource", "job", "instance"]
    ds = found["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert found["job"]["query"] == "label_values(relay_build_info, job)"
    assert found["instance"]["query"] == 'label_values(relay_build_info{job=~"$job"}, instance)'
    for name in ("job", "instance"):
        var = found[name]
        assert var["type"] == "query" and var["datasource"] == DATASOURCE
        assert var["definition"] == var["query"]
        assert var["includeAll"] and var["multi"]
        assert "allValue" not in var  # All = the relays' own values, not every job Prometheus has


def test_inputs_and_requires_for_an_import_into_an_existing_grafana() -> None:
    """Import asks for a Prometheus data source (``DS_PROMETHEUS``) and preselects it in the
    ``datasource`` variable; ``__requires`` names Grafana, Prometheus and every panel type.
    ``${DS_PROMETHEUS}`` appears nowhere else: file provisioning does not fill ``__inputs``,
    and an unfilled value in a panel breaks it, while the variable falls back to the first
    Prometheus data source."""
    board = dashboard()
    assert board["__inputs"] == [{
        "name": "DS_PROMETHEUS", "label": "Prometheus",
        "description": board["__inputs"][0]["description"], "type": "datasource",
        "pluginId": "prometheus", "pluginName": "Prometheus"}]
    required = {(r["type"], r["id"]) for r in board["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    assert {("panel", p["type"]) for p in board["panels"]} <= required
    ds = variables()["datasource"]
    assert ds["current"]["value"] == ds["current"]["text"] == "${DS_PROMETHEUS}"
    rest = dict(board, __inputs=None)
    rest["templating"] = {"list": [dict(v, current=None) for v in board["templating"]["list"]]}
    assert "DS_PROMETHEUS" not in json.dumps(rest)


def test_provisioning_serves_the_dashboard_with_a_default_prometheus() -> None:
    """compose's Grafana: one Prometheus data source, the default (the ``datasource``
    variable picks it), and the provider reads the folder the dashboard is mounted in."""
    ds_file = REPO / "grafana/provisioning/datasources/prometheus.yml"
    (source,) = yaml.safe_load(ds_file.read_text())["datasources"]
    assert source["type"] == variables()["datasource"]["query"] == "prometheus"
    assert source["isDefault"] is True
    provider_file = REPO / "grafana/provisioning/dashboards/dedup-relay.yml"
    provider = yaml.safe_load(provider_file.read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in mounts


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses every panel query and the variables' selector, with the variables
    replaced as Grafana does (a regex for ``$job``/``$instance``, a range for
    ``$__rate_interval``)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (.ci/run installs the prometheus package)")
    exprs = [t["expr"] for t in targets()]
    exprs.append(re.sub(r"^label_values\((.*), \w+\)$", r"\1", variables()["instance"]["query"]))
    rules = [{"record": f"dashboard:query_{i}",
              "expr": e.replace("$__rate_interval", "1m").replace("$job", "(dedup-relay|b)")
                       .replace("$instance", ".+")}
             for i, e in enumerate(exprs)]
    assert not any("$" in r["expr"] for r in rules)
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
