"""The CPU cost of a log evidence source's look (relay/reconcile/): a Postfix log and an Exim
main log of ``--lines`` lines (one message in ten accepted or refused, the rest the lines
around it), then:

1. the first look (reads the whole log once, builds the index);
2. a look of ``--queries`` in-doubt queries with nothing new in the log (a reconciler's
   round when the smarthost was quiet);
3. a look of the same queries after ``--append`` more lines (a round after a busy minute).

    .venv/bin/python tools/bench_reconcile_look.py [--lines 100000] [--queries 1000]

Prints the process CPU seconds (every thread: the reading runs in one) and the bytes read of
each step. Files in a temporary folder; no relay, no smarthost.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from datetime import datetime
from pathlib import Path

from relay.reconcile.evidence import Query
from relay.reconcile.exim import EximLog
from relay.reconcile.log_index import LogSource
from relay.reconcile.postfix import PostfixLog


def postfix_lines(start: int, count: int, at: float) -> str:
    lines = []
    for n in range(start, start + count):
        when = datetime.fromtimestamp(at + n / 1000).astimezone().isoformat(
            timespec="microseconds")
        queue_id = f"{n:011X}"
        if n % 10 == 0:
            lines.append(f"{when} mx postfix/cleanup[4242]: {queue_id}: "
                         f"message-id=<m{n}@app.test>")
        elif n % 10 == 1:
            lines.append(f"{when} mx postfix/qmgr[4240]: {n - 1:011X}: from=<app@example.com>, "
                         "size=2881, nrcpt=1 (queue active)")
        elif n % 10 == 9:
            lines.append(f"{when} mx postfix/qmgr[4240]: {n - 9:011X}: removed")
        else:
            lines.append(f"{when} mx postfix/smtp[4243]: {queue_id}: to=<user@example.net>, "
                         "relay=mx.example.net[192.0.2.7]:25, delay=0.2, delays=0/0/0.1/0.1, "
                         "dsn=2.0.0, status=sent (250 2.0.0 Ok: queued as 4Q8Xk20Zz)")
    return "\n".join(lines) + "\n"


def exim_lines(start: int, count: int, at: float) -> str:
    lines = []
    for n in range(start, start + count):
        when = datetime.fromtimestamp(at + n / 1000).strftime("%Y-%m-%d %H:%M:%S")
        exim_id = f"1xa{n:03d}"[-6:] + f"-{n:06d}"[-7:] + "-2k"
        if n % 10 == 0:
            lines.append(f"{when} {exim_id} <= app@example.com H=(app.test) [127.0.0.1] "
                         f"P=esmtp S=2881 id=m{n}@app.test")
        else:
            lines.append(f"{when} {exim_id} => user@example.net R=smarthost T=remote_smtp "
                         "H=mx.example.net [192.0.2.7] C=\"250 OK\"")
    return "\n".join(lines) + "\n"


async def measure(kind: str, source: LogSource, path: Path, lines: int, queries: int,
                  append: int, at: float) -> None:
    make = postfix_lines if kind == "postfix" else exim_lines
    asked = [Query(f"<m{n * 10 * (lines // 10 // queries)}@app.test>", at)
             for n in range(queries)]
    for step in ("first look", f"{queries} queries, log unchanged",
                 f"{queries} queries after {append} new lines"):
        if step.endswith("new lines"):
            with path.open("a") as log:
                log.write(make(lines, append, at))
        read_before, cpu = source.bytes_read, time.process_time()
        found = await source.look(asked if step != "first look" else [])
        spent = time.process_time() - cpu
        print(f"{kind:8} {step:40} {spent * 1000:9.1f} ms CPU "
              f"{source.bytes_read - read_before:>12,} bytes read "
              f"({sum(e.verdict != 'unknown' for e in found.values())} found)")
    await source.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--append", type=int, default=1000)
    args = parser.parse_args()
    at = time.time() - 3600
    with tempfile.TemporaryDirectory() as folder:
        maillog, mainlog = Path(folder) / "mail.log", Path(folder) / "mainlog"
        maillog.write_text(postfix_lines(0, args.lines, at))
        mainlog.write_text(exim_lines(0, args.lines, at))
        await measure("postfix", PostfixLog("postfix", maillog), maillog, args.lines,
                      args.queries, args.append, at)
        await measure("exim", EximLog("exim", mainlog), mainlog, args.lines, args.queries,
                      args.append, at)


if __name__ == "__main__":
    asyncio.run(main())
