"""``tools/faultbench.py --nemesis``: runs of the nemesis (bench/faultbench/nemesis.py),
one per seed, each printed as it ends; a failing run's seed, schedule and the timeline of the
fingerprints it broke; ``--shrink`` drops faults from a failing schedule while the run still
fails. Last, the faults applied per kind and one line per run::

    nemesis seed N store S: faults F, keys K, duplicates D, lost L, in doubt U, unfinished X

Exit status: 1 when a run had a duplicate or a loss, 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import sys
from collections import Counter
from pathlib import Path

from bench.faultbench.checker import timeline
from bench.faultbench.nemesis import NemesisConfig, NemesisResult, run_nemesis
from bench.faultbench.nemesis_history import relay_lines
from bench.faultbench.schedule import (
    Fault,
    count_kinds,
    schedule_from_json,
    schedule_json,
    without,
)

SECTION = "## The nemesis"
"""The heading of the nemesis's section of docs/reliability.md (written by hand: its long-run
table, its rules), kept when the fault bench rewrites the rest of the file."""
EVIDENCE_LIMIT = 6
"""Most broken fingerprints whose timeline a failing run prints."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The nemesis's options (``--seed`` is the fault bench's own)."""
    group = parser.add_argument_group("nemesis (with --nemesis)")
    group.add_argument("--nemesis", action="store_true",
                       help="random compound faults under load, drawn from --seed (or each "
                            "seed of --seeds), then the checker")
    group.add_argument("--seeds", default="", metavar="A-B",
                       help="run every seed from A to B, one run each")
    group.add_argument("--duration", type=float, default=60.0,
                       help="seconds of load (and faults) per run")
    group.add_argument("--store", choices=("redis", "sqlite", "postgres"), default="redis")
    group.add_argument("--relays", type=int, choices=(1, 2), default=1)
    group.add_argument("--nemesis-rate", type=float, default=8.0,
                       help="messages arriving per second")
    group.add_argument("--heal", type=float, default=60.0,
                       help="seconds the clients get to finish once every fault is healed")
    group.add_argument("--unknown-policy", choices=("suppress", "send"), default="suppress")
    group.add_argument("--schedule", default="",
                       help="run this schedule (the JSON a failing run prints) instead of "
                            "the seed's")
    group.add_argument("--shrink", action="store_true",
                       help="on a failing run, drop faults while it still fails and print "
                            "the smallest failing schedule")
    group.add_argument("--shrink-runs", type=int, default=16,
                       help="most runs one shrink makes")
    group.add_argument("--plant-defect", default="",
                       help="run relays with a planted defect (bench/faultbench/defects.py), "
                            "to see the checker catch it")


def kept_section(report: Path) -> str:
    """The nemesis's section of the report at ``report`` (from its heading,
    :data:`SECTION`, to the end), which rewriting the fault bench's part keeps as it is; ""
    when there is none."""
    text = report.read_text() if report.is_file() else ""
    at = text.find(f"\n{SECTION}\n")
    return "\n" + text[at + 1:] if at >= 0 else ""


def seeds_of(args: argparse.Namespace) -> list[int]:
    """The seeds to run: ``--seeds A-B``, else ``--seed``."""
    if not args.seeds:
        return [args.seed]
    low, _, high = args.seeds.partition("-")
    first, last = int(low), int(high or low)
    if last < first:
        raise SystemExit(f"--seeds {args.seeds}: the range is empty")
    return list(range(first, last + 1))


def repro(cfg: NemesisConfig, faults: list[Fault]) -> str:
    """The command that runs ``faults`` again."""
    extra = f" --plant-defect {cfg.defect}" if cfg.defect else ""
    return (f".venv/bin/python tools/faultbench.py --nemesis --seed {cfg.seed} --duration "
            f"{cfg.duration_s:g} --store {cfg.store} --relays {cfg.relays}"
            f" --unknown-policy {cfg.unknown_policy}{extra} --schedule "
            f"{shlex.quote(schedule_json(faults))}")


def report(result: NemesisResult, title: str = "") -> list[str]:
    """A run's line; for a failing run also its seed, schedule and timelines."""
    c = result.counts
    lines = [result.line() + (f" ({title})" if title else ""),
             f"  copies taken {c.copies}; in doubt {c.in_doubt}: not listed {c.unlisted}, no "
             f"dot reached the smarthost {c.doubt_without_dot}, every dot refused "
             f"{c.doubt_refused}, no attempt left it in doubt {c.doubt_unexplained}; applied: "
             f"{', '.join(f.kind for f in result.applied) or '-'}"]
    if result.relay_errors:
        lines.append(f"  unhandled errors in the relays' logs: {len(result.relay_errors)}, "
                     f"first: {result.relay_errors[0]}")
    logs = sorted(result.workdir.glob("relay*/relay.log"))
    for fp in c.concerned.get("doubt_unexplained", [])[:EVIDENCE_LIMIT // 2]:
        lines += [f"  in doubt with no attempt to explain it: {fp[0]} key {fp[1]}",
                  *timeline(result.history, fp, relay_lines(logs, fp[0]))]
    if not c.broken:
        return lines
    cfg = result.config
    lines += [f"  FAILED: seed {cfg.seed}, {len(result.schedule)} faults scheduled "
              f"({len(result.applied)} applied), logs in {result.workdir}:",
              *(f"    {f.describe()}" for f in result.schedule),
              f"  again: {repro(cfg, result.schedule)}", *(f"  note: {n}" for n in result.notes)]
    for bucket in ("duplicates", "lost"):
        for fp in result.counts.concerned.get(bucket, [])[:EVIDENCE_LIMIT]:
            lines += [f"  {bucket[:-1] if bucket == 'duplicates' else bucket}: {fp[0]} "
                      f"key {fp[1]}", *timeline(result.history, fp, relay_lines(logs, fp[0]))]
    return lines


async def shrink(result: NemesisResult, root: Path, budget: int) -> NemesisResult:
    """The smallest failing run found by dropping faults from ``result``'s schedule (chunks,
    then single faults: ddmin's complements) in at most ``budget`` runs; each candidate is
    run once (a timing that does not recur keeps its fault)."""
    best, runs, parts = result, 0, 2
    current = sorted(result.applied, key=lambda f: f.at_s) or list(result.schedule)
    while len(current) > 1 and runs < budget:
        size = -(-len(current) // parts)
        chunks = [range(i, min(i + size, len(current))) for i in range(0, len(current), size)]
        smaller = False
        for chunk in chunks:
            candidate = without(current, chunk)
            if runs >= budget or not candidate:
                break
            runs += 1
            attempt = await run_nemesis(best.config, root / f"shrink-{runs}", candidate)
            print(report(attempt, f"shrink run {runs}: {len(candidate)} faults")[0], flush=True)
            if attempt.counts.broken:
                best, current, smaller = attempt, candidate, True
                parts = max(2, parts - 1)
                break
        if not smaller:
            if parts >= len(current):
                break
            parts = min(len(current), parts * 2)
    return best


def fault_summary(results: list[NemesisResult]) -> str:
    """Faults applied per kind over ``results``, with the seed-minutes of the runs that
    applied at least one (a run that applied none does not count)."""
    kinds: Counter[str] = Counter()
    for r in results:
        kinds.update(count_kinds(r.applied))
    counted = [r for r in results if r.applied]
    minutes = sum(r.config.duration_s for r in counted) / 60
    per_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none"
    return (f"faults applied per kind over {len(counted)} run(s) with a fault "
            f"({minutes:.1f} seed-minutes; {len(results) - len(counted)} run(s) without): "
            f"{per_kind}")


def table_row(results: list[NemesisResult]) -> str:
    """The runs as one row of docs/reliability.md's long-run table (the runs that applied
    no fault are left out, as in the seed-minutes)."""
    counted = [r for r in results if r.applied]
    total = {name: sum(getattr(r.counts, name) for r in counted)
             for name in ("keys", "duplicates", "lost", "in_doubt", "unfinished")}
    stores = ", ".join(sorted({r.config.store for r in results}))
    cells = [stores, len(counted), f"{sum(r.config.duration_s for r in counted) / 60:.0f}",
             sum(len(r.applied) for r in counted), *total.values()]
    return "| " + " | ".join(str(c) for c in cells) + " |"


async def run_all(args: argparse.Namespace, root: Path) -> list[NemesisResult]:
    """Every seed's run (and its shrink), printing each as it ends."""
    results = []
    for seed in seeds_of(args):
        cfg = NemesisConfig(seed=seed, duration_s=args.duration, store=args.store,
                            relays=args.relays, rate=args.nemesis_rate, heal_s=args.heal,
                            unknown_policy=args.unknown_policy, defect=args.plant_defect)
        schedule = (schedule_from_json(args.schedule, cfg.store, cfg.relays)
                    if args.schedule else None)
        result = await run_nemesis(cfg, root / f"seed-{seed}", schedule)
        print("\n".join(report(result)), flush=True)
        if result.counts.broken and args.shrink:
            small = await shrink(result, root / f"seed-{seed}", args.shrink_runs)
            print("\n".join(report(small, "shrunk")), flush=True)
        results.append(result)
    return results


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(args: argparse.Namespace, root: Path) -> int:
    """Run the nemesis as ``args`` say; print the summary and the run lines last; the exit
    status. SIGTERM stops it as Ctrl-C does: every process it started is stopped first."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        results = asyncio.run(run_all(args, root))
    except KeyboardInterrupt:
        print("nemesis: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    print(f"table row: {table_row(results)}")
    print(fault_summary(results))
    for r in results:
        print(r.line())
    sys.stdout.flush()
    return 1 if any(r.counts.broken for r in results) else 0
