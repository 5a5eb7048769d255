"""Benchmark: messages per second while the store does not take settles (the settle journal's
cost, docs/performance.md).

    .venv/bin/python tools/bench_owed_settles.py --messages 600 --concurrency 20
    .venv/bin/python tools/bench_owed_settles.py --source /tmp/relay-before   # another tree

Three runs through one real ``python -m relay serve`` process (one worker), each with its own
store and an accept-all aiosmtpd sink in this process:

- ``store answers``: a new SQLite file (the embedded store), nothing refused (``redis
  answers``: the test Redis under a fresh prefix, asked for with ``--runs answers-redis``);
- ``settles refused``: the same, with triggers that refuse every SENT mark, UNKNOWN mark and
  release at once (reserves, SENDING marks and renewals land): every message is relayed and
  answered 250 with its SENT mark owed (after its three quick tries), which is what the journal
  writes, and every owed mark is retried in the background as the outage goes on;
- ``store black-holed``: the test Redis behind a TCP proxy that holds every byte (every reserve
  times out after the 1 s store timeout and is answered 451; nothing is owed).

Clients send unique messages (each its own key), ``--concurrency`` SMTP sessions at a time.
Printed per run: messages/s (first connect to last reply), the relay's CPU time per message
(user + system, from ``/proc``: steadier than messages/s on a shared machine), the replies, the
journal's lines at the end. ``--source`` runs the relay package found in that directory
instead of this tree (``git archive <commit> relay | tar -x -C DIR`` makes one), so two
versions are measured the same way. Loopback only; bounded by ``--messages``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and not __package__:  # run as a file: as the module, so tests imports
    os.execv(sys.executable,  # noqa: S606  # this same interpreter, a fixed argument list
             [sys.executable, "-m", "tools.bench_owed_settles", *sys.argv[1:]])

import aiosmtplib  # noqa: E402

from bench.faultbench.lib import free_port, wait_for_port  # noqa: E402
from relay.store.sqlite.store import SqliteStore  # noqa: E402
from tests.support.pg_proxy import start_proxy  # noqa: E402
from tests.support.relays import REDIS_URL, delete_prefix  # noqa: E402
from tests.support.sink import start_sink  # noqa: E402

REFUSE_SETTLES = """
CREATE TRIGGER refuse_marks BEFORE UPDATE ON fingerprints
  WHEN NEW.state IN ('sent', 'unknown')
  BEGIN SELECT RAISE(ABORT, 'bench: the store takes no settles'); END;
CREATE TRIGGER refuse_releases BEFORE DELETE ON fingerprints
  BEGIN SELECT RAISE(ABORT, 'bench: the store takes no settles'); END;
"""


async def sqlite_store(path: Path, *, refuse_settles: bool) -> str:
    """A new SQLite store file at ``path`` (made by this tree's store), with the triggers
    that refuse settles when asked; its URL."""
    store = await SqliteStore.open(str(path))
    await store.close()
    if refuse_settles:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.executescript(REFUSE_SETTLES)
    return f"sqlite:///{path}"


async def _client(port: int, index: int, tag: str) -> str:
    """One message with its own key; its reply as ``code enhanced`` (or the error's name)."""
    body = (f"From: app@example.com\r\nTo: user@example.net\r\nX-Template: bench\r\n"
            f"X-Dedupe-Key: {tag}-{index}\r\n\r\nhello\r\n")
    try:
        async with aiosmtplib.SMTP(hostname="127.0.0.1", port=port, timeout=30) as smtp:
            _refused, reply = await smtp.sendmail("app@example.com", [f"u{index}@example.net"],
                                                body.encode())
            return f"250 {reply.split(' ', 1)[0]}"
    except aiosmtplib.SMTPResponseException as exc:
        return f"{exc.code} {exc.message.split(' ', 1)[0]}"
    except (aiosmtplib.SMTPException, OSError) as exc:
        return type(exc).__name__


async def _load(port: int, messages: int,
                concurrency: int) -> tuple[float, collections.Counter[str]]:
    """Send ``messages`` unique messages, ``concurrency`` at a time: (messages/s, replies)."""
    gate = asyncio.Semaphore(concurrency)
    tag = uuid.uuid4().hex[:8]

    async def one(i: int) -> str:
        async with gate:
            return await _client(port, i, tag)

    started = time.perf_counter()
    replies = await asyncio.gather(*(one(i) for i in range(messages)))
    return messages / (time.perf_counter() - started), collections.Counter(replies)


async def _run(name: str, store_url: str, source: Path, args: argparse.Namespace) -> None:
    """Serve on ``store_url`` from ``source``, load it, print the figures, stop it."""
    sink = await start_sink()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-owed-") as tmp:
        journal = Path(tmp) / "owed.jsonl"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        env["PYTHONPATH"] = str(source)
        prefix = f"bench:owed:{uuid.uuid4().hex}:"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "relay", "serve", "--workers", "1",
            "--listen", f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{sink.port}",
            "--store", store_url, "--store-prefix", prefix, "--store-timeout", "1",
            "--settle-journal", str(journal), "--metrics-listen", "off",
            "--max-connections-per-ip", "500", "--log-level", "ERROR", cwd=tmp, env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            await wait_for_port(port, proc, timeout_s=30)
            cpu_before = _cpu_s(proc.pid)
            rate, replies = await _load(port, args.messages, args.concurrency)
            cpu_ms = (_cpu_s(proc.pid) - cpu_before) * 1000 / args.messages
            lines = len(journal.read_text().splitlines()) if journal.exists() else 0
        finally:
            if proc.returncode is None:
                proc.terminate()
            await asyncio.wait_for(proc.wait(), 60)
            sink.server.close()
            if store_url.startswith("redis"):
                delete_prefix(REDIS_URL, prefix)
    print(f"{name:18} {rate:8.1f} msg/s  {cpu_ms:5.2f} ms CPU/msg  replies {dict(replies)}  "
          f"journal lines {lines}", flush=True)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def main_async(args: argparse.Namespace) -> None:
    """The three runs, one after the other."""
    source = args.source.resolve()
    print(f"relay from {source}, {args.messages} messages, {args.concurrency} at a time")
    with tempfile.TemporaryDirectory(prefix="bench-owed-store-") as tmp:
        if "answers" in args.runs.split(","):
            url = await sqlite_store(Path(tmp) / "answers.db", refuse_settles=False)
            await _run("store answers", url, source, args)
        if "answers-redis" in args.runs:
            await _run("redis answers", REDIS_URL, source, args)
        if "refused" in args.runs:
            url = await sqlite_store(Path(tmp) / "refuses.db", refuse_settles=True)
            await _run("settles refused", url, source, args)
    if "black-holed" not in args.runs:
        return
    proxy = await start_proxy(REDIS_URL)
    try:
        proxy.hang()
        await _run("store black-holed", proxy.url(REDIS_URL), source, args)
    finally:
        proxy.resume()
        await proxy.close()


def main() -> None:
    """Parse the arguments and run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--runs", default="answers,refused,black-holed",
                        help="which runs, comma-separated: answers, answers-redis, refused, "
                             "black-holed (default: answers,refused,black-holed)")
    parser.add_argument("--source", type=Path, default=REPO,
                        help="directory holding the relay package to run (default: this tree)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
