"""Where dedup-relay's CPU goes under the benchmark's load: a py-spy profile, summed by area.

One command (from the repository root, as root: py-spy attaches to the relay's processes)::

    .venv/bin/python -m bench.profile              # Redis store, one worker, 20 s of samples
    .venv/bin/python -m bench.profile --store sqlite --workers 2

It starts Postfix's ``smtp-sink``, a private ``redis-server`` (or a fresh SQLite file) and
``dedup-relay serve``, sends keyed load (``bench/load.py``: 20 sessions, a new connection per
message, one recipient) and records every relay process with ``py-spy record --format raw``
(collapsed stacks, ``--subprocesses``, 100 samples/s) while the load runs. It prints the share
of all samples per area (a sample counts for the first area, in the order of :data:`AREAS`,
whose pattern matches any frame of its stack: inclusive time, each sample counted once) and
the top frames by own time. ``--out FILE`` keeps the raw profile.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.load import run_load
from bench.run import (
    SMTP_SINK,
    VENV_BIN,
    PrivateRedis,
    Sink,
    free_port,
    process_tree,
    stop_process,
    wait_port,
)

AREAS: list[tuple[str, str]] = [
    ("store: Redis client and scripts", r"relay/store/redis/|site-packages/redis/|hiredis"),
    ("store: SQLite", r"relay/store/sqlite"),
    ("upstream: transaction, transfer, pool (aiosmtplib)",
     r"relay/upstream/|site-packages/aiosmtplib/"),
    ("dedup core: fingerprint, rules, settle (own code)", r"relay/core/"),
    ("SMTP session: commands, DATA (aiosmtpd and relay/smtp)",
     r"relay/smtp/|site-packages/aiosmtpd/"),
    ("logging", r"/logging/|pythonjsonlogger|relay/ops/logs"),
    ("metrics", r"prometheus_client|relay/ops/metrics"),
    ("event loop, sockets, TLS (asyncio, uvloop)", r"asyncio/|uvloop|selectors|ssl\.py"),
]
"""(area, regex over a frame ``function (file:line)``): the first area matching any frame of a
sample's stack takes the sample."""


def parse_raw(path: Path) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """Read py-spy's raw (collapsed) output: ``frame;frame;... count`` per line.

    Returns (samples, samples per area incl. 'other', samples per leaf frame)."""
    total = 0
    areas: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    compiled = [(name, re.compile(rx)) for name, rx in AREAS]
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        leaves[frames[-1]] += count
        for name, rx in compiled:
            if any(rx.search(f) for f in frames):
                areas[name] += count
                break
        else:
            areas["other (idle, imports, glue)"] += count
    return total, areas, leaves


def report(path: Path, top: int = 15) -> str:
    """Markdown: the share per area, then the top leaf frames, of the profile at ``path``."""
    total, areas, leaves = parse_raw(path)
    lines = [f"{total} samples", "", "| area (inclusive, each sample once) | share |", "|---|---|"]
    for name, _ in [*AREAS, ("other (idle, imports, glue)", "")]:
        if areas[name]:
            lines.append(f"| {name} | {100 * areas[name] / max(total, 1):.1f} % |")
    lines += ["", "| top frames by own time | share |", "|---|---|"]
    for frame, n in leaves.most_common(top):
        short = re.sub(r"/[^ ]*/(site-packages|lib/python3\.\d+|main)/", "", frame)
        lines.append(f"| `{short[:100]}` | {100 * n / max(total, 1):.1f} % |")
    return "\n".join(lines)


async def _load(port: int, messages: int) -> None:
    await run_load("127.0.0.1", port, messages=messages, sessions=20, rcpts=1, reuse=False,
                   prefix=f"p{uuid.uuid4().hex[:10]}.")


def main() -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--store", choices=("redis", "sqlite"), default="redis")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seconds", type=int, default=20, help="seconds of samples")
    parser.add_argument("--messages", type=int, default=20_000,
                        help="most messages sent (the load stops with the profile)")
    parser.add_argument("--out", type=Path, default=None, help="keep the raw profile here")
    parser.add_argument("--flags", default="", help="more dedup-relay flags, blank-separated")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(VENV_BIN / "py-spy")
    if not Path(SMTP_SINK).exists() or not Path(py_spy).exists():
        sys.exit("bench.profile: needs Postfix's smtp-sink and py-spy (pip install py-spy)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    sink, store = Sink(), PrivateRedis(tmp)
    port = free_port()
    url = store.url if args.store == "redis" else f"sqlite:///{tmp / 'dedup.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    relay = subprocess.Popen(
        [str(VENV_BIN / "dedup-relay"), "serve", "--listen", f"127.0.0.1:{port}", "--upstream",
         f"127.0.0.1:{sink.port}", "--metrics-listen", "off", "--store", url, "--log-level",
         "WARNING", "--max-connections-per-ip", "200", "--settle-journal", "",
         "--workers", str(args.workers), *args.flags.split()],
        cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    raw = args.out or tmp / "profile.txt"
    try:
        wait_port(port)
        asyncio.run(_load(port, 300))  # warm up
        loader = subprocess.Popen(
            [sys.executable, "-c", "import asyncio, sys; from bench.profile import _load; "
             f"asyncio.run(_load({port}, {args.messages}))"],
            cwd=Path(__file__).resolve().parent.parent)
        time.sleep(1.0)
        subprocess.run([py_spy, "record", "--format", "raw", "--subprocesses", "--rate", "100",
                        "--duration", str(args.seconds), "--nonblocking", "-o", str(raw),
                        "--pid", str(relay.pid)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        loader.kill()
        loader.wait()
        print(f"relay processes: {len(process_tree(relay.pid))}, store {args.store}, "
              f"workers {args.workers}")
        print(report(raw))
    finally:
        stop_process(relay)
        store.stop()
        sink.stop()
        if args.out is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
