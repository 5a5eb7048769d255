"""The fault bench's runs: one relay process in front of a faulty sink, a bench-owned Redis
(or PostgreSQL server: the ``pg-*`` scenarios), messages arriving at a steady rate from retrying
clients, and one fault injected mid-load.

:func:`run_scenario` is what ``tests/system/stores/test_faults.py`` (30-60 messages per fault) and
``tools/faultbench.py`` (hundreds, writes docs/reliability.md) both call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.faultbench.lib import (
    BenchPostgres,
    BenchRedis,
    BenchSqlite,
    Faults,
    RelayConfig,
    RelayProcess,
    Sink,
    free_port,
    start_sink,
)
from bench.faultbench.traffic import (
    BenchMessage,
    Counts,
    MessageLog,
    RetryPolicy,
    check,
    deliver,
    make_messages,
)
from tests.support.pg_proxy import PgProxy, start_proxy

FAULT_AT = 0.4  # the fault starts when this share of the arrival spread has passed
SETTLE_S = 1.2  # after the load: upstream transactions still running land at the sink


@dataclass
class Bench:
    """The parts of one run, handed to the fault action."""

    store: BenchRedis | BenchPostgres | BenchSqlite
    sink: Sink
    relay: RelayProcess
    notes: list[str] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)  # moments of the fault (unix time)
    store_proxy: PgProxy | None = None  # between the relay and its store (Scenario.store_proxy)

    def redis(self) -> BenchRedis:
        """The run's store, which this action needs to be Redis."""
        if not isinstance(self.store, BenchRedis):
            raise TypeError(f"this fault needs the Redis store, the run has {self.store!r}")
        return self.store

    def proxy(self) -> PgProxy:
        """The TCP proxy between the relay and its store, which this action needs."""
        if self.store_proxy is None:
            raise TypeError("this fault needs the store behind a proxy (store_proxy=True)")
        return self.store_proxy

    def postgres(self) -> BenchPostgres:
        """The run's store, which this action needs to be PostgreSQL."""
        if not isinstance(self.store, BenchPostgres):
            raise TypeError(f"this fault needs the PostgreSQL store, the run has {self.store!r}")
        return self.store


Action = Callable[[Bench], Awaitable[None]]


@dataclass(frozen=True)
class Scenario:
    """One fault: how the sink behaves, and what is done to Redis or the relay mid-load."""

    name: str
    title: str
    faults: Faults = field(default_factory=Faults)
    action: Action | None = None
    relay: RelayConfig = field(default_factory=RelayConfig)
    big_every: int = 0  # every big_every-th message carries a body of about big_bytes
    big_bytes: int = 0
    # a second relay on the same store and sink, its wall clock this far off (None: none);
    # the clients' attempts then go to the two relays in turn
    second_clock_offset_s: float | None = None
    policy: RetryPolicy | None = None  # the clients' retries (None: the run's default)
    store: str = "redis"  # redis | postgres | sqlite: what the relay's --store names
    # the relay reaches its store through a TCP proxy of the bench, which can black-hole it
    store_proxy: bool = False


async def restart_redis(bench: Bench) -> None:
    """Redis shut down (AOF flushed) and started again on the same port and data."""
    await bench.store.stop()
    await bench.store.start()
    bench.notes.append("redis restarted")


def redis_stopped(seconds: float) -> Action:
    """Redis shut down for ``seconds``, then started again on the same port and data."""

    async def action(bench: Bench) -> None:
        await bench.store.stop()
        await asyncio.sleep(seconds)
        await bench.store.start()
        bench.notes.append(f"redis was down {seconds:g} s")

    return action


def store_paused_during_settle(*, hold_s: float, pause_s: float) -> Action:
    """SIGTERM while the upstream holds its reply to a dot for ``hold_s``; Redis pauses for
    ``pause_s`` (DEBUG SLEEP) just before that reply, so the SENT mark after it is still
    waiting on Redis when the relay's grace ends. A new relay starts afterwards."""

    async def action(bench: Bench) -> None:
        taken = bench.sink.handler.hold_next(hold_s)
        await asyncio.wait_for(taken.wait(), 10)
        stopping = asyncio.create_task(bench.relay.signal_and_wait(signal.SIGTERM))
        await asyncio.sleep(hold_s * 0.6)
        await bench.redis().pause(pause_s)
        code = await stopping
        bench.notes.append(f"relay exited {code} after SIGTERM; redis paused {pause_s:g} s "
                           f"before the upstream's reply (held {bench.sink.handler.held_keys})")
        await bench.relay.start()

    return action


def relay_signalled(sig: signal.Signals, *, hold_s: float | None = None) -> Action:
    """The relay gets ``sig``; once it exited a new one starts on the same port and store.

    With ``hold_s`` the signal goes at a chosen moment: just after the sink took a message
    and while it holds its reply for ``hold_s`` (the relay waits on its final dot).
    """

    async def action(bench: Bench) -> None:
        if hold_s is not None:
            taken = bench.sink.handler.hold_next(hold_s)
            await asyncio.wait_for(taken.wait(), 10)
        code = await bench.relay.signal_and_wait(sig)
        held = f" (upstream holding {bench.sink.handler.held_keys})" if hold_s else ""
        bench.notes.append(f"relay exited {code} after {sig.name}{held}")
        await bench.relay.start()

    return action


def postgres_restarted(mode: str = "fast") -> Action:
    """PostgreSQL restarted (``pg_ctl restart -m MODE``) on the same port and data."""

    async def action(bench: Bench) -> None:
        bench.marks["store down"] = time.time()
        await bench.postgres().restart(mode)
        bench.marks["store back"] = time.time()
        took = bench.marks["store back"] - bench.marks["store down"]
        bench.notes.append(f"postgresql restarted (-m {mode}) in {took:.2f} s")

    return action


def postgres_stopped(seconds: float, mode: str = "immediate") -> Action:
    """PostgreSQL stopped (``pg_ctl stop -m MODE``; ``immediate``: no checkpoint, its
    backends dropped at once, crash recovery at the start) for ``seconds``, then started again
    on the same port and data."""

    async def action(bench: Bench) -> None:
        bench.marks["store down"] = time.time()
        await bench.postgres().stop(mode)
        await asyncio.sleep(seconds)
        await bench.postgres().start()
        bench.marks["store back"] = time.time()
        took = bench.marks["store back"] - bench.marks["store down"]
        bench.notes.append(f"postgresql stopped (-m {mode}), down {took:.2f} s")

    return action


async def kill_postgres(bench: Bench) -> None:
    """SIGKILL to the PostgreSQL postmaster; once its backends are gone, started again (crash
    recovery) on the same port and data."""
    bench.marks["store down"] = time.time()
    await bench.postgres().kill()
    await bench.postgres().start()
    bench.marks["store back"] = time.time()
    took = bench.marks["store back"] - bench.marks["store down"]
    bench.notes.append(f"postgresql postmaster killed (SIGKILL), back after {took:.2f} s")


REFUSAL = "451 4.3.0 bench: refused after a wait"
REFUSED_TEXT = REFUSAL.split(" ", 2)[2]  # what the relay's reply to the client quotes of it


def _refusal_decided(entry: dict[str, object]) -> bool:
    """The relay's decision line on the message the sink held and then refused with
    :data:`REFUSAL`: its release failed on the silent store and is owed by then (journaled
    before the client's reply, design.md §3)."""
    return entry.get("message") == "message" and REFUSED_TEXT in str(entry.get("reply"))


def _listening(entry: dict[str, object]) -> bool:
    """A start-up line of the relay's SMTP listener (one per worker, per start)."""
    return str(entry.get("message", "")).startswith("listening on")


def store_blackholed_then_killed(*, hold_s: float, owe_s: float) -> Action:
    """The upstream holds its reply to the next message for ``hold_s`` and then refuses it;
    meanwhile the store is black-holed (its proxy holds every byte, answers nothing). ``owe_s``
    later, with the release owed (the client told 451), SIGKILL to the relay; the store
    answers again (what the dead relay sent meanwhile dropped) and a new relay starts.

    ``owe_s`` is a wait, not an event: by then every settle that failed on the silent store
    (that release, and those of the other messages in flight) must be in the settle journal,
    after its quick tries; the relay logs no line saying all of them are."""

    async def action(bench: Bench) -> None:
        taken = bench.sink.handler.hold_next(hold_s, refuse=REFUSAL)
        await asyncio.wait_for(taken.wait(), 10)
        bench.proxy().hang()
        bench.marks["store down"] = time.time()
        await asyncio.sleep(owe_s)
        code = await bench.relay.signal_and_wait(signal.SIGKILL)
        bench.proxy().drop()
        bench.marks["store back"] = time.time()
        bench.notes.append(f"store black-holed {owe_s:g} s after the upstream took "
                           f"{bench.sink.handler.held_keys} (refused {hold_s:g} s later); "
                           f"relay exited {code} after SIGKILL; store back")
        await bench.relay.start()

    return action


def relay_restarted_without_its_store(*, hold_s: float) -> Action:
    """As :func:`store_blackholed_then_killed`, but the relay is stopped with SIGTERM (it
    writes what it owes); a new relay starts while the store is still black-holed, and the
    store answers once every worker of it started (what was sent meanwhile dropped)."""

    async def action(bench: Bench) -> None:
        taken = bench.sink.handler.hold_next(hold_s, refuse=REFUSAL)
        await asyncio.wait_for(taken.wait(), 10)
        bench.proxy().hang()
        bench.marks["store down"] = time.time()
        await bench.relay.logged(_refusal_decided)
        code = await bench.relay.signal_and_wait(signal.SIGTERM)
        started = sum(map(_listening, bench.relay.log_entries()))
        await bench.relay.start()
        await bench.relay.logged(_listening, count=started + bench.relay.config.workers)
        bench.proxy().drop()
        bench.marks["store back"] = time.time()
        bench.notes.append(f"store black-holed after the upstream took "
                           f"{bench.sink.handler.held_keys} (refused {hold_s:g} s later); "
                           f"relay exited {code} after SIGTERM; the new relay started without "
                           f"its store, which answered once every worker had started")

    return action


async def sigterm_over_stalled_links(bench: Bench) -> None:
    """SIGTERM to the relay while links stall; once it exited, every stall ends (and no link
    stalls any more) and a new relay starts."""
    code = await bench.relay.signal_and_wait(signal.SIGTERM)
    bench.sink.handler.release_stalls()
    bench.notes.append(f"relay exited {code} after SIGTERM; the stalled links read again")
    await bench.relay.start()


LATENCY_S = 0.1  # every scenario's sink answers each command within 0-100 ms, like a smarthost
# The control run's timeouts sit far above a loaded runner's scheduling pauses (the faults'
# half-second ones would turn a pause into a 451 and a retry): it shows the path, not the load.
CONTROL_RELAY = RelayConfig(lease_s=30.0, upstream_timeout_s=5.0, command_timeout_s=5.0,
                            connect_timeout_s=5.0, store_timeout_s=5.0)


def scenarios(*, redis_down_s: float = 10.0, pg_down_s: float = 3.0) -> list[Scenario]:
    """Every fault of the bench, the control run first; the PostgreSQL store's last."""
    plain = Faults(slow_s=LATENCY_S)
    # two relays on one store with clocks apart: 30 % of final replies held 2 s, clients that
    # give up after 1 s and retry on the other relay, whose retries meet the first attempt in
    # flight (450 at once: no in-flight wait)
    held_replies = Faults(hang_ratio=0.3, hang_s=2.0, slow_s=LATENCY_S)
    two_clocks = RelayConfig(lease_s=5.0, upstream_timeout_s=3.0, unknown_policy="send",
                             in_flight_wait_s=0.0)
    quick_retries = RetryPolicy(base_s=0.1, max_s=1.0, timeout_s=1.0)
    return [
        Scenario("baseline", "no fault (control)", faults=plain, relay=CONTROL_RELAY),
        Scenario("redis-restart", "Redis restarted mid-load", faults=plain,
                 action=restart_redis),
        Scenario("redis-down", f"Redis stopped for {redis_down_s:g} s", faults=plain,
                 action=redis_stopped(redis_down_s)),
        Scenario("upstream-temp", "upstream 30 % temporary failures (451)",
                 faults=Faults(temp_ratio=0.3, slow_s=LATENCY_S)),
        Scenario("upstream-hang", "upstream hangs after the dot for 5 % (3 s > timeout 1 s)",
                 faults=Faults(hang_ratio=0.05, hang_s=3.0, slow_s=LATENCY_S)),
        Scenario("upstream-drop-perm",
                 "upstream drops 10 % of connections at RCPT, refuses 10 % with 554",
                 faults=Faults(drop_ratio=0.1, perm_ratio=0.1, slow_s=LATENCY_S)),
        # timeouts far above a loaded runner's pauses, the stall far above the stall timeout:
        # with the half-second ones a sink starved of CPU turned commands into 451s and
        # retries past the deadline, and a dot answered after 1 s into one in doubt
        Scenario("upstream-stall",
                 "every 8th message 6 MB; upstream link stalls 6 s after 354 for half of "
                 "those (> stall timeout 2 s)",
                 faults=Faults(stall_ratio=0.5, stall_min_bytes=1_000_000, stall_s=6.0,
                               slow_s=LATENCY_S), big_every=8, big_bytes=6_000_000,
                 relay=RelayConfig(lease_s=20.0, upstream_timeout_s=5.0, command_timeout_s=2.0,
                                   connect_timeout_s=2.0)),
        Scenario("relay-sigterm", "relay SIGTERM mid-load, new relay on the same port",
                 faults=plain, action=relay_signalled(signal.SIGTERM)),
        Scenario("relay-sigterm-inflight",
                 "relay SIGTERM while upstream holds its reply to a dot 0.5 s, new relay",
                 faults=plain, action=relay_signalled(signal.SIGTERM, hold_s=0.5)),
        Scenario("relay-sigterm-cut",
                 "relay SIGTERM with grace 0.3 s while upstream holds a reply 0.8 s (past the "
                 "grace, within the 5 s wait for a reply to a dot), new relay",
                 faults=plain, action=relay_signalled(signal.SIGTERM, hold_s=0.8),
                 relay=RelayConfig(shutdown_grace_s=0.3)),
        Scenario("relay-sigterm-settle-cut",
                 "relay SIGTERM, grace 0.5 s, upstream's 250 at 0.3 s while Redis pauses 1.5 s: "
                 "the SENT mark outlasts the grace",
                 faults=plain, action=store_paused_during_settle(hold_s=0.3, pause_s=1.5),
                 relay=RelayConfig(shutdown_grace_s=0.5, store_timeout_s=2.0, lease_s=6.0)),
        Scenario("relays-clock-skew",
                 "two relays on one store, the second's clock 10 s ahead; upstream holds 30 % "
                 "of final replies 2 s; clients give up after 1 s and retry on the other relay; "
                 "unknown_policy = send",
                 faults=held_replies, relay=two_clocks,
                 second_clock_offset_s=10.0,
                 policy=quick_retries),
        Scenario("sqlite-clock-step",
                 "two relays on one SQLite file, the second's wall clock 20 s ahead (a step "
                 "longer than the 5 s lease); upstream holds 30 % of final replies 2 s; clients "
                 "give up after 1 s and retry on the other relay; unknown_policy = send",
                 faults=held_replies, relay=two_clocks,
                 second_clock_offset_s=20.0, store="sqlite", policy=quick_retries),
        # twice the delays a quiet runner needs: a relay on a loaded runner renews its lease
        # seconds late, and a renewal later than the lease reads as in doubt
        Scenario("long-transactions",
                 "every upstream command answered in 0-1.8 s: many transactions outlast the "
                 "6 s lease",
                 faults=Faults(slow_s=1.8),
                 relay=RelayConfig(lease_s=6.0, command_timeout_s=2.0, upstream_timeout_s=3.0)),
        Scenario("relay-sigkill", "relay SIGKILL mid-load, then restarted", faults=plain,
                 action=relay_signalled(signal.SIGKILL)),
        Scenario("relay-sigkill-mid-data",
                 "every 8th message 8 MB (more than the kernel's send buffer holds), its link "
                 "stalled 2 s after 354; relay SIGKILL mid-load (big bodies half sent), then "
                 "restarted",
                 faults=Faults(stall_ratio=1.0, stall_min_bytes=1_000_000, stall_s=2.0,
                               slow_s=LATENCY_S), big_every=8, big_bytes=8_000_000,
                 action=relay_signalled(signal.SIGKILL),
                 relay=RelayConfig(command_timeout_s=3.0, lease_s=12.0)),
        Scenario("relay-sigkill-after-dot",
                 "relay SIGKILL just after upstream took a message (reply held), restarted",
                 faults=plain, action=relay_signalled(signal.SIGKILL, hold_s=0.5)),
        Scenario("store-blackhole-sigkill",
                 "store black-holed while upstream holds a reply 0.6 s and refuses it; relay "
                 "SIGKILL 6 s later (the release owed), store back, new relay",
                 faults=plain, action=store_blackholed_then_killed(hold_s=0.6, owe_s=6.0),
                 store_proxy=True),
        Scenario("store-blackhole-restart",
                 "store black-holed while upstream holds a reply 0.6 s and refuses it; relay "
                 "SIGTERM once it answered that message (grace 1 s), new relay started "
                 "without its store, store back once every worker of it started",
                 faults=plain, action=relay_restarted_without_its_store(hold_s=0.6),
                 relay=RelayConfig(shutdown_grace_s=1.0), store_proxy=True),
        Scenario("upstream-late-354-sigkill",
                 "upstream answers DATA after 2 s (every transaction; command timeout 5 s); "
                 "relay SIGKILL mid-load, then restarted",
                 faults=Faults(late_354_ratio=1.0, late_354_s=2.0, slow_s=LATENCY_S),
                 action=relay_signalled(signal.SIGKILL),
                 relay=RelayConfig(command_timeout_s=5.0)),
        Scenario("relay-sigterm-unsent-dot",
                 "every 4th message 2 MB (the kernel takes it whole), its link stalled after "
                 "354 until the relay exited; relay SIGTERM with grace 0.3 s (upstream timeout "
                 "30 s): dots still in the kernel after the 5 s wait, new relay",
                 faults=Faults(stall_ratio=1.0, stall_min_bytes=1_000_000, stall_s=60.0,
                               slow_s=LATENCY_S), big_every=4, big_bytes=2_000_000,
                 action=sigterm_over_stalled_links,
                 relay=RelayConfig(shutdown_grace_s=0.3, upstream_timeout_s=30.0)),
        Scenario("pg-baseline", "PostgreSQL store, no fault (control)", faults=plain,
                 relay=CONTROL_RELAY, store="postgres"),
        Scenario("pg-restart", "PostgreSQL store restarted mid-load (pg_ctl restart -m fast)",
                 faults=plain, action=postgres_restarted("fast"), store="postgres"),
        Scenario("pg-down", f"PostgreSQL store stopped for {pg_down_s:g} s mid-load "
                 "(pg_ctl stop -m immediate), then started",
                 faults=plain, action=postgres_stopped(pg_down_s, "immediate"),
                 store="postgres"),
        Scenario("pg-sigkill", "PostgreSQL postmaster killed (SIGKILL) mid-load, then started",
                 faults=plain, action=kill_postgres, store="postgres"),
    ]


@dataclass
class RunResult:
    """A finished run: its counts, what the fault action noted, where its logs are."""

    scenario: Scenario
    counts: Counts
    notes: list[str]
    workdir: Path
    relay_exit_codes: list[int] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)  # the fault's moments (unix time)

    def line(self) -> str:
        return f"[{self.scenario.name}] {self.counts.summary()} notes={self.notes}"


async def _load(msgs: list[BenchMessage], ports: list[int], *, spread_s: float,
                deadline: float, concurrency: int, seed: int,
                policy: RetryPolicy) -> list[MessageLog]:
    """Messages arrive evenly over ``spread_s``; each is retried until it ends or ``deadline``,
    its attempts going to ``ports`` in turn (the message's first to a port by its index)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(msg: BenchMessage) -> MessageLog:
        await asyncio.sleep(msg.index * spread_s / max(1, len(msgs)))
        first = msg.index % len(ports)
        return await deliver(msg, ports[first:] + ports[:first], policy, deadline, gate,
                             random.Random(seed * 100_003 + msg.index))

    return list(await asyncio.gather(*(one(m) for m in msgs)))


async def _fault(bench: Bench, action: Action, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await action(bench)


async def run_scenario(scenario: Scenario, *, messages: int, workdir: Path,
                       spread_s: float, deadline_s: float, concurrency: int = 20,
                       seed: int = 1, policy: RetryPolicy | None = None) -> RunResult:
    """Run one fault end to end and count the result; every process is stopped on return.

    ``deadline_s`` bounds the clients (from the first arrival); the whole run ends at most
    ``deadline_s`` + 2 * the client reply timeout + ``SETTLE_S`` + process stop times later.
    """
    policy = scenario.policy or policy or RetryPolicy()
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    tag = f"{scenario.name}-{uuid.uuid4().hex[:6]}"
    msgs = make_messages(messages, tag, big_every=scenario.big_every,
                         big_bytes=scenario.big_bytes)
    store: BenchRedis | BenchPostgres | BenchSqlite = (
        BenchPostgres(workdir) if scenario.store == "postgres"
        else BenchSqlite(workdir / "sqlite") if scenario.store == "sqlite"
        else BenchRedis(workdir / "redis"))
    sink: Sink | None = None
    relay: RelayProcess | None = None
    second: RelayProcess | None = None
    fault: asyncio.Task[None] | None = None
    proxy: PgProxy | None = None
    loop = asyncio.get_running_loop()
    try:
        await store.start()
        store_url = store.url
        if scenario.store_proxy:
            proxy = await start_proxy(store_url)
            store_url = proxy.url(store_url)
        sink = await start_sink(scenario.faults, workdir / "sink.jsonl", seed=seed)
        relay = RelayProcess(port=free_port(), upstream_port=sink.port, store_url=store_url,
                             store_prefix=f"bench:{tag}:", log_path=workdir / "relay.log",
                             config=scenario.relay)
        await relay.start()
        ports = [relay.port]
        if scenario.second_clock_offset_s is not None:
            second = RelayProcess(port=free_port(), upstream_port=sink.port,
                                  store_url=store.url, store_prefix=f"bench:{tag}:",
                                  log_path=workdir / "relay2.log", config=scenario.relay,
                                  clock_offset_s=scenario.second_clock_offset_s)
            await second.start()
            ports.append(second.port)
        bench = Bench(store=store, sink=sink, relay=relay, store_proxy=proxy)
        started = loop.time()
        if scenario.action is not None:
            fault = asyncio.create_task(_fault(bench, scenario.action, spread_s * FAULT_AT))
        logs = await _load(msgs, ports, spread_s=spread_s, deadline=started + deadline_s,
                           concurrency=concurrency, seed=seed, policy=policy)
        wall_s = loop.time() - started
        if fault is not None:
            await asyncio.wait_for(fault, 60)
        await asyncio.sleep(SETTLE_S)
    finally:
        if fault is not None and not fault.done():
            fault.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await fault
        if second is not None:
            await second.stop()
        if proxy is not None:
            proxy.resume()  # the relay's stop may need its store
        await _stop_all(relay, sink, store)
        if proxy is not None:
            await proxy.close()
    (workdir / "clients.jsonl").write_text("".join(lg.to_json() + "\n" for lg in logs))
    counts = check(logs, workdir / "sink.jsonl")
    counts.wall_s = wall_s
    notes = [*bench.notes, f"sink fates {dict(bench.sink.handler.fates)}"]
    return RunResult(scenario=scenario, counts=counts, notes=notes, workdir=workdir,
                     relay_exit_codes=list(bench.relay.exit_codes), marks=dict(bench.marks))


async def _stop_all(relay: RelayProcess | None, sink: Sink | None,
                    store: BenchRedis | BenchPostgres | BenchSqlite) -> None:
    """Stop the relay, the sink and the store, each whatever happened to the others."""
    try:
        if relay is not None:
            await relay.stop()
    finally:
        try:
            if sink is not None:
                sink.close()
        finally:
            await store.close()


def evidence(result: RunResult, limit: int = 16) -> list[str]:
    """What the relay decided (and when the sink took a copy) for every concerned fingerprint.

    The relay runs with ``log_recipients = true``, so its decision lines name the recipient;
    a relay killed with SIGKILL left no line for the message it was relaying.
    """
    rcpts = {fp.split("|", 1)[0] for bucket, names in result.counts.concerned.items()
             if bucket != "unfinished" for fp in names}
    found: list[tuple[float, str]] = []
    for line in (result.workdir / "sink.jsonl").read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if entry["rcpt"] in rcpts:
            found.append((entry["t"], f"sink took {entry['rcpt']}"))
    for line in (result.workdir / "relay.log").read_text(errors="replace").splitlines():
        if any(r in line for r in rcpts):
            found.append((_log_time(line), _decision(line)))
    return [f"{_hms(t)} {text}" for t, text in sorted(found)][:limit]


def _log_time(line: str) -> float:
    with contextlib.suppress(ValueError, KeyError, TypeError):
        stamp = json.loads(line)["time"]
        return datetime.fromisoformat(stamp).timestamp()  # RFC 3339, milliseconds
    return 0.0


def _decision(line: str) -> str:
    """A relay log line, shortened to queue id, reply and per-recipient outcomes."""
    try:
        entry = json.loads(line)
    except ValueError:
        return f"relay: {line[:300]}"
    if entry.get("message") != "message":
        return f"relay {entry.get('level')}: {entry.get('message', '')[:300]}"
    return f"relay {entry['queue_id']} answered {entry['reply']!r} outcomes {entry['outcomes']}"


def _hms(t: float) -> str:
    """Time of day; relay log times are whole seconds, so those show no fraction."""
    if not t:
        return "?"
    text = datetime.fromtimestamp(t, tz=UTC).strftime("%H:%M:%S.%f")[:-3]
    return text[:-4] + "    " if t == int(t) else text
