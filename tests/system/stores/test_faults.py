"""The fault bench, short version: a real `python -m relay serve` process in front of a faulty
aiosmtpd sink, a bench-owned redis-server, 40 messages from clients that retry like MTAs, and
one fault per test (bench/faultbench/scenarios.py; the long run is tools/faultbench.py).

Each test asserts design.md §1 as the checker counts it per fingerprint: no duplicate
outside UNKNOWN, nothing answered 250 and lost, every message ended (250 or 5yz) before the
deadline. The counts are printed (``pytest -s``) and are in every assertion message.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.faultbench.scenarios import RunResult, Scenario, evidence, run_scenario, scenarios

pytestmark = pytest.mark.slow  # relay processes under load, real leases: seconds per test

MESSAGES = 40
SPREAD_S = 1.5  # the messages arrive evenly over this time; the fault comes at 40 % of it
DEADLINE_S = 40.0  # every client must have its 2yz/5yz by then (Redis down 6 s included)
REDIS_DOWN_S = 6.0  # longer than the bench's 5 s lease (test_redis_down_...'s docstring)
IN_FLIGHT_WAIT_S = 5.0
"""The relays' ``in_flight_wait`` (seconds), where a scenario leaves the setting's 15 s: a copy
that meets the key of a killed relay's attempt hears no settle and waits out the whole bound.
5 s, the bench's lease, is shorter than the clients' 10 s reply timeout (RetryPolicy), so
that copy is answered (from what the store holds after the wait) instead of its client
timing out and trying again: the wait still runs and ends as before, in a third of the time."""


def _bounded_wait(scenario: Scenario) -> Scenario:
    """``scenario`` with its relays' in-flight wait at most :data:`IN_FLIGHT_WAIT_S`."""
    if scenario.relay.in_flight_wait_s <= IN_FLIGHT_WAIT_S:
        return scenario
    return dataclasses.replace(scenario, relay=dataclasses.replace(
        scenario.relay, in_flight_wait_s=IN_FLIGHT_WAIT_S))


SCENARIOS = {s.name: _bounded_wait(s) for s in scenarios(redis_down_s=REDIS_DOWN_S)}


async def run(name: str, workdir: Path) -> RunResult:
    """Run one scenario of the bench and print its counts."""
    result = await run_scenario(SCENARIOS[name], messages=MESSAGES, workdir=workdir,
                                spread_s=SPREAD_S, deadline_s=DEADLINE_S)
    print(result.line())
    return result


def report(result: RunResult) -> str:
    """The counts, the fingerprints concerned and what the relay logged about them."""
    return "\n".join([result.line(), *evidence(result)])


def assert_invariant(result: RunResult) -> None:
    """0 duplicates outside UNKNOWN, 0 accepted-but-lost, every message ended in time."""
    c = result.counts
    assert (c.dup_outside, c.accepted_lost, c.unfinished, c.stray_copies) == (0, 0, 0, 0), (
        report(result))


async def test_control_run_delivers_each_fingerprint_once(tmp_path: Path) -> None:
    """Without a fault every fingerprint reaches the sink exactly once on the first attempt."""
    result = await run("baseline", tmp_path)
    assert_invariant(result)
    c = result.counts
    assert (c.copies, c.delivered, c.retries) == (c.fingerprints, c.fingerprints, 0), (
        report(result))


async def test_redis_restart_mid_load_keeps_the_invariant(tmp_path: Path) -> None:
    """A Redis restart mid-load neither duplicates nor loses a message."""
    assert_invariant(await run("redis-restart", tmp_path))


async def test_redis_down_longer_than_the_lease_mid_load_keeps_the_invariant(
        tmp_path: Path) -> None:
    """Redis down 6 s mid-load: clients are told 451 4.3.0, retry, and each is delivered once,
    except one whose SENDING mark landed as Redis stopped (its reply lost, so the relay withheld
    the dot and owed the release): with the bench's lease (5 s) shorter than the outage, that
    record reads as in doubt before the owed release lands, and its client is told so (design.md
    §3: choose the lease longer than the store outages to ride out). Seen once in six CI runs,
    and twice in one run on a runner loaded by two suites at once: any fingerprint missing must
    be one in doubt (no bound on how many: the load decides)."""
    result = await run("redis-down", tmp_path)
    assert_invariant(result)
    c = result.counts
    assert c.replies["451 4.3.0"] > 0, report(result)
    assert c.copies + c.unknown >= c.fingerprints >= c.copies, report(result)


async def test_upstream_temp_failures_keep_the_invariant(tmp_path: Path) -> None:
    """With 30 % upstream 451s (at RCPT or at the dot) each retried message is delivered once."""
    result = await run("upstream-temp", tmp_path)
    assert_invariant(result)
    assert result.counts.retries > 0, report(result)
    assert result.counts.copies == result.counts.fingerprints, report(result)


async def test_upstream_hang_after_dot_is_unknown_not_duplicated(tmp_path: Path) -> None:
    """An unanswered final dot (5 %) is answered 451 4.4.2 in doubt, and no retry resends it."""
    result = await run("upstream-hang", tmp_path)
    assert_invariant(result)
    c = result.counts
    assert c.unknown > 0 and c.dup_unknown == 0, report(result)


async def test_upstream_drops_and_perm_failures_keep_the_invariant(tmp_path: Path) -> None:
    """Dropped upstream connections are retried and delivered once; 554s end as given up."""
    result = await run("upstream-drop-perm", tmp_path)
    assert_invariant(result)
    assert result.counts.gave_up > 0, report(result)


async def test_upstream_stalled_link_is_reset_not_duplicated(tmp_path: Path) -> None:
    """A link stalling mid-message: the transfer is reset (451 4.4.2), no dot follows, the
    retry is delivered once, and nothing had to be declared in doubt."""
    result = await run("upstream-stall", tmp_path)
    assert_invariant(result)
    c = result.counts
    assert c.replies["451 4.4.2"] > 0 and c.unknown == 0, report(result)
    assert c.copies == c.fingerprints, report(result)
    assert "reset, nothing delivered" in (result.workdir / "relay.log").read_text(), (
        report(result))


async def test_relay_sigterm_mid_load_keeps_the_invariant(tmp_path: Path) -> None:
    """SIGTERM mid-load: the relay exits 0 and, with its successor, loses and repeats nothing."""
    result = await run("relay-sigterm", tmp_path)
    assert_invariant(result)
    assert result.relay_exit_codes[0] == 0, report(result)


async def test_relay_sigterm_finishes_the_message_in_flight(tmp_path: Path) -> None:
    """SIGTERM while upstream holds a reply: the relay finishes that message, then exits 0."""
    result = await run("relay-sigterm-inflight", tmp_path)
    assert_invariant(result)
    assert result.relay_exit_codes[0] == 0, report(result)
    assert result.counts.no_reply_after_dot == 0, report(result)


async def test_relay_sigterm_past_the_grace_waits_for_the_reply_to_a_dot(tmp_path: Path) -> None:
    """SIGTERM with a 0.3 s grace while the upstream holds its reply to a dot 0.8 s: the
    transaction whose dot is on the wire waits past the grace for that reply (up to 5 s), so
    nothing is left in doubt and every message is delivered once."""
    result = await run("relay-sigterm-cut", tmp_path)
    assert_invariant(result)
    assert result.relay_exit_codes[0] == 0, report(result)
    c = result.counts
    assert c.unknown == 0, report(result)
    assert c.copies == c.fingerprints, report(result)


async def test_relay_sigterm_while_the_store_pauses_keeps_the_settle(tmp_path: Path) -> None:
    """SIGTERM whose grace ends while the SENT mark after an upstream 250 waits on a paused
    Redis: the mark lands, the client has its 250, the successor repeats nothing (item 2)."""
    result = await run("relay-sigterm-settle-cut", tmp_path)
    assert_invariant(result)
    assert result.relay_exit_codes[0] == 0, report(result)
    assert result.counts.copies == result.counts.fingerprints, report(result)
    assert result.counts.no_reply_after_dot == 0, report(result)


async def test_relays_with_skewed_clocks_keep_the_invariant(tmp_path: Path) -> None:
    """Two relays 10 s apart on one store under unknown_policy = send, clients retrying on the
    other relay while the first waits on a held reply: no duplicate, nothing in doubt (item 3)."""
    result = await run("relays-clock-skew", tmp_path)
    assert_invariant(result)
    c = result.counts
    assert c.copies == c.fingerprints, report(result)
    assert c.replies["450 4.2.0"] > 0, report(result)  # retries met the other relay's attempt


async def test_relays_on_one_sqlite_file_across_a_clock_step_keep_the_invariant(
        tmp_path: Path) -> None:
    """Two relays on one SQLite file, the second's wall clock 20 s ahead (more than the 5 s
    lease) under unknown_policy = send, clients retrying on the other relay while the first
    waits on a held reply: no duplicate, nothing read as in doubt."""
    result = await run("sqlite-clock-step", tmp_path)
    assert_invariant(result)
    c = result.counts
    assert c.copies == c.fingerprints, report(result)
    assert c.replies["450 4.2.0"] > 0, report(result)  # retries met the other relay's attempt


async def test_transactions_longer_than_the_lease_keep_the_invariant(tmp_path: Path) -> None:
    """A slow upstream makes many transactions outlast the 6 s lease: none is refused as store
    unavailable or lapsed, none is duplicated (item 4)."""
    result = await run("long-transactions", tmp_path)
    assert_invariant(result)
    c = result.counts
    assert c.replies["451 4.3.0"] == 0, report(result)
    assert c.copies == c.fingerprints, report(result)


async def test_relay_sigkill_mid_data_keeps_the_invariant(tmp_path: Path) -> None:
    """A relay killed while big bodies stream over stalled links, then restarted, neither
    duplicates nor loses a message: a body cut before its dot leaves a reservation, which
    lapses with its lease and lets the retry through."""
    result = await run("relay-sigkill-mid-data", tmp_path)
    assert_invariant(result)
    assert result.counts.unfinished == 0, report(result)


async def test_relay_sigkill_mid_load_keeps_the_invariant(tmp_path: Path) -> None:
    """A relay killed by SIGKILL mid-load and restarted neither duplicates nor loses a message."""
    assert_invariant(await run("relay-sigkill", tmp_path))


async def test_relay_sigkill_after_upstream_took_a_message(tmp_path: Path) -> None:
    """SIGKILL after upstream took a message but before the relay settled: no second copy."""
    assert_invariant(await run("relay-sigkill-after-dot", tmp_path))


async def test_a_release_owed_when_the_relay_is_killed_is_paid_by_the_next_start(
        tmp_path: Path) -> None:
    """The store black-holed while the upstream refuses a held message, the relay killed with
    its release owed, the store back, a new relay: every fingerprint is delivered (none lost as
    "in doubt"), none twice."""
    result = await run("store-blackhole-sigkill", tmp_path)
    assert_invariant(result)
    c = result.counts
    assert c.delivered == c.fingerprints, report(result)


async def test_a_journal_left_while_the_store_is_silent_is_paid_once_it_answers(
        tmp_path: Path) -> None:
    """The store black-holed while the upstream refuses a held message, the relay stopped,
    a new relay started before the store answers: the release journaled under the store's
    identity is paid once it does, and every fingerprint is delivered, none twice."""
    result = await run("store-blackhole-restart", tmp_path)
    assert_invariant(result)
    c = result.counts
    assert c.delivered == c.fingerprints, report(result)


async def test_a_relay_killed_while_the_upstream_delays_354_loses_nothing(
        tmp_path: Path) -> None:
    """Every 354 comes 2 s after DATA and the relay is killed mid-load: the transactions
    waiting for it leave reservations, not SENDING records, so every fingerprint is delivered
    (none lost as "in doubt"), none twice."""
    result = await run("upstream-late-354-sigkill", tmp_path)
    assert_invariant(result)
    c = result.counts
    assert c.delivered == c.fingerprints, report(result)


async def test_a_sigterm_with_dots_still_in_the_kernel_releases_them(tmp_path: Path) -> None:
    """SIGTERM past a 0.3 s grace while 2 MB messages sit in the kernel of stalled links: the
    dots still unsent after the 5 s wait are reset and released, so nothing is in doubt and
    every fingerprint is delivered once."""
    result = await run("relay-sigterm-unsent-dot", tmp_path)
    assert_invariant(result)
    assert result.relay_exit_codes[0] == 0, report(result)
    c = result.counts
    assert c.unknown == 0, report(result)
    assert c.copies == c.fingerprints, report(result)
