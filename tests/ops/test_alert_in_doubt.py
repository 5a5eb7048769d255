"""The DedupRelayInDoubtUnresolved alert rule under promtool's rule unit tests
(tests/ops/alerts_in_doubt.test.yml): pending for its first 10 minutes, then firing once for
several relays on one ledger (max, not sum), never for a count settled within the 10 minutes;
its description sends the operator to `dedup-relay in-doubt`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parents[1] / "config" / "prometheus" / "alerts.yml"
RULE_TEST = HERE / "alerts_in_doubt.test.yml"


def test_in_doubt_alert_passes_its_promtool_unit_test() -> None:
    """`promtool test rules` on the rule's unit test succeeds (.ci/run installs promtool)."""
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
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rule = next(r for g in groups for r in g["rules"]
                if r.get("alert") == "DedupRelayInDoubtUnresolved")
    assert rule["expr"].strip() == "max(relay_ledger_in_doubt_unresolved) > 0"
    assert rule["for"] == "10m"
    text = rule["annotations"]["description"]
    for command in ("dedup-relay in-doubt", "dedup-relay mark-sent", "dedup-relay release"):
        assert command in text
