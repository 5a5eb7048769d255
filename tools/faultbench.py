"""The fault bench, long version: every fault of bench/faultbench/scenarios.py with
hundreds of messages, one run after the other, and a Markdown report (docs/reliability.md).

    .venv/bin/python tools/faultbench.py --messages 400 --out docs/reliability.md

With ``--nemesis`` it runs the nemesis instead (random compound faults drawn from a seed, then
the checker: tools/faultbench_nemesis.py, docs/reliability.md "The nemesis")::

    .venv/bin/python tools/faultbench.py --nemesis --seed 7 --duration 60 --store redis

Each run: a bench-owned redis-server (AOF; the ``pg-*`` runs: a private PostgreSQL server,
tests/support/private_postgres.py), an aiosmtpd sink with the run's faults, a real
`python -m relay serve` process, messages arriving at ``--rate`` per second from clients that
retry like MTAs, one fault mid-load; then the checker's counts per fingerprint. Loopback only;
each run is bounded by ``--deadline`` (clients) plus a few seconds of set-up and tear-down.
Exits 1 when a run broke the invariant (the report is written anyway), 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and not __package__:
    # Run as a file (python tools/faultbench.py from the repo root): run it as the module
    # tools.faultbench instead, so the tests package (tests/support/) imports as a package.
    import os

    os.execv(sys.executable,  # noqa: S606  # this same interpreter, a fixed argument list
             [sys.executable, "-m", "tools.faultbench", *sys.argv[1:]])

from bench.faultbench.lib import RelayConfig  # noqa: E402
from bench.faultbench.scenarios import (  # noqa: E402
    LATENCY_S,
    RunResult,
    Scenario,
    evidence,
    run_scenario,
    scenarios,
)
from bench.faultbench.traffic import RetryPolicy  # noqa: E402
from tests.support.private_postgres import version as postgres_version  # noqa: E402
from tools import faultbench_nemesis  # noqa: E402

COLUMNS = [
    ("fault", "what was done to the relay, its store or its upstream during the load"),
    ("messages", "distinct messages sent (one unique X-Dedupe-Key each; every third has two "
                 "recipients)"),
    ("fingerprints", "(recipient, key) pairs: the unit the relay deduplicates and the unit of "
                     "every count to the right except retries"),
    ("client retries", "SMTP attempts beyond the first, over all messages (4yz, refused or "
                       "lost connections, timeouts)"),
    ("delivered", "fingerprints with at least one copy at the sink"),
    ("duplicates outside UNKNOWN", "fingerprints with more than one copy at the sink whose "
                                   "client never got the relay's in-doubt 451 4.4.2: breaks "
                                   "the invariant"),
    ("duplicates within UNKNOWN", "fingerprints with more than one copy that the relay had "
                                  "declared in doubt: the honest exception, counted apart"),
    ("accepted-but-lost", "fingerprints whose client got 250, with no copy at the sink, and no "
                          "in-doubt 451 4.4.2 for them: breaks the invariant"),
    ("unknown", "fingerprints whose client got 451 4.4.2 \"in doubt\" at least once"),
    ("gave up", "fingerprints whose client got a 5yz and stopped (as an MTA bounces)"),
    ("unfinished", "fingerprints whose client had neither 2yz nor 5yz by the deadline"),
    ("wall time", "first arrival to the last client's final reply"),
]


def machine_facts() -> list[str]:
    """nproc, CPU, OS, Python, Redis and the source revision the run used."""
    cpu = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    redis_exe = shutil.which("redis-server") or "redis-server"
    redis_version = subprocess.run([redis_exe, "--version"], capture_output=True, text=True,
                                   check=False, timeout=10).stdout.split(" sha=")[0]
    return [f"machine: nproc {os.cpu_count()}, {cpu}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, {redis_version}, "
            f"PostgreSQL {postgres_version()}",
            f"source: {source_revision()}"]


def source_revision() -> str:
    """The commit the relay was run from, and whether relay/ had uncommitted changes."""
    git = shutil.which("git")
    if git is None:
        return "source revision unknown (no git)"
    head = subprocess.run([git, "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False, timeout=10).stdout.strip()
    dirty = subprocess.run([git, "-C", str(REPO), "status", "--porcelain", "relay"],
                           capture_output=True, text=True, check=False, timeout=10).stdout.strip()
    return f"relay/ at commit {head}" + (" with uncommitted changes" if dirty else "")


def table(results: list[RunResult]) -> list[str]:
    """The Markdown table, one row per fault."""
    head = "| " + " | ".join(name for name, _ in COLUMNS) + " |"
    rows = [head, "|" + "---|" + "---:|" * (len(COLUMNS) - 1)]
    for r in results:
        c = r.counts
        cells = [r.scenario.title, c.messages, c.fingerprints, c.retries, c.delivered,
                 c.dup_outside, c.dup_unknown, c.accepted_lost, c.unknown, c.gave_up,
                 c.unfinished, f"{c.wall_s:.1f} s"]
        rows.append("| " + " | ".join(str(x) for x in cells) + " |")
    return rows


def _relay_changes(scenario: Scenario) -> str:
    """The scenario's relay settings that differ from the set-up's defaults, and a second
    relay with an offset clock, as one line ("" when none)."""
    default, own = RelayConfig(), scenario.relay
    changed = [f"{name} {getattr(own, name)}" for name in vars(default)
               if getattr(own, name) != getattr(default, name)]
    if scenario.second_clock_offset_s is not None:
        changed.append(f"a second relay with its clock {scenario.second_clock_offset_s:+g} s")
    if scenario.policy is not None:
        changed.append(f"clients: {scenario.policy}")
    return ", ".join(changed)


def details(results: list[RunResult]) -> list[str]:
    """Per run: what the clients were answered, notes, and evidence for any break."""
    out = ["## Per run", ""]
    for r in results:
        c = r.counts
        answers = ", ".join(f"{k} x{n}" for k, n in c.replies.most_common())
        changed = _relay_changes(r.scenario)
        out += [f"### {r.scenario.title} (`{r.scenario.name}`)", "",
                *([f"- relay settings unlike the set-up's: {changed}"] if changed else []),
                f"- client attempts answered: {answers}",
                f"- attempts whose final dot got no reply: {c.no_reply_after_dot}",
                f"- copies at the sink: {c.copies}; stray copies: {c.stray_copies}",
                *(f"- {note}" for note in r.notes)]
        for bucket, names in c.concerned.items():
            out.append(f"- {bucket}: {', '.join(names)}")
        lines = evidence(r)
        if lines:
            out += ["", "```", *lines, "```"]
        out.append("")
    return out


def render(results: list[RunResult], command: str, started: datetime, total_s: float,
           args: argparse.Namespace) -> str:
    """The whole report."""
    rc, policy = RelayConfig(), RetryPolicy()
    broken = [r for r in results if r.counts.dup_outside or r.counts.accepted_lost
              or r.counts.unfinished]
    verdict = ("Every run kept the invariant." if not broken else
               "Runs that broke the invariant: "
               + ", ".join(f"`{r.scenario.name}`" for r in broken) + " (evidence below).")
    lines = [
        "# Reliability under faults", "",
        "Measured by the fault bench (`tools/faultbench.py`; the CI version is "
        "`tests/system/stores/test_faults.py`). This file is its output; re-run the command to "
        "refresh it.",
        "", f"- command: `{command}`",
        f"- date: {started:%Y-%m-%d %H:%M} UTC; all runs took {total_s:.0f} s",
        *(f"- {fact}" for fact in machine_facts()), "",
        "## Set-up", "",
        f"- relay: `python -m relay serve --workers {args.workers}`, lease {rc.lease_s:g} s, "
        "upstream timeout "
        f"(final dot) {rc.upstream_timeout_s:g} s, upstream connect/command timeouts "
        f"{rc.connect_timeout_s:g}/{rc.command_timeout_s:g} s, store timeout "
        f"{rc.store_timeout_s:g} s, shutdown grace {rc.shutdown_grace_s:g} s, metrics off, "
        "`unknown_policy = suppress`, `store_down = fail_closed`",
        "- store: a redis-server owned by the run, AOF with `appendfsync always`, "
        "`noeviction` (like the compose stack); stopped with SIGTERM, restarted on its data",
        "- store of the `pg-*` runs: a private PostgreSQL server owned by the run (its own "
        "cluster copied from one `initdb` with the schema of `dedup-relay db upgrade`, a free "
        "loopback port, trust auth, `fsync = on`, `synchronous_commit = on`); restarted with "
        "`pg_ctl restart -m fast`, stopped with `pg_ctl stop -m immediate` and started on its "
        "data (crash recovery), or its postmaster killed with SIGKILL and started again once "
        f"its backends exited; stopped for {args.pg_down:g} s in `pg-down`",
        "- store of the `store-blackhole-*` runs: the same redis-server, reached through a TCP "
        "proxy in the bench process that black-holes it on cue (holds every byte, answers "
        "nothing; when it answers again its connections are closed and the bytes it held "
        "dropped, as a partition that outlasted them)",
        f"- upstream: an aiosmtpd sink in the bench process; each reply takes 0-{LATENCY_S:g} s; "
        "faults are dealt in shuffled blocks of 20 transactions (exact ratios per block); "
        "it logs each accepted (recipient, X-Dedupe-Key) before it replies",
        f"- clients: {args.messages} messages per run arriving evenly at {args.rate:g}/s, at most "
        f"20 SMTP sessions at once; 4yz, refused/lost connections and timeouts are retried "
        f"after {policy.base_s:g} s doubling to {policy.max_s:g} s with 50-100 % jitter; 5yz "
        f"gives up; each reply waited {policy.timeout_s:g} s at most; deadline "
        f"{args.deadline:g} s after the first arrival",
        "- faults start when 40 % of the arrivals have happened", "",
        "## Results", "", verdict, "", *table(results), "",
        "## Columns", "", *(f"- **{name}**: {text}" for name, text in COLUMNS), "",
        "**UNKNOWN** (docs/design.md section 1): the relay wrote the final dot upstream and no "
        "reply came "
        "(RFC 1047). It cannot know whether the upstream took the message, so it keeps the "
        "fingerprint as UNKNOWN for the dedup window, answers `451 4.4.2 ... in doubt`, and "
        "suppresses the retries (`unknown_policy = suppress`): a duplicate is impossible, but a "
        "message the upstream did not take would be lost with a 250 to the retry. That is the "
        "one outcome SMTP itself cannot settle; it is counted, logged and released by an "
        "operator, and the bench counts it apart instead of as a loss or a duplicate.", "",
        *details(results),
    ]
    return "\n".join(lines) + "\n"


async def run_all(args: argparse.Namespace, workroot: Path) -> list[RunResult]:
    """Run the chosen scenarios one after the other, printing each run's counts."""
    chosen = [dataclasses.replace(s, relay=dataclasses.replace(s.relay, workers=args.workers))
              for s in scenarios(redis_down_s=args.redis_down, pg_down_s=args.pg_down)
              if not args.only or s.name in args.only.split(",")]
    results = []
    for scenario in chosen:
        result = await run_scenario(
            scenario, messages=args.messages, workdir=workroot / scenario.name,
            spread_s=args.messages / args.rate, deadline_s=args.deadline, seed=args.seed)
        print(result.line(), flush=True)
        results.append(result)
    return results


def main() -> None:
    """Parse the arguments, run the faults, write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=400, help="messages per run")
    parser.add_argument("--rate", type=float, default=40.0, help="arrivals per second")
    parser.add_argument("--deadline", type=float, default=90.0,
                        help="seconds after the first arrival by which every client must end")
    parser.add_argument("--redis-down", type=float, default=10.0,
                        help="seconds Redis stays stopped")
    parser.add_argument("--pg-down", type=float, default=3.0,
                        help="seconds PostgreSQL stays stopped (pg-down)")
    parser.add_argument("--only", default="",
                        help="comma-separated scenario names (the PostgreSQL store's: pg-baseline, "
                             "pg-restart, pg-down, pg-sigkill)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=RelayConfig().workers,
                        help="worker processes of each relay (serve --workers)")
    parser.add_argument("--out", type=Path, help="write the Markdown report here")
    parser.add_argument("--keep", type=Path, help="keep the runs' logs under this directory")
    faultbench_nemesis.add_arguments(parser)
    args = parser.parse_args()
    if args.nemesis:
        with tempfile.TemporaryDirectory(prefix="nemesis-") as tmp:
            sys.exit(faultbench_nemesis.main(args, args.keep or Path(tmp)))
    command = " ".join([os.path.relpath(sys.executable), os.path.relpath(sys.argv[0]),
                        *sys.argv[1:]])
    started, t0 = datetime.now(UTC), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="faultbench-") as tmp:
        workroot = args.keep or Path(tmp)
        results = asyncio.run(run_all(args, workroot))
        report = render(results, command, started, time.monotonic() - t0, args)  # reads logs
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + faultbench_nemesis.kept_section(args.out))
        print(f"wrote {args.out}")
    broken = any(r.counts.dup_outside or r.counts.accepted_lost or r.counts.unfinished
                 for r in results)
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
