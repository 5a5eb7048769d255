"""The shipped alert rules under promtool's rule unit tests (tests/ops/alerts.test.yml): every
rule has one (quiet, then firing with its labels and annotations); severities are the
``critical`` / ``warning`` Alertmanager routes match; DedupRelayInDoubtUnresolved is pending
for its first 10 minutes, then fires once for several relays on one ledger (max, not sum),
never for a count settled within the 10 minutes, and sends the operator to `dedup-relay
in-doubt`; a refused reload alerts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parents[1] / "config" / "prometheus" / "alerts.yml"
RULE_TEST = HERE / "alerts.test.yml"


def rules() -> dict[str, dict[str, object]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def test_every_alert_passes_its_promtool_unit_test() -> None:
    """`promtool test rules` on the rules' unit tests succeeds (.ci/run installs promtool)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed (.ci/run installs the prometheus package)")
    result = subprocess.run([promtool, "test", "rules", str(RULE_TEST)], capture_output=True,
                            text=True, timeout=60, check=False, cwd=HERE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_in_doubt_alert_reads_the_ledger_gauge_and_names_the_command() -> None:
    """The rule reads relay_ledger_in_doubt_unresolved, waits 10m and tells the operator to
    run `dedup-relay in-doubt`, then mark-sent or release."""
    rule = rules()["DedupRelayInDoubtUnresolved"]
    assert str(rule["expr"]).strip() == "max(relay_ledger_in_doubt_unresolved) > 0"
    assert rule["for"] == "10m"
    annotations = rule["annotations"]
    assert isinstance(annotations, dict)
    text = annotations["description"]
    for command in ("dedup-relay in-doubt", "dedup-relay mark-sent", "dedup-relay release"):
        assert command in text


def test_every_rule_has_a_unit_test_and_a_routable_severity() -> None:
    tested = {case["alertname"] for test in yaml.safe_load(RULE_TEST.read_text())["tests"]
              for case in test["alert_rule_test"]}
    assert tested == set(rules())
    for name, rule in rules().items():
        labels = rule["labels"]
        assert isinstance(labels, dict) and labels["severity"] in ("critical", "warning"), name


def test_a_refused_reload_alerts() -> None:
    """What docs/operating/reload.md tells the operator to alert on is a shipped rule."""
    expr = str(rules()["DedupRelayReloadRefused"]["expr"])
    assert "relay_config_reloads_total" in expr and "refused" in expr


def test_every_rule_links_its_section_of_the_runbook() -> None:
    """Each ``runbook_url`` is the external label ``dedup_relay_docs`` followed by the anchor
    of a section of docs/operating/alerts.md that is titled with the alert's name (mkdocs
    anchors: the heading lowercased)."""
    page = (HERE.parents[1] / "docs" / "operating" / "alerts.md").read_text()
    headings = {line[3:].strip().lower() for line in page.splitlines() if line.startswith("## ")}
    for name, rule in rules().items():
        annotations = rule["annotations"]
        assert isinstance(annotations, dict)
        assert annotations["runbook_url"] == (
            "{{ $externalLabels.dedup_relay_docs }}/operating/alerts/#" + name.lower()), name
        assert name.lower() in headings, name
