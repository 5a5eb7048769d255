"""The fault bench on the PostgreSQL store (issue 13): a real `python -m relay serve` process
(two workers) whose ``--store`` is a private PostgreSQL server the run owns
(tests/support/private_postgres.py: fsync and synchronous_commit on, the store's schema from
``dedup-relay db upgrade``), a faulty aiosmtpd sink, 40 messages from clients that retry like
MTAs, and PostgreSQL restarted, stopped or killed mid-load (tests/support/faultbench_scenarios.py;
the long run is ``tools/faultbench.py --only pg-restart,pg-down,pg-sigkill``).

Each test asserts design.md §1 as the checker counts it per fingerprint (no duplicate outside
UNKNOWN, nothing answered 250 and lost, every message ended before the deadline), and that the
relay failed closed while the database was away (``store_down = fail_closed``: 451 4.3.0, the
client retries) and relayed again once it was back. The shared server on 5432 is never touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.faultbench_scenarios import RunResult, evidence, run_scenario, scenarios

pytestmark = pytest.mark.slow  # a PostgreSQL server and relay processes under load

MESSAGES = 40
SPREAD_S = 1.5  # the messages arrive evenly over this time; the fault comes at 40 % of it
DEADLINE_S = 30.0  # every client must have its 2yz/5yz by then
PG_DOWN_S = 3.0

SCENARIOS = {s.name: s for s in scenarios(pg_down_s=PG_DOWN_S)}


async def run(name: str, workdir: Path) -> RunResult:
    """Run one scenario of the bench and print its counts."""
    result = await run_scenario(SCENARIOS[name], messages=MESSAGES, workdir=workdir,
                                spread_s=SPREAD_S, deadline_s=DEADLINE_S)
    print(result.line())
    return result


def report(result: RunResult) -> str:
    """The counts, the fingerprints concerned and what the relay logged about them."""
    return "\n".join([result.line(), f"marks={result.marks}", *evidence(result)])


def assert_invariant(result: RunResult) -> None:
    """0 duplicates outside UNKNOWN, 0 accepted-but-lost, every message ended in time; any
    fingerprint missing at the sink is one whose client was told it is in doubt."""
    c = result.counts
    assert (c.dup_outside, c.accepted_lost, c.unfinished, c.stray_copies) == (0, 0, 0, 0), (
        report(result))
    assert c.copies + c.unknown >= c.fingerprints >= c.copies, report(result)


def assert_relayed_after_the_fault(result: RunResult) -> None:
    """The sink took copies after PostgreSQL was back (unix time ``marks['store back']``)."""
    back = result.marks["store back"]
    lines = (result.workdir / "sink.jsonl").read_text(encoding="utf-8").splitlines()
    assert any(json.loads(line)["t"] > back for line in lines), report(result)


async def test_postgres_restart_mid_load_keeps_the_invariant(tmp_path: Path) -> None:
    """`pg_ctl restart -m fast` mid-load (every pooled connection dropped): no duplicate, no
    loss, and the relay relays again on new connections once the server is back."""
    result = await run("pg-restart", tmp_path)
    assert_invariant(result)
    assert_relayed_after_the_fault(result)


async def test_postgres_stopped_3s_mid_load_fails_closed_and_keeps_the_invariant(
        tmp_path: Path) -> None:
    """`pg_ctl stop -m immediate` for 3 s mid-load, then started (crash recovery): clients are
    told 451 4.3.0 while it is down, retry, and each message is delivered once after."""
    result = await run("pg-down", tmp_path)
    assert_invariant(result)
    assert result.counts.replies["451 4.3.0"] > 0, report(result)
    assert_relayed_after_the_fault(result)


async def test_postgres_postmaster_sigkill_mid_load_keeps_the_invariant(
        tmp_path: Path) -> None:
    """SIGKILL to the postmaster mid-load (its backends exit, no shutdown at all), then started:
    clients are told 451 4.3.0 meanwhile, and no committed record is lost (fsync on): no
    duplicate, no loss, relaying resumes."""
    result = await run("pg-sigkill", tmp_path)
    assert_invariant(result)
    assert result.counts.replies["451 4.3.0"] > 0, report(result)
    assert_relayed_after_the_fault(result)
