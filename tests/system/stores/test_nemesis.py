"""The nemesis, short version (tools/faultbench.py --nemesis is the long one): real relays
under load while a schedule drawn from a fixed seed applies overlapping faults to them, their
store and their smarthost; then every fault is healed and the checker reads the history
(bench/faultbench/nemesis.py, docs/reliability.md "The nemesis").

Each seed's run must keep the invariant (no duplicate, nothing lost) with no unhandled error
in the relays' logs; a relay with a defect planted in it (bench/faultbench/defects.py)
must be caught.
Every seed that ever broke the invariant stays here once its cause is fixed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.faultbench.checker import timeline
from bench.faultbench.nemesis import NemesisConfig, NemesisResult, run_nemesis
from bench.faultbench.nemesis_history import relay_lines
from bench.faultbench.schedule import (
    STORE_KINDS,
    STORES,
    count_kinds,
    draw_schedule,
    kinds_for,
)

pytestmark = [pytest.mark.slow,  # relay processes under load and faults: 15-40 s per run
              pytest.mark.timeout(240)]  # a loaded runner stretches the heal: up to 100 s

DURATION_S = 12.0
"""Seconds of load of each seed's run (its schedule is drawn for this duration)."""
DEFECT_DURATION_S = 20.0
"""Seconds of load of each planted defect's run."""
HEAL_S = 50.0  # the run ends once every client has ended: generous for a loaded runner

SEEDS = [("redis", 9, 1), ("redis", 386, 2), ("sqlite", 5, 1), ("sqlite", 158, 2),
         ("postgres", 1, 1), ("postgres", 62, 2), ("postgres", 3003, 2)]
"""(store, seed, relays) of each run in CI, drawn for DURATION_S: each store's first two seeds
apply every fault of that store itself (bench/faultbench/schedule.py: stopped,
restarted, crashed, partitioned; SQLite's held write lock), and between them the six apply
every kind of fault (test_the_seeds_apply_every_kind_of_fault). Seeds that broke the
invariant in a long run follow, with the test of their kind: PostgreSQL 3003 (240 s, two
relays: a withdrawn dot that left before the socket closed, 2 duplicates;
tests/upstream/test_transfer_withdraw.py)."""
DEFECT_SEEDS = {"inflight-read-as-sent": [(325, 1, 16.0), (96, 1, 16.0), (119, 1, 16.0)],
                "sent-settle-released": [(39, 2, 8.0), (43, 2, 8.0)]}
"""Per planted defect, the Redis seeds (seed, relays, messages per second) tried in turn
until one catches it: kills of relays with messages in flight for the first (seed 325 also
holds the smarthost's reply to the dot while relays are killed: on a runner loaded many times
over, where few messages are in flight when a kill lands, it still loses many), a smarthost's
451 to one recipient of two (and kills) for the second."""


async def run(store: str, seed: int, relays: int, workdir: Path, *, defect: str = "",
              rate: float = 8.0, duration_s: float = DURATION_S) -> NemesisResult:
    """One nemesis run of the CI's length; its line and notes are printed."""
    result = await run_nemesis(NemesisConfig(seed=seed, duration_s=duration_s, store=store,
                                             relays=relays, rate=rate, heal_s=HEAL_S,
                                             defect=defect), workdir)
    print(result.line(), *result.notes, sep="\n")
    return result


def report(result: NemesisResult) -> str:
    """The run's line, its schedule, and the timeline of each fingerprint it broke."""
    logs = sorted(result.workdir.glob("relay*/relay.log"))
    lines = [result.line(), "schedule:", *(f"  {f.describe()}" for f in result.schedule),
             "applied:", *(f"  {f.describe()}" for f in result.applied),
             *(f"note: {n}" for n in result.notes),
             *(f"unhandled: {e}" for e in result.relay_errors[:10])]
    for bucket in ("duplicates", "lost", "unfinished"):
        for fp in result.counts.concerned.get(bucket, [])[:4]:
            lines += [f"{bucket}: {fp}", *timeline(result.history, fp, relay_lines(logs, fp[0]))]
    return "\n".join(lines)


def test_the_seeds_apply_every_kind_of_fault() -> None:
    """Each store's seeds draw every fault of that store; all of them, every kind there is."""
    drawn = {(store, seed, relays): set(count_kinds(draw_schedule(seed, DURATION_S, store,
                                                                  relays)))
             for store, seed, relays in SEEDS}
    for store in STORES:
        own = set().union(*(kinds for (s, _, _), kinds in drawn.items() if s == store))
        assert set(STORE_KINDS[store]) <= own, (store, own)
    assert set().union(*drawn.values()) == {k for store in STORES for k in kinds_for(store)}


@pytest.mark.parametrize(("store", "seed", "relays"), SEEDS,
                         ids=[f"{s}-seed{n}-{r}relay" for s, n, r in SEEDS])
async def test_a_seeds_compound_faults_keep_the_invariant(store: str, seed: int, relays: int,
                                                          tmp_path: Path) -> None:
    """Under the seed's overlapping faults no fingerprint is duplicated or lost, and no relay
    process logged an unhandled error. (Messages still unfinished after the heal are printed,
    not failed: on a runner loaded many times over, two processes sharing one SQLite file
    time out on each other's write lock, the clients give up on attempts the relays then
    finish, and the backlog outlives the heal.)"""
    result = await run(store, seed, relays, tmp_path)
    c = result.counts
    assert result.applied, report(result)
    assert (c.duplicates, c.lost) == (0, 0), report(result)
    assert result.relay_errors == [], report(result)


@pytest.mark.parametrize("defect", sorted(DEFECT_SEEDS))
async def test_a_relay_with_a_planted_defect_is_caught(defect: str, tmp_path: Path) -> None:
    """Relays with a defect planted in them (a retry that finds another attempt's
    reservation answered as a duplicate; an accepted recipient's key released instead of
    marked SENT) break the invariant under a seed's faults, and the checker says so."""
    results = []
    for seed, relays, rate in DEFECT_SEEDS[defect]:
        result = await run("redis", seed, relays, tmp_path / f"seed-{seed}", defect=defect,
                           rate=rate, duration_s=DEFECT_DURATION_S)
        results.append(result)
        if result.counts.broken:
            break
    assert results[-1].counts.broken, "\n\n".join(report(r) for r in results)
    assert (results[-1].counts.duplicates if defect == "sent-settle-released"
            else results[-1].counts.lost) > 0, report(results[-1])
