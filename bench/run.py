"""The relay benchmark: Postfix, a naive relay and dedup-relay, interleaved.

One command (from the repository root)::

    .venv/bin/python -m bench.run            # full run, 15-20 minutes on 2 cores
    .venv/bin/python -m bench.run --quick    # about 6 minutes
    .venv/bin/python -m bench.run --no-write # print the tables, leave docs/benchmarks.md alone

Every target listens on a free loopback port and relays to one shared sink, Postfix's
``smtp-sink`` (C, event driven; the "sink alone" row is the load sent straight to it, the
ceiling of this machine's load generator and sink). Targets: a private Postfix instance
(its own config and queue directory under a temp dir, ``relayhost = [127.0.0.1]:SINK``), the
naive relay of ``bench/naive_relay.py``, dedup-relay with a Redis store, with the embedded
SQLite store and with a PostgreSQL store. The Redis targets use a private ``redis-server`` (no
persistence) so that its ``used_memory`` growth per fingerprint is clean; the PostgreSQL target a
private PostgreSQL server (``tests/support/private_postgres.py``: its own cluster, a free port,
PostgreSQL's default durability: ``fsync`` and ``synchronous_commit`` on) with a fresh database
per start, its schema made by ``dedup-relay db upgrade``. Each repetition shuffles the target order,
starts each target, runs every scenario against it, and stops it. Medians and min-max spreads
over the repetitions are written to the top section of ``docs/benchmarks.md``.

Units: rates in messages per second, latencies in milliseconds, CPU in milliseconds of user plus
system time per accepted message (all processes of the target: Postfix's whole process tree),
peak RSS in MiB (sum over the target's processes, sampled every 0.2 s), Redis memory in bytes
per fingerprint (``used_memory`` growth over the keys added in the cell). The Redis and
PostgreSQL servers' CPU per message are columns of their own (not in the target's CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import platform
import random
import re
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench.load import LoadResult, Login, run_load
from tests.support.postfix import POSTFIX, postfix_main_cf, postfix_master_cf, queued
from tests.support.private_postgres import PrivatePostgres, bin_dir
from tests.support.private_postgres import version as postgres_version

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
DOC = REPO / "docs" / "benchmarks.md"
BEGIN = "<!-- bench/run.py: begin (generated, replaced by the next run) -->"
END = "<!-- bench/run.py: end -->"
SMTP_SINK = "/usr/sbin/smtp-sink"
SMTP_SOURCE = "/usr/sbin/smtp-source"
WARM_UP_MESSAGES = 200
"""Messages sent, unmeasured, to every target after it starts."""
FP_KEYS = 100_000
"""Fingerprints of the Redis memory measurement in a full run (the target asks at least 100,000)."""


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(port: int, timeout_s: float = 20.0) -> None:
    """Block until something accepts on 127.0.0.1:``port``; raises after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.recv(512)
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()


def process_tree(root: int) -> list[int]:
    """``root`` and all its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_cpu_s(root: int) -> float:
    """CPU seconds (utime + stime + reaped children's) of ``root``'s live process tree."""
    ticks = 0
    for pid in process_tree(root):
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return ticks / CLK_TCK


def tree_memory_mib(root: int) -> tuple[float, float]:
    """(RSS, PSS) in MiB summed over ``root``'s process tree.

    The RSS sum counts pages shared by several processes once per process; the PSS sum
    (``/proc/PID/smaps_rollup``) splits them, so it is the fair total of a multi-process target.
    """
    rss = pss = 0
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
    return rss / 1024, pss / 1024


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM ``proc``, SIGKILL it after ``timeout_s`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- shared services


class Sink:
    """Postfix's ``smtp-sink`` on a free loopback port: accepts and discards every message."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [SMTP_SINK, "-u", "nobody", "-m", "1000", f"127.0.0.1:{self.port}", "1024"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def stop(self) -> None:
        """Stop the sink."""
        stop_process(self.proc)


class PrivateRedis:
    """A private ``redis-server`` on a free loopback port, no persistence."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(workdir), "--logfile", str(workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        # unique per run, as long as dedup-relay's default "email:fp:" (comparable key sizes)
        self.prefix = f"fp{uuid.uuid4().hex[:6]}:"
        self.client = redis.Redis(port=self.port)
        for _ in range(100):
            with contextlib.suppress(redis.RedisError):
                self.client.ping()
                break
            time.sleep(0.05)

    def memory(self) -> tuple[int, int, int]:
        """(``used_memory``, ``used_memory_dataset`` in bytes, number of keys)."""
        info = self.client.info("memory")
        return (int(info["used_memory"]), int(info["used_memory_dataset"]),
                int(self.client.dbsize()))

    def stop(self) -> None:
        """Stop the server."""
        self.client.close()
        stop_process(self.proc)


# --------------------------------------------------------------------------- TLS and AUTH


LOGIN_USER = "app@bench.example"
LOGIN_PASSWORD = "bench-password-1"  # noqa: S105 (the benchmark's own throwaway login)


@dataclass(frozen=True)
class LoginFiles:
    """The login scenario's files: a server certificate for 127.0.0.1 and its key (a trustme
    CA), ``auth_file`` (dedup-relay's, one argon2id hash from ``hash-password``'s defaults),
    ``plain_users`` (the naive relay's ``user:password`` dictionary); ``login`` is what the
    load sends."""

    cert: Path
    key: Path
    auth_file: Path
    plain_users: Path
    login: Login

    @classmethod
    def make(cls, folder: Path) -> LoginFiles:
        import trustme

        ca = trustme.CA()
        server = ca.issue_cert("127.0.0.1")
        cert, key = folder / "server.pem", folder / "server.key"
        server.cert_chain_pems[0].write_to_path(str(cert))
        server.private_key_pem.write_to_path(str(key))
        hashed = subprocess.run(
            [str(VENV_BIN / "dedup-relay"), "hash-password", "--user", LOGIN_USER,
             "--password-stdin"], input=LOGIN_PASSWORD, capture_output=True, text=True,
            check=True, timeout=60).stdout
        auth_file, plain = folder / "users.auth", folder / "users.plain"
        auth_file.write_text(hashed)
        plain.write_text(f"{LOGIN_USER}:{LOGIN_PASSWORD}\n")
        for path in (cert, key, auth_file, plain):
            path.chmod(0o644)
        tls = ssl.create_default_context()
        ca.configure_trust(tls)
        return cls(cert, key, auth_file, plain, Login(tls, LOGIN_USER, LOGIN_PASSWORD))


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    """A system under test: ``start`` it, send to ``port``, measure ``pid``'s tree, ``stop`` it.

    ``workers``: dedup-relay's ``--workers N`` (None passes no flag: its default, one worker per
    CPU). ``flags``: more dedup-relay flags. ``memory_only``: measured only for Redis memory
    per fingerprint, not in the repetitions.
    """

    name: str
    kind: str  # sink | postfix | naive | relay-redis | relay-sqlite | relay-postgres
    workers: int | None = None
    flags: tuple[str, ...] = ()
    memory_only: bool = False
    port: int = 0
    pid: int = 0
    uses_redis: bool = False
    uses_postgres: bool = False
    proc: subprocess.Popen[bytes] | None = None
    tmp: Path | None = None
    pg_db: str = ""
    pg: PrivatePostgres | None = None

    def takes(self, scenario: Scenario) -> bool:
        """Whether this target runs ``scenario``: the login scenario is the relays' only
        (Postfix would need a SASL server; the sink has no TLS)."""
        return not scenario.login or self.kind not in ("sink", "postfix")

    def start(self, sink: Sink, store: PrivateRedis, pg: PrivatePostgres | None = None,
              login: LoginFiles | None = None) -> None:
        """Start the target on a free port, relaying to ``sink`` (a PostgreSQL target: on a
        fresh database of ``pg``, its schema made by ``dedup-relay db upgrade``); the relays
        offer STARTTLS and AUTH with ``login``'s files."""
        if self.kind == "sink":
            self.port, self.pid = sink.port, sink.proc.pid
            return
        self.tmp = Path(tempfile.mkdtemp(prefix=f"bench-{self.kind}-"))
        self.tmp.chmod(0o755)  # Postfix's daemons (user postfix) reach their dirs through it
        self.port = free_port()
        if self.kind == "postfix":
            self._start_postfix(sink)
            return
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        if self.kind == "naive":
            cmd = [sys.executable, "-m", "bench.naive_relay", "--listen",
                   f"127.0.0.1:{self.port}", "--upstream", f"127.0.0.1:{sink.port}",
                   "--redis", store.url, "--prefix", store.prefix]
            if login is not None:
                cmd += ["--tls-cert", str(login.cert), "--tls-key", str(login.key),
                        "--users", str(login.plain_users)]
            env["PYTHONPATH"] = str(REPO)
        else:
            if self.kind == "relay-postgres":
                url = self._fresh_database(pg, env)
            elif self.kind == "relay-redis":
                url = store.url
            else:
                url = f"sqlite:///{self.tmp / 'dedup.db'}"
            cmd = [str(VENV_BIN / "dedup-relay"), "serve", "--listen", f"127.0.0.1:{self.port}",
                   "--upstream", f"127.0.0.1:{sink.port}", "--metrics-listen", "off",
                   "--store", url, "--store-prefix", store.prefix,
                   "--log-level", "WARNING", "--hostname", "relay.bench",
                   "--max-connections-per-ip", "200", "--settle-journal",
                   str(self.tmp / "owed.jsonl")]
            if self.workers is not None:
                cmd += ["--workers", str(self.workers)]
            if login is not None:
                cmd += ["--tls-cert", str(login.cert), "--tls-key", str(login.key),
                        "--auth-file", str(login.auth_file)]
            cmd += list(self.flags)
        self.proc = subprocess.Popen(cmd, cwd=self.tmp, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(self.tmp / "stderr.log", "wb"))  # noqa: SIM115
        self.pid = self.proc.pid
        wait_port(self.port)

    def _fresh_database(self, pg: PrivatePostgres | None, env: dict[str, str]) -> str:
        """A new database on ``pg`` with the store's schema (``dedup-relay db upgrade``); its
        URL."""
        if pg is None:
            raise RuntimeError(f"{self.name}: no PostgreSQL server started")
        self.pg, self.pg_db = pg, f"bench_{uuid.uuid4().hex[:10]}"
        subprocess.run([str(bin_dir() / "createdb"), "-h", "127.0.0.1", "-p", str(pg.port),
                        "-U", "postgres", self.pg_db], check=True, timeout=30)
        url = f"postgresql://postgres@127.0.0.1:{pg.port}/{self.pg_db}"
        subprocess.run([str(VENV_BIN / "dedup-relay"), "db", "upgrade", "--store", url],
                       check=True, timeout=60, env=env, stdout=subprocess.DEVNULL)
        return url

    def _start_postfix(self, sink: Sink) -> None:
        assert self.tmp is not None
        conf, queue, data = self.tmp / "etc", self.tmp / "queue", self.tmp / "data"
        for d in (conf, queue, data):
            d.mkdir()
        shutil.chown(data, "postfix")
        (conf / "main.cf").write_text(postfix_main_cf(
            conf, queue, data,
            f"relayhost = [127.0.0.1]:{sink.port}\nsmtp_tls_security_level = none\n"))
        (conf / "master.cf").write_text(postfix_master_cf(self.port))
        subprocess.run([POSTFIX, "-c", str(conf), "set-permissions"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run([POSTFIX, "-c", str(conf), "start"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pid_file = queue / "pid" / "master.pid"
        for _ in range(100):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.05)
        self.pid = int(pid_file.read_text().split()[0])
        wait_port(self.port)

    def log_tail(self, lines: int = 5) -> str:
        """The last ``lines`` of the target's stderr (dedup-relay logs WARNING and up there),
        indented; empty for Postfix and the sink."""
        path = self.tmp / "stderr.log" if self.tmp is not None else None
        if path is None or not path.exists():
            return ""
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(f"      {line[:300]}" for line in tail)

    def drain(self, timeout_s: float = 120.0) -> bool:
        """Postfix: wait until its queue is empty (every message reached the sink)."""
        if self.kind != "postfix" or self.tmp is None:
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if queued(self.tmp / "queue") == 0:
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        """Stop the target and remove its temp dir."""
        if self.kind == "postfix" and self.tmp is not None:
            subprocess.run([POSTFIX, "-c", str(self.tmp / "etc"), "stop"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(200):
                if not Path(f"/proc/{self.pid}").exists():
                    break
                time.sleep(0.05)
        elif self.proc is not None:
            stop_process(self.proc)
        if self.pg is not None and self.pg_db:
            subprocess.run([str(bin_dir() / "dropdb"), "-h", "127.0.0.1", "-p",
                            str(self.pg.port), "-U", "postgres", "--if-exists", self.pg_db],
                           timeout=60, check=False, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.proc, self.tmp, self.pg, self.pg_db = None, None, None, ""




# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    """One load shape; ``messages`` is the count per cell in a full run (``--quick`` divides)."""

    name: str
    messages: int
    sessions: int = 20
    rcpts: int = 1
    reuse: bool = False
    duplicate_every: int = 0
    tool: str = "load"  # load (keyed, bench/load.py) | smtp-source (unkeyed)
    login: bool = False  # STARTTLS + AUTH PLAIN on each connection: the relays only


SCENARIOS = [
    Scenario("20 sessions, new connection per message, 1 rcpt", 1500),
    Scenario("20 sessions, new connection per message, 5 rcpts", 1000, rcpts=5),
    Scenario("20 sessions reusing connections, 1 rcpt", 2000, reuse=True),
    Scenario("one sequential client, new connection per message", 500, sessions=1),
    Scenario("20 sessions, new connection, 50 % duplicates", 1500, duplicate_every=2),
    Scenario("smtp-source, 20 sessions, new connection, no key", 1500, tool="smtp-source"),
    Scenario("20 sessions, new connection, STARTTLS + AUTH PLAIN", 1000, login=True),
]


@dataclass
class Cell:
    """Figures of one (target, scenario, repetition)."""

    rate: float
    p50_ms: float
    p99_ms: float
    cpu_ms: float
    rss_mib: float
    pss_mib: float
    redis_cpu_ms: float | None
    failed: int
    pg_cpu_ms: float | None = None


async def _sample_memory(root: int, peak: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        rss, pss = await asyncio.to_thread(tree_memory_mib, root)
        peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def smtp_source(port: int, messages: int, sessions: int) -> LoadResult:
    """Unkeyed load with Postfix's ``smtp-source`` (2 KB, new connection per message)."""
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        SMTP_SOURCE, "-s", str(sessions), "-m", str(messages), "-l", "2048",
        "-f", "bench@example.com", "-t", "user@example.net", "-M", "load.bench",
        f"127.0.0.1:{port}", stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    wall = time.perf_counter() - started
    ok = proc.returncode == 0
    if not ok:
        print(f"    smtp-source failed: {err.decode(errors='replace').strip()[:200]}")
    return LoadResult(sent=messages, accepted=messages if ok else 0, errors=0 if ok else messages,
                      wall_s=wall)


def pg_cpu_s(pg: PrivatePostgres | None) -> float:
    """CPU seconds of the PostgreSQL server: its postmaster's process tree (backends,
    checkpointer, WAL writer...; exited backends through the postmaster's cutime/cstime)."""
    return tree_cpu_s(pg.pid) if pg is not None and pg.pid is not None else 0.0


async def measure(target: Target, scenario: Scenario, messages: int,
                  store: PrivateRedis, pg: PrivatePostgres | None = None,
                  login: Login | None = None) -> Cell:
    """Run one cell against a started target (``login``: the login scenario's)."""
    cpu0 = tree_cpu_s(target.pid)
    redis_cpu0 = tree_cpu_s(store.proc.pid)
    pg_cpu0 = pg_cpu_s(pg)
    peak = [0.0, 0.0]
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_memory(target.pid, peak, stop))
    started = time.perf_counter()
    if scenario.tool == "smtp-source":
        result = await smtp_source(target.port, messages, scenario.sessions)
    else:
        result = await run_load("127.0.0.1", target.port, messages=messages,
                                sessions=scenario.sessions, rcpts=scenario.rcpts,
                                reuse=scenario.reuse, prefix=f"k{uuid.uuid4().hex[:12]}.",
                                duplicate_every=scenario.duplicate_every,
                                login=login if scenario.login else None)
    drained = await asyncio.to_thread(target.drain)
    wall = time.perf_counter() - started
    cpu = tree_cpu_s(target.pid) - cpu0
    redis_cpu = tree_cpu_s(store.proc.pid) - redis_cpu0
    pg_cpu = pg_cpu_s(pg) - pg_cpu0
    stop.set()
    await sampler
    ok = max(result.accepted, 1)
    lat = sorted(x * 1000 for x in result.latencies_s)
    p50 = p99 = float("nan")
    if len(lat) >= 2:
        q = statistics.quantiles(lat, n=100, method="inclusive")
        p50, p99 = q[49], q[98]
    return Cell(rate=result.accepted / wall, p50_ms=p50, p99_ms=p99, cpu_ms=cpu * 1000 / ok,
                rss_mib=peak[0], pss_mib=peak[1],
                redis_cpu_ms=redis_cpu * 1000 / ok if target.uses_redis else None,
                failed=result.sent - result.accepted + (0 if drained else result.accepted),
                pg_cpu_ms=pg_cpu * 1000 / ok if target.uses_postgres else None)


# --------------------------------------------------------------------------- report


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.{digits}f}"


def _spread(xs: list[float], digits: int = 1) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    low, high = _fmt(min(xs), digits), _fmt(max(xs), digits)
    return f"{_fmt(statistics.median(xs), digits)} ({low}-{high})"


def _ratio(x: float, ref: float) -> str:
    if x != x or ref != ref or ref == 0:
        return "-"
    return f"{x / ref:.2f}"


METRICS: list[tuple[str, str, int]] = [
    ("msgs/s", "rate", 0), ("p50 ms", "p50_ms", 1), ("p99 ms", "p99_ms", 1),
    ("CPU ms/msg", "cpu_ms", 2), ("peak RSS MiB", "rss_mib", 0), ("peak PSS MiB", "pss_mib", 0),
    ("Redis CPU ms/msg", "redis_cpu_ms", 2), ("PostgreSQL CPU ms/msg", "pg_cpu_ms", 2),
]


def values(cells: list[Cell], attr: str) -> list[float]:
    """The non-missing values of ``attr`` over ``cells``."""
    out = []
    for cell in cells:
        v = getattr(cell, attr)
        if v is not None:
            out.append(float(v))
    return out


def tables(results: dict[tuple[str, str], list[Cell]], targets: list[Target],
           scenarios: list[Scenario]) -> Iterator[str]:
    """Markdown lines: per scenario, the medians with spreads, then the ratios."""
    for sc in scenarios:
        yield f"### {sc.name}"
        yield ""
        yield "| target | " + " | ".join(m[0] for m in METRICS) + " | failed |"
        yield "|---" * (len(METRICS) + 2) + "|"
        for t in targets:
            cells = results.get((t.name, sc.name), [])
            if not t.takes(sc):
                continue
            row = [_spread(values(cells, attr), d) for _, attr, d in METRICS]
            yield f"| {t.name} | " + " | ".join(row) + f" | {sum(c.failed for c in cells)} |"
        yield ""
        ratio_metrics = METRICS[:6]
        yield ("| ratio of medians: x Postfix / x naive | "
               + " | ".join(m[0] for m in ratio_metrics) + " |")
        yield "|---" * (len(ratio_metrics) + 1) + "|"
        pf = results.get(("Postfix", sc.name), [])
        nv = results.get(("naive relay", sc.name), [])
        for t in targets:
            cells = results.get((t.name, sc.name), [])
            if not t.takes(sc):
                continue
            row = []
            for _, attr, _ in ratio_metrics:
                x = _med(values(cells, attr))
                row.append(f"{_ratio(x, _med(values(pf, attr)))} / "
                           f"{_ratio(x, _med(values(nv, attr)))}")
            yield f"| {t.name} | " + " | ".join(row) + " |"
        yield ""


def version(cmd: list[str], pattern: str = r"(\d+\.\d+(\.\d+)?)") -> str:
    """The first version number in ``cmd``'s output."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except OSError:
        return "?"
    m = re.search(pattern, out.stdout + out.stderr)
    return m.group(1) if m else "?"


def machine() -> list[str]:
    """Lines describing this machine and the software versions."""
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    redis_version = version(["redis-server", "--version"], r"v=(\S+)")
    return [
        f"- CPUs: {os.cpu_count()} x {model}",
        f"- kernel: {platform.release()}",
        f"- Python: {platform.python_version()}",
        f"- Postfix: {version(['/usr/sbin/postconf', '-d', 'mail_version'])}",
        f"- Redis: {redis_version}",
        f"- PostgreSQL: {postgres_version()}",
    ]


def memory_table(memory: dict[str, FpMemory]) -> Iterator[str]:
    """Markdown lines: Redis bytes per fingerprint, with the ratio to the naive relay."""
    naive = memory.get("naive relay")
    yield "| target | fingerprints added | `used_memory` B/fp | x naive | dataset B/fp |"
    yield "|---|---|---|---|---|"
    for name, m in memory.items():
        ratio = _ratio(m.used_b_per_fp, naive.used_b_per_fp) if naive else "-"
        yield (f"| {name} | {m.keys} | {m.used_b_per_fp:.0f} | {ratio} | "
               f"{m.dataset_b_per_fp:.0f} |")
    yield ""


NEW_1 = SCENARIOS[0].name
NEW_5 = SCENARIOS[1].name
SEQUENTIAL = SCENARIOS[3].name
LOGIN = SCENARIOS[6].name


def verdicts(results: dict[tuple[str, str], list[Cell]],
             memory: dict[str, FpMemory]) -> Iterator[str]:
    """Markdown lines: each target of the benchmark, the measured ratio of medians, met or not."""
    def med(target: str, scenario: str, attr: str) -> float:
        return _med(values(results.get((target, scenario), []), attr))

    rows: list[tuple[str, float, str, bool]] = []  # (what, measured, target, met)

    def ratio(what: str, x: float, ref: float, want: float, *, at_most: bool = False) -> None:
        r = x / ref if ref == ref and ref and x == x else float("nan")
        met = r == r and (r <= want if at_most else r >= want)
        rows.append((what, r, f"{'<=' if at_most else '>='} {want:g}", met))

    redis_, sqlite_, pg_ = "dedup-relay, Redis", "dedup-relay, SQLite", "dedup-relay, PostgreSQL"
    one = "dedup-relay, Redis, --workers 1"
    for sc in SCENARIOS:
        if (one, sc.name) in results:
            ratio(f"{sc.name}: Redis CPU ms/msg, default workers x --workers 1",
                  med(redis_, sc.name, "cpu_ms"), med(one, sc.name, "cpu_ms"), 1.1,
                  at_most=True)
    ratio(f"{NEW_1}: Redis CPU ms/msg x naive", med(redis_, NEW_1, "cpu_ms"),
          med("naive relay", NEW_1, "cpu_ms"), 1.0, at_most=True)
    ratio(f"{NEW_1}: Redis msgs/s x naive", med(redis_, NEW_1, "rate"),
          med("naive relay", NEW_1, "rate"), 1.0)
    ratio(f"{NEW_1}: Redis msgs/s x Postfix", med(redis_, NEW_1, "rate"),
          med("Postfix", NEW_1, "rate"), 2.5)
    ratio(f"{NEW_1}: SQLite msgs/s x Postfix", med(sqlite_, NEW_1, "rate"),
          med("Postfix", NEW_1, "rate"), 2.0)
    for name in (redis_, sqlite_, pg_):
        ratio(f"{SEQUENTIAL}: {name.split(', ')[1]} p50 x Postfix",
              med(name, SEQUENTIAL, "p50_ms"), med("Postfix", SEQUENTIAL, "p50_ms"), 1.0,
              at_most=True)
    ratio(f"{LOGIN}: Redis msgs/s x naive", med(redis_, LOGIN, "rate"),
          med("naive relay", LOGIN, "rate"), 0.8)
    ratio(f"{NEW_1}: PostgreSQL msgs/s x Postfix", med(pg_, NEW_1, "rate"),
          med("Postfix", NEW_1, "rate"), 1.5)
    ratio(f"{NEW_5}: PostgreSQL msgs/s x Postfix", med(pg_, NEW_5, "rate"),
          med("Postfix", NEW_5, "rate"), 1.0)
    yield "| target | measured (ratio of medians) | wanted | met |"
    yield "|---|---|---|---|"
    for what, r, want, met in rows:
        yield f"| {what} | {_fmt(r, 2)} | {want} | {'yes' if met else '**no**'} |"
    for name, m in memory.items():
        if name.startswith("dedup-relay"):
            ok = m.used_b_per_fp <= 160
            yield (f"| Redis `used_memory` per fingerprint, {name} | {m.used_b_per_fp:.0f} B | "
                   f"<= 160 B | {'yes' if ok else '**no**'} |")
    yield ""


def render(command: str, plan: Plan, results: dict[tuple[str, str], list[Cell]],
           memory: dict[str, FpMemory], minutes: float) -> str:
    """The generated section of docs/benchmarks.md."""
    reps, counts = plan.reps, plan.counts
    lines = [
        BEGIN,
        "## Relay throughput against Postfix (`bench/run.py`)",
        "",
        *(([plan.label, ""]) if plan.label else []),
        f"Command: `{command}`, run {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}, "
        f"{reps} interleaved repetitions (target order shuffled in each), {minutes:.1f} minutes.",
        "",
        *machine(),
        "",
        "The load generator (`bench/load.py`, one Python process; Postfix's `smtp-source` in the",
        "last scenario), the target, Redis and the sink (Postfix's `smtp-sink`) share these cores,",
        "so absolute rates are low: read the ratios. Messages are 2 KB with a unique",
        "`X-Dedupe-Key` per message (the 50 % mix repeats every second key 41 messages later).",
        "Messages per cell: " + ", ".join(f"{n} ({s})" for s, n in counts.items()) + ".",
        "",
        "Cells: median over the repetitions (min-max). msgs/s counts accepted messages over the",
        "cell's wall time, for Postfix until its queue is empty (everything reached the sink).",
        "Latency: connect (or MAIL on a reused connection) to the reply to the final dot. CPU:",
        "user + system time of the target's processes (`/proc/PID/stat`, Postfix's whole process",
        "tree including exited children) per accepted message; Redis CPU is the private",
        "`redis-server`'s and PostgreSQL CPU the private PostgreSQL server's (postmaster,",
        "backends, WAL writer, checkpointer...), each in its own column, not in the target's",
        "CPU. Peak RSS and PSS: sums over",
        "the target's processes, sampled every 0.2 s (the RSS sum counts pages shared by Postfix's",
        "processes once per process, PSS splits them). 'sink alone' is the load sent straight to",
        "`smtp-sink`: the ceiling of this load generator and sink on this machine (its CPU is the",
        "sink's). 'failed': messages not accepted (4xx/5xx/errors) over all repetitions. Each",
        f"target gets {WARM_UP_MESSAGES} unmeasured messages after it starts. The ratio tables",
        "divide the medians by Postfix's and by the naive relay's (below 1 is better for",
        "latency, CPU and memory, above 1 for msgs/s).",
        "",
        "Targets: Postfix " + version(["/usr/sbin/postconf", "-d", "mail_version"])
        + " as a private instance (its own `config_directory` and `queue_directory` under a temp",
        "dir, Debian's binaries, `relayhost = [127.0.0.1]:SINK`, `mynetworks = 127.0.0.0/8`,",
        "default process limits, logging to a file through `postlogd`); the naive relay",
        "(`bench/naive_relay.py`: one aiosmtpd process, one `SET NX PX` per recipient, up to 20",
        "pooled aiosmtplib upstream connections); dedup-relay as committed, its defaults except",
        "`--max-connections-per-ip 200`, `--log-level WARNING`, `--metrics-listen off`, with the",
        "private Redis, a fresh SQLite file or a fresh database on a private PostgreSQL",
        f"{postgres_version()} server (its schema from `dedup-relay db upgrade`; PostgreSQL's",
        "default durability, `fsync = on` and `synchronous_commit = on`: every store call's",
        "commit waits for its WAL flush, as a durable store must): by default one worker per",
        f"CPU ({os.cpu_count()}), once with `--workers 1` (Redis), and once on asyncio's event",
        "loop instead of uvloop (`--event-loop asyncio`, Redis).",
        "",
        "Postfix runs with its defaults, `in_flow_delay = 1s` included: when its queue manager",
        "falls behind, `smtpd` holds a message up to 1 s before accepting it, which is Postfix's",
        "p99 of about 1000 ms under 20 sessions (checked on 2026-12-01 with a private instance as",
        "here: with `in_flow_delay = 0s` its p99 was 47 ms and its p50 22 ms for 1500 messages,",
        "20 sessions, a new connection each). Its latency is to its queue, not to the sink.",
        "",
        "### Against the targets",
        "",
        *verdicts(results, memory),
        *tables(results, [t for t in plan.targets if not t.memory_only], plan.scenarios),
        "### Redis memory per fingerprint",
        "",
        "After the repetitions, each Redis target once: the private Redis flushed, then",
        f"{plan.fp_keys} unique 1-recipient messages over 20 reused connections; the growth of",
        "`INFO memory` `used_memory` (and of `used_memory_dataset`, which leaves out client",
        "buffers and other overhead) over the keys added. Key prefixes are as long as the default",
        "`email:fp:`. Postfix keeps no fingerprints.",
        "",
        *memory_table(memory),
        END,
    ]
    return "\n".join(lines) + "\n"


def write_doc(section: str) -> None:
    """Replace (or insert at the top) the generated section of docs/benchmarks.md."""
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        text = head + section + "\n" + tail
    else:
        head, sep, tail = text.partition("\n## ")
        rest = sep.lstrip("\n") + tail if sep else ""
        text = (head.rstrip("\n") + "\n\n" + section + "\n" + rest).rstrip("\n") + "\n"
    DOC.write_text(text)


# --------------------------------------------------------------------------- main


@dataclass
class Plan:
    """What to run: targets, scenarios with their message counts, repetitions."""

    targets: list[Target]
    scenarios: list[Scenario]
    counts: dict[str, int] = field(default_factory=dict)
    reps: int = 3
    fp_keys: int = 20_000
    label: str = ""


def make_plan(args: argparse.Namespace) -> Plan:
    """Targets and scenarios from the command line."""
    targets = [
        Target("sink alone", "sink"),
        Target("Postfix", "postfix"),
        Target("naive relay", "naive", uses_redis=True),
        Target("dedup-relay, Redis", "relay-redis", uses_redis=True),
        Target("dedup-relay, SQLite", "relay-sqlite"),
        Target("dedup-relay, PostgreSQL", "relay-postgres", uses_postgres=True),
        Target("dedup-relay, Redis, --workers 1", "relay-redis", workers=1, uses_redis=True),
        Target("dedup-relay, Redis, asyncio loop", "relay-redis", uses_redis=True,
               flags=("--event-loop", "asyncio")),
        Target("dedup-relay, Redis, compact keys", "relay-redis", uses_redis=True,
               flags=("--store-key-format", "compact"), memory_only=True),
    ]
    for n in args.relay_workers or []:
        targets.append(Target(f"dedup-relay, Redis, --workers {n}", "relay-redis", workers=n,
                              uses_redis=True))
        targets.append(Target(f"dedup-relay, SQLite, --workers {n}", "relay-sqlite", workers=n))
        targets.append(Target(f"dedup-relay, PostgreSQL, --workers {n}", "relay-postgres",
                              workers=n, uses_postgres=True))
    scale = 0.2 if args.quick else args.scale
    scenarios = SCENARIOS
    counts = {s.name: max(20, int(s.messages * scale)) for s in scenarios}
    fp_keys = 20_000 if args.quick else max(1000, int(FP_KEYS * scale))
    return Plan(targets, scenarios, counts, args.reps, fp_keys, args.label)


@dataclass
class FpMemory:
    """Redis memory per fingerprint of one target: growth in bytes over ``keys`` new keys."""

    keys: int
    used_b_per_fp: float
    dataset_b_per_fp: float


async def fp_memory(target: Target, sink: Sink, store: PrivateRedis, messages: int) -> FpMemory:
    """Flush the private Redis, relay ``messages`` unique 1-recipient messages, measure growth."""
    store.client.flushall()
    try:
        target.start(sink, store)
        await asyncio.sleep(1.0)
        before = store.memory()
        await run_load("127.0.0.1", target.port, messages=messages, sessions=20, rcpts=1,
                       reuse=True, prefix=f"m{uuid.uuid4().hex[:12]}.")
        await asyncio.sleep(0.5)
        after = store.memory()
    finally:
        target.stop()
    keys = after[2] - before[2]
    return FpMemory(keys, (after[0] - before[0]) / max(keys, 1),
                    (after[1] - before[1]) / max(keys, 1))


async def warm_up(target: Target, messages: int = WARM_UP_MESSAGES) -> None:
    """Unmeasured load after a start (processes forked, connections and caches warm)."""
    await run_load("127.0.0.1", target.port, messages=messages, sessions=20, rcpts=1,
                   reuse=False, prefix=f"w{uuid.uuid4().hex[:12]}.")
    await asyncio.to_thread(target.drain)


async def run(plan: Plan, seed: int) -> tuple[dict[tuple[str, str], list[Cell]],
                                              dict[str, FpMemory]]:
    """All repetitions, then the Redis memory per fingerprint of the Redis targets.

    Returns the cells by (target name, scenario name) and the memory figures by target name.
    """
    rng = random.Random(seed)
    results: dict[tuple[str, str], list[Cell]] = {}
    memory: dict[str, FpMemory] = {}
    workdir = Path(tempfile.mkdtemp(prefix="bench-run-"))
    login = LoginFiles.make(workdir)
    sink = Sink()
    store = PrivateRedis(workdir)
    pg: PrivatePostgres | None = None
    try:
        if any(t.uses_postgres for t in plan.targets):
            pg = PrivatePostgres(schema=False)
            pg.start()
        for rep in range(plan.reps):
            order = [t for t in plan.targets if not t.memory_only]
            rng.shuffle(order)
            print(f"repetition {rep + 1}/{plan.reps}: {', '.join(t.name for t in order)}")
            for target in order:
                try:
                    target.start(sink, store, pg, login)
                    await warm_up(target)
                    for sc in plan.scenarios:
                        if not target.takes(sc):
                            continue
                        cell = await measure(target, sc, plan.counts[sc.name], store, pg,
                                             login.login)
                        results.setdefault((target.name, sc.name), []).append(cell)
                        print(f"  {target.name:34} {sc.name[:52]:52} {cell.rate:7.0f} msg/s "
                              f"p50 {_fmt(cell.p50_ms)} ms cpu {cell.cpu_ms:.2f} ms/msg"
                              f" failed {cell.failed}", flush=True)
                        if cell.failed:
                            print(target.log_tail(), flush=True)
                finally:
                    target.stop()
        for target in plan.targets:
            if target.uses_redis:
                memory[target.name] = await fp_memory(target, sink, store, plan.fp_keys)
                print(f"  {target.name}: {memory[target.name]}", flush=True)
    finally:
        if pg is not None:
            pg.close()
        store.stop()
        sink.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return results, memory


def main() -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true",
                        help="a fifth of the messages per cell, 20,000 fingerprints (about 6 min)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every cell's message count (full run: 1.0)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (>= 3)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the target order")
    parser.add_argument("--relay-workers", type=int, nargs="*", metavar="N",
                        help="also run dedup-relay with --workers N (beside the default, one "
                             "worker per CPU, and --workers 1)")
    parser.add_argument("--label", default="",
                        help="a paragraph put at the top of the generated section")
    parser.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args()
    for tool in (SMTP_SINK, SMTP_SOURCE, POSTFIX):
        if not Path(tool).exists():
            sys.exit(f"bench: {tool} is missing (apt-get install postfix)")
    if os.geteuid() != 0:
        sys.exit("bench: the private Postfix instance needs root")
    plan = make_plan(args)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results, memory = asyncio.run(run(plan, seed))
    minutes = (time.monotonic() - started) / 60
    command = "python -m bench.run" + (" --quick" if args.quick else "")
    if args.scale != 1.0 and not args.quick:
        command += f" --scale {args.scale}"
    if args.reps != 3:
        command += f" --reps {args.reps}"
    section = render(command, plan, results, memory, minutes)
    print(section)
    if not args.no_write:
        write_doc(section)
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
