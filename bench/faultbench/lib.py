"""The fault bench's servers: a faulty upstream sink (aiosmtpd, in the bench's loop), a
bench-owned redis-server or PostgreSQL server, and `python -m relay serve` processes.

The traffic and the checker are in ``bench.faultbench.traffic``, the runs that combine them in
``bench.faultbench.scenarios``; ``tests/system/stores/test_faults.py`` (short) and
``tools/faultbench.py`` (long) drive those. Loopback only, every wait bounded; each process
started here is also killed at interpreter exit when a caller's ``finally`` could not run
(a test timeout).

The sink logs one JSON line per recipient of every message it accepted (``sink.jsonl``):
``{"rcpt": ..., "key": <X-Dedupe-Key>, "t": <unix time>}``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio
from aiosmtpd.smtp import SMTP, Envelope, Session

from tests.support.private_postgres import PrivatePostgres

REPO = Path(__file__).resolve().parents[2]
_KEY_HEADER = re.compile(rb"^X-Dedupe-Key:[ \t]*(.*?)\r?$", re.I | re.M)
_CHILD_PIDS: set[int] = set()
_PAUSES: set[asyncio.Task[None]] = set()  # DEBUG SLEEP calls still running


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@atexit.register
def _kill_leftover_children() -> None:
    """Last resort: kill the processes a caller could not stop (by pid, ours only)."""
    for pid in list(_CHILD_PIDS):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def _spawn(*argv: str, env: dict[str, str] | None, log_path: Path,
                 new_session: bool = False) -> asyncio.subprocess.Process:
    with log_path.open("ab") as log_file:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, cwd=log_path.parent, stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file, stderr=log_file, start_new_session=new_session)
    _CHILD_PIDS.add(proc.pid)
    return proc


async def _end(proc: asyncio.subprocess.Process, sig: int, wait_s: float) -> int:
    """Send ``sig`` (unless it exited), wait up to ``wait_s``, then SIGKILL; return the code."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            await asyncio.wait_for(proc.wait(), wait_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await asyncio.wait_for(proc.wait(), 10)
    _CHILD_PIDS.discard(proc.pid)
    return int(proc.returncode if proc.returncode is not None else -1)


async def _group_gone(group: int, within_s: float = 10.0) -> None:
    """Wait until no process of the process group ``group`` is left (workers exit after their
    supervisor; the next relay binds the same port)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.02)


async def wait_for_port(port: int, proc: asyncio.subprocess.Process | None,
                        timeout_s: float = 15.0) -> None:
    """Wait until 127.0.0.1:port accepts; raise if ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.returncode is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode}")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1)
        except (OSError, TimeoutError):
            await asyncio.sleep(0.05)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return
    raise RuntimeError(f"nothing accepts on 127.0.0.1:{port} after {timeout_s} s")


@dataclass
class BenchSqlite:
    """The embedded store of a run: a SQLite file in ``work_dir`` (no server to start)."""

    work_dir: Path

    @property
    def url(self) -> str:
        return f"sqlite:///{self.work_dir / 'dedup.db'}"

    async def start(self) -> None:
        """Make the folder the file goes in."""
        await asyncio.to_thread(self.work_dir.mkdir, parents=True, exist_ok=True)

    async def stop(self) -> None:
        """Nothing runs: the file stays."""

    async def close(self) -> None:
        """Nothing runs: the file stays."""


# ------------------------------------------------------------------------------------------
# the upstream sink
# ------------------------------------------------------------------------------------------


DECK = 20  # fates are dealt in shuffled blocks of 20 transactions: ratios are exact per block


@dataclass(frozen=True)
class Faults:
    """What the sink does to each transaction (MAIL to final dot; retries are transactions too).

    Ratios are exact shares of every block of ``DECK`` transactions (in random order), so a
    short run sees each fault; they are rounded to multiples of 1 / ``DECK``.

    ``temp_ratio``: 451 to the final dot (not taken), or for one recipient at RCPT.
    ``perm_ratio``: 554 to the final dot (not taken).
    ``hang_ratio``: take the message, then send no reply for ``hang_s`` (longer than the
    relay's upstream timeout: the relay sees the RFC 1047 case, the message IS delivered).
    ``drop_ratio``: close the connection at the first RCPT (before any data).
    ``slow_s``: every MAIL/RCPT/DATA reply is delayed by up to this many seconds.
    ``stall_ratio``: that exact share of the transactions declaring ``SIZE`` of at least
    ``stall_min_bytes`` (the first of them included) gets its
    ``354`` and then nothing is read from the socket for ``stall_s`` (a stalled link: the
    message backs up in the relay's buffers; the sink's receive buffer is kept small).
    ``late_354_ratio``: that exact share of the transactions (the first included) gets its
    ``354`` only ``late_354_s`` after DATA (data-phase policy checks, a tarpit).
    """

    temp_ratio: float = 0.0
    perm_ratio: float = 0.0
    hang_ratio: float = 0.0
    hang_s: float = 3.0
    drop_ratio: float = 0.0
    slow_s: float = 0.0
    stall_ratio: float = 0.0
    stall_min_bytes: int = 1_000_000
    stall_s: float = 2.0
    late_354_ratio: float = 0.0
    late_354_s: float = 0.0


@dataclass
class _Plan:
    fate: str  # ok | temp_dot | temp_rcpt | perm | hang | drop
    rcpts_seen: int = 0
    stall: bool = False  # no reads for Faults.stall_s after the 354
    late_354: bool = False  # the 354 comes Faults.late_354_s after DATA


class BenchSink:
    """aiosmtpd handler of the faulty smarthost; logs every accepted (recipient, key)."""

    def __init__(self, faults: Faults, log_path: Path, seed: int) -> None:
        self.faults = faults
        self.log_path = log_path
        self._rng = random.Random(seed)
        self._plans: dict[int, _Plan] = {}
        self._deck: list[str] = []
        self._hold: tuple[asyncio.Event, float, str] | None = None
        self._big = 0  # transactions that declared SIZE >= stall_min_bytes
        self._transactions = 0  # MAIL commands seen (the late 354s are an exact share)
        self._stalled: list[asyncio.ReadTransport] = []  # links stalled now (release_stalls)
        self._stalls_on = True
        self.fates: Counter[str] = Counter()
        self.held_keys: list[str] = []
        log_path.touch()

    def hold_next(self, hold_s: float, *, refuse: str = "") -> asyncio.Event:
        """Hold the reply to the next message taken for ``hold_s``; the event says it was taken.
        With ``refuse`` (a reply, e.g. ``451 4.3.0 ...``) that message is answered so after
        the hold and not taken (not logged).

        Lets a fault hit the relay at a chosen moment: upstream has the message, the relay
        waits for the reply to its final dot.
        """
        self._hold = (asyncio.Event(), hold_s, refuse)
        return self._hold[0]

    def _draw(self) -> str:
        """The next transaction's fate, dealt from shuffled blocks of ``DECK`` fates."""
        if not self._deck:
            f = self.faults
            for fate, ratio in (("drop", f.drop_ratio), ("hang", f.hang_ratio),
                                ("perm", f.perm_ratio), ("temp", f.temp_ratio)):
                self._deck += [fate] * round(ratio * DECK)
            self._deck += ["ok"] * max(0, DECK - len(self._deck))
            self._rng.shuffle(self._deck)
        fate = self._deck.pop()
        if fate == "temp":
            return self._rng.choice(("temp_dot", "temp_rcpt"))
        return fate

    def release_stalls(self) -> None:
        """End every stall now (the links read again) and stall no transaction from now on."""
        self._stalls_on = False
        for transport in self._stalled:
            _resume_reading(transport)
        self._stalled.clear()

    def stalled(self, transport: asyncio.ReadTransport) -> None:
        """``transport``'s link stalls now (see :meth:`release_stalls`)."""
        self._stalled.append(transport)

    def _stalls(self, options: list[str]) -> bool:
        """Whether a transaction with these MAIL parameters stalls its link after the 354."""
        f = self.faults
        if not self._stalls_on:
            return False
        sizes = [int(o[5:]) for o in options if o.upper().startswith("SIZE=") and o[5:].isdigit()]
        if not (sizes and sizes[0] >= f.stall_min_bytes and f.stall_ratio > 0):
            return False
        # An exact share, first big transaction included (a random draw left a short run
        # with no stall at all about once in 32).
        self._big += 1
        return math.ceil(self._big * f.stall_ratio) > math.ceil((self._big - 1) * f.stall_ratio)

    def _late_354(self) -> bool:
        """Whether this transaction's 354 comes late (an exact share, the first included)."""
        ratio = self.faults.late_354_ratio
        self._transactions += 1
        n = self._transactions
        return ratio > 0 and math.ceil(n * ratio) > math.ceil((n - 1) * ratio)

    def late_354_s(self, envelope: Envelope) -> float:
        """Seconds this transaction's 354 waits after DATA (0: it does not)."""
        plan = self._plans.get(id(envelope))
        return self.faults.late_354_s if plan is not None and plan.late_354 else 0.0

    def stall_s(self, envelope: Envelope) -> float:
        """Seconds the link stalls after this transaction's 354 (0: it does not)."""
        plan = self._plans.get(id(envelope))
        return self.faults.stall_s if plan is not None and plan.stall else 0.0

    async def _slow(self) -> None:
        if self.faults.slow_s:
            await asyncio.sleep(self._rng.uniform(0, self.faults.slow_s))

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        await self._slow()
        plan = _Plan(fate=self._draw(), stall=self._stalls(options),
                     late_354=self._late_354())
        self._plans[id(envelope)] = plan
        self.fates["stall" if plan.stall else plan.fate] += 1
        envelope.mail_from = address
        envelope.mail_options.extend(options)
        return "250 2.1.0 OK"

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        await self._slow()
        plan = self._plans.get(id(envelope), _Plan("ok"))
        plan.rcpts_seen += 1
        if plan.fate == "drop" and server.transport is not None:
            server.transport.close()
            return "421 4.4.2 bench: dropping the connection"
        if plan.fate == "temp_rcpt" and plan.rcpts_seen == 1:
            return "451 4.3.0 bench: recipient temporarily refused"
        envelope.rcpt_tos.append(address)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        await self._slow()
        plan = self._plans.pop(id(envelope), _Plan("ok"))
        if plan.fate == "temp_dot":
            return "451 4.3.0 bench: temporary failure"
        if plan.fate == "perm":
            return "554 5.6.0 bench: permanent failure"
        if self._hold is not None and self._hold[2]:  # held, then refused: not taken
            taken, hold_s, refusal = self._hold
            self._hold = None
            self.held_keys.append(_key_of(envelope))
            taken.set()
            await asyncio.sleep(hold_s)
            return refusal
        key = self._log(envelope)  # taken: logged before the reply, as a real MTA queues it
        if self._hold is not None:
            taken, hold_s, _refusal = self._hold
            self._hold = None
            self.held_keys.append(key)
            taken.set()
            await asyncio.sleep(hold_s)
        if plan.fate == "hang":
            await asyncio.sleep(self.faults.hang_s)
        return "250 2.0.0 Ok: queued as BENCH"

    def _log(self, envelope: Envelope) -> str:
        key = _key_of(envelope)
        with self.log_path.open("a", encoding="utf-8") as out:
            for rcpt in envelope.rcpt_tos:
                out.write(json.dumps({"rcpt": rcpt.lower(), "key": key, "t": time.time()}) + "\n")
        return key


def _key_of(envelope: Envelope) -> str:
    """The X-Dedupe-Key of the message in ``envelope`` ("" when it has none)."""
    head = (envelope.original_content or b"").split(b"\r\n\r\n", 1)[0]
    match = _KEY_HEADER.search(head)
    return match.group(1).decode(errors="replace").strip() if match else ""


@dataclass
class Sink:
    """A running sink: ``port`` for the relays, ``handler`` for its log and counters."""

    handler: BenchSink
    port: int
    server: asyncio.base_events.Server

    def close(self) -> None:
        self.server.close()


class _StallingSMTP(SMTP):
    """aiosmtpd's SMTP whose ``354`` comes late, or whose link stalls after it, when the
    handler says so."""

    async def smtp_DATA(self, arg: str) -> None:
        handler, transport = self.event_handler, self.transport
        bench = isinstance(handler, BenchSink) and self.envelope is not None
        late_s = handler.late_354_s(self.envelope) if bench else 0.0
        if late_s:
            await asyncio.sleep(late_s)
        stall_s = handler.stall_s(self.envelope) if bench else 0.0
        if stall_s and isinstance(transport, asyncio.ReadTransport):
            transport.pause_reading()
            handler.stalled(transport)
            asyncio.get_running_loop().call_later(stall_s, _resume_reading, transport)
        await super().smtp_DATA(arg)


def _resume_reading(transport: asyncio.BaseTransport) -> None:
    if isinstance(transport, asyncio.ReadTransport) and not transport.is_closing():
        transport.resume_reading()


async def start_sink(faults: Faults, log_path: Path, *, seed: int = 1) -> Sink:
    """Serve a BenchSink on 127.0.0.1 (a free port) in the running loop; with stalls, its
    receive buffer is fixed at 64 KiB (else the kernel grows it to hold whole messages)."""
    handler = BenchSink(faults, log_path, seed)
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    if faults.stall_ratio:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.bind(("127.0.0.1", 0))
    server = await loop.create_server(
        lambda: _StallingSMTP(handler, hostname="sink.bench", decode_data=False,
                              enable_SMTPUTF8=True), sock=sock)
    return Sink(handler=handler, port=server.sockets[0].getsockname()[1], server=server)


# ------------------------------------------------------------------------------------------
# the store: a redis-server the bench owns (AOF, like the compose stack)
# ------------------------------------------------------------------------------------------


def _libfaketime() -> str:
    """The libfaketime library (Debian package faketime), preloaded into the relay process
    itself: the ``faketime`` command would run the relay as its child, which a signal to the
    tracked pid would not reach."""
    for path in ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
                 "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
                 "/usr/lib/faketime/libfaketime.so.1"):
        if Path(path).exists():
            return path
    raise RuntimeError("libfaketime is not installed (Debian package faketime)")


@dataclass
class BenchRedis:
    """A redis-server on a free loopback port with AOF (fsync always) in ``data_dir``.

    ``stop`` is a graceful shutdown (SIGTERM: Redis flushes the AOF); ``start`` brings it
    back on the same port with the same data, as a restarted production Redis would be.
    """

    data_dir: Path
    port: int = field(default_factory=free_port)
    proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (.ci/run installs it)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = await _spawn(
            exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
            "--save", "", "--appendonly", "yes", "--appendfsync", "always",
            "--enable-debug-command", "local",
            "--maxmemory-policy", "noeviction", env=None,
            log_path=self.data_dir / "redis.log")
        client = redis.asyncio.Redis(port=self.port, socket_timeout=0.5)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with contextlib.suppress(redis.RedisError, OSError):
                    if await client.ping():
                        return
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()
        raise RuntimeError(f"bench redis-server on port {self.port} did not start")

    async def stop(self) -> None:
        if self.proc is not None:
            await _end(self.proc, signal.SIGTERM, 10)
            self.proc = None

    async def close(self) -> None:
        """The end of the run: a graceful stop (the data dir is the run's)."""
        await self.stop()

    async def pause(self, seconds: float) -> None:
        """Make the server answer nothing for ``seconds`` (DEBUG SLEEP: a stalled Redis); returns
        at once, the pause goes on."""
        client = redis.asyncio.Redis(port=self.port, socket_timeout=seconds + 5)

        async def sleep() -> None:
            try:
                await client.execute_command("DEBUG", "SLEEP", f"{seconds:g}")
            finally:
                await client.aclose()

        task = asyncio.create_task(sleep())
        _PAUSES.add(task)
        task.add_done_callback(_PAUSES.discard)
        await asyncio.sleep(0.05)  # the DEBUG SLEEP reached the server


@dataclass
class BenchPostgres:
    """A private PostgreSQL server of the run (``tests/support/private_postgres.py``: a copy of
    a template cluster holding the store's schema, fsync and synchronous_commit on, a free
    port), driven from the bench's loop; its log is copied to ``work_dir/postgres.log`` at
    :meth:`close`. Each call waits ``pg_ctl``'s bounded wait at most, in a thread.
    """

    work_dir: Path
    server: PrivatePostgres | None = None

    @property
    def url(self) -> str:
        if self.server is None:
            raise RuntimeError("the bench PostgreSQL was never started")
        return self.server.url

    async def start(self) -> None:
        """Start the server (creating its cluster the first time) and wait until it accepts."""
        if self.server is None:
            self.server = await asyncio.to_thread(PrivatePostgres)
        await asyncio.to_thread(self.server.start)

    async def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m MODE`` (``fast``: clean shutdown; ``immediate``: no checkpoint)."""
        if self.server is not None:
            await asyncio.to_thread(self.server.stop, mode)

    async def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m MODE``, same port and data."""
        if self.server is not None:
            await asyncio.to_thread(self.server.restart, mode)

    async def kill(self) -> None:
        """SIGKILL to the postmaster; returns once every process of the server is gone."""
        if self.server is not None:
            await asyncio.to_thread(self.server.kill)

    async def close(self) -> None:
        """Stop the server whatever state it is in, keep its log, remove its cluster."""
        if self.server is None:
            return
        server, self.server = self.server, None
        await asyncio.to_thread(server.close, log_to=self.work_dir / "postgres.log")


# ------------------------------------------------------------------------------------------
# relay processes
# ------------------------------------------------------------------------------------------


def log_entries(paths: Iterable[Path]) -> Iterator[dict[str, object]]:
    """The JSON objects the relay logs at ``paths`` hold, in order (other lines, and files
    not there, skipped)."""
    for path in paths:
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if isinstance(entry, dict):
                        yield entry


@dataclass(frozen=True)
class RelayConfig:
    """How the bench runs ``python -m relay serve`` (durations in seconds).

    The lease outlives the worst upstream transaction (connect + 4 commands + final dot =
    0.5 + 2 + 1 = 3.5 s), so only a relay that died holds a reservation past its lease.
    """

    lease_s: float = 5.0
    upstream_timeout_s: float = 1.0
    command_timeout_s: float = 0.5
    connect_timeout_s: float = 0.5
    store_timeout_s: float = 1.0
    shutdown_grace_s: float = 5.0
    unknown_policy: str = "suppress"
    workers: int = 2  # worker processes under a supervisor; 1: one process
    in_flight_wait_s: float = 15.0  # a copy of a key in flight waits this long (0: 450 at once)


@dataclass
class RelayProcess:
    """One ``python -m relay serve`` process on ``port``; its log goes to ``log_path``."""

    port: int
    upstream_port: int
    store_url: str
    store_prefix: str
    log_path: Path
    config: RelayConfig = field(default_factory=RelayConfig)
    proc: asyncio.subprocess.Process | None = None
    exit_codes: list[int] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)  # more RELAY_* settings
    clock_offset_s: float = 0.0  # run under faketime with the wall clock this far off

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        c = self.config
        env.update({
            "RELAY_STORE_PREFIX": self.store_prefix,
            "RELAY_HOSTNAME": "relay.bench",
            "RELAY_UPSTREAM_COMMAND_TIMEOUT": str(c.command_timeout_s),
            "RELAY_UPSTREAM_CONNECT_TIMEOUT": str(c.connect_timeout_s),
            "RELAY_STORE_TIMEOUT": str(c.store_timeout_s),
            "RELAY_SHUTDOWN_GRACE": str(c.shutdown_grace_s),
            "RELAY_UNKNOWN_POLICY": c.unknown_policy,
            "RELAY_IN_FLIGHT_WAIT": str(c.in_flight_wait_s),
            "RELAY_LOG_RECIPIENTS": "true",  # the checker's findings name fingerprints
            "RELAY_MAX_CONNECTIONS_PER_IP": "200",  # every bench client is 127.0.0.1
            **self.extra_env,
        })
        if self.clock_offset_s:  # libfaketime: only the wall clock; asyncio's monotonic stays
            env.update({"LD_PRELOAD": _libfaketime(), "FAKETIME": f"{self.clock_offset_s:+g}s",
                        "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"})
        return env

    async def start(self) -> None:
        """Start the process and wait until it accepts SMTP connections."""
        c = self.config
        self.proc = await _spawn(
            sys.executable, "-m", "relay", "serve", "--listen", f"127.0.0.1:{self.port}",
            "--upstream", f"127.0.0.1:{self.upstream_port}", "--store", self.store_url,
            "--metrics-listen", "off", "--lease", str(c.lease_s),
            "--upstream-timeout", str(c.upstream_timeout_s), "--dedup-window", "3600",
            "--log-format", "json", "--workers", str(c.workers), env=self._env(),
            log_path=self.log_path, new_session=True)
        try:
            await wait_for_port(self.port, self.proc)
        except RuntimeError as exc:
            tail = self.log_path.read_text(errors="replace").splitlines()[-5:]
            raise RuntimeError(f"relay on port {self.port} did not start: {exc}; log: {tail}"
                               ) from exc

    async def signal_and_wait(self, sig: int) -> int:
        """Send ``sig``, wait for the exit (grace + 30 s at most: past its grace a relay waits
        up to 5 s for the replies to dots on the wire, then settles them, which takes seconds
        more on a loaded machine), record the exit code."""
        if self.proc is None:
            return -1
        group = self.proc.pid  # its own session: the supervisor and its workers
        if sig == signal.SIGKILL:  # as a service manager kills a unit: every process of it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        code = await _end(self.proc, sig, self.config.shutdown_grace_s + 30)
        await _group_gone(group)
        self.exit_codes.append(code)
        self.proc = None
        return code

    async def stop(self) -> None:
        await self.signal_and_wait(signal.SIGTERM)

    def log_entries(self) -> list[dict[str, object]]:
        """The JSON lines every run of this relay wrote to ``log_path`` so far (others
        skipped)."""
        return list(log_entries([self.log_path]))

    async def logged(self, wanted: Callable[[dict[str, object]], bool], *, count: int = 1,
                     within_s: float = 60.0) -> None:
        """Wait until ``count`` lines of the log satisfy ``wanted`` (polled every 50 ms).
        Raises RuntimeError past ``within_s`` seconds, or when the relay exited meanwhile."""
        deadline = time.monotonic() + within_s
        while sum(map(wanted, self.log_entries())) < count:
            if self.proc is None or self.proc.returncode is not None:
                raise RuntimeError(f"the relay on port {self.port} exited while waiting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the relay on port {self.port} did not log what was "
                                   f"waited for within {within_s:g} s")
            await asyncio.sleep(0.05)
