"""The nemesis: one or two relays under steady load from retrying clients while a schedule
drawn from a seed (``bench.faultbench.schedule``) applies overlapping faults to the relays, their
store and their smarthost; then every fault is healed, the clients finish their retries, and
the checker (``bench.faultbench.checker``) reads the whole history.

:func:`run_nemesis` is what ``tools/faultbench.py --nemesis`` and
``tests/system/stores/test_nemesis.py`` call. One run, in order: the store (a bench-owned
redis-server or PostgreSQL server behind a proxy that can hold every byte, or a SQLite file),
the smarthost (``NemesisSink``), the audit ledger (a private schema on the test PostgreSQL,
which no fault touches, so ``dedup-relay in-doubt`` can be asked at the end), the relays
(``serve --workers 2`` each, kept running as a service manager keeps a unit); messages arrive
evenly over the load's duration and each client retries as an MTA does, each attempt handed
to the relays in turn as a load balancer does; the faults run as the schedule says; at the end
of the load everything is healed, the clients get ``heal_s`` more to finish, the relays are
stopped (SIGTERM), and the history is collected (``bench.faultbench.nemesis_history``). Every
process started here is stopped on the way out, also on an error or a cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.faultbench.checker import ClientRecord, Counts, History, Reply, check
from bench.faultbench.defects import shim_env
from bench.faultbench.lib import (
    BenchPostgres,
    BenchRedis,
    BenchSqlite,
    RelayConfig,
    RelayProcess,
    free_port,
)
from bench.faultbench.nemesis_history import (
    collect,
    ledger_rows_lost,
    unhandled_errors,
)
from bench.faultbench.nemesis_parts import (
    NemesisSink,
    RelayNode,
    SinkServer,
    start_nemesis_sink,
)
from bench.faultbench.nemesis_store import StoreControl
from bench.faultbench.schedule import Fault, draw_schedule
from bench.faultbench.traffic import (
    Attempt,
    BenchMessage,
    RetryPolicy,
    make_messages,
    send_once,
)
from tests.support.postgres import ledger_schema

SETTLE_S = 2.0
"""After the last client ended: settles still being retried land before the relays stop."""
CONCURRENCY = 20
"""Most SMTP sessions the clients hold at once."""
CLIENT_TIMEOUTS_S = (3.0, 10.0)
"""How long a client waits for each reply, one drawn per seed: the short one gives up on a
relay still at work on the message (a store or smarthost fault slows it) and retries on the
next one while the first attempt goes on (attempts of one key that overlap). Not shorter: at
1.5 s two relays on one SQLite file on a loaded 2-core machine fell behind and never caught
up, every client giving up on attempts the relays then finished."""


def client_timeout_s(seed: int) -> float:
    """The clients' wait for each reply in ``seed``'s run, seconds."""
    return random.Random(f"clients {seed}").choice(CLIENT_TIMEOUTS_S)


@dataclass(frozen=True)
class NemesisConfig:
    """One run: ``seed`` draws the schedule (unless one is given) and the traffic's jitter;
    ``duration_s`` of load at ``rate`` messages per second (every third with two
    recipients, every tenth about 200 KB); ``heal_s`` more for the clients once every fault
    is healed; the relays' ``unknown_policy``; ``defect`` a planted defect
    (``bench.faultbench.defects``; "" for the relay as shipped)."""

    seed: int
    duration_s: float = 60.0
    store: str = "redis"
    relays: int = 1
    rate: float = 8.0
    heal_s: float = 60.0
    unknown_policy: str = "suppress"
    defect: str = ""


@dataclass
class NemesisResult:
    """A finished run: its schedule, the faults that applied (a kill of a relay already down
    does not), the checker's counts, the history, notes, where its logs are, and the relays'
    unhandled errors (tracebacks, asyncio's own error lines)."""

    config: NemesisConfig
    schedule: list[Fault]
    applied: list[Fault]
    counts: Counts
    history: History
    workdir: Path
    notes: list[str] = field(default_factory=list)
    relay_errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        """``nemesis seed N store S: faults F, keys K, duplicates D, lost L, in doubt U,
        unfinished X``."""
        c = self.counts
        return (f"nemesis seed {self.config.seed} store {self.config.store}: faults "
                f"{len(self.applied)}, keys {c.keys}, duplicates {c.duplicates}, lost {c.lost}, "
                f"in doubt {c.in_doubt}, unfinished {c.unfinished}")


@dataclass
class Parts:
    """What the faults act on."""

    store: StoreControl
    sink: NemesisSink
    relays: list[RelayNode]
    applied: list[Fault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------
# the faults
# ------------------------------------------------------------------------------------------


async def _hold_relay_down(node: RelayNode, fault: Fault,
                           stop: Callable[[], Awaitable[bool]],
                           started: Callable[[], None]) -> bool:
    """Stop ``node`` with ``stop`` and keep it down ``fault.hold_s``; start it again when no
    other fault holds it down. False (nothing done) when it was not running."""
    if not node.running or node.down:
        return False
    node.down += 1
    try:
        if not await stop():
            return False
        started()
        await asyncio.sleep(fault.hold_s)
        return True
    finally:
        node.down = max(0, node.down - 1)
        if node.down == 0 and not node.running:
            await node.start()


async def _relay_fault(parts: Parts, f: Fault, started: Callable[[], None]) -> bool:
    node = parts.relays[f.relay]
    if f.kind == "kill-relay":
        return await _hold_relay_down(node, f, node.kill, started)
    if f.kind == "sigterm":
        return await _hold_relay_down(node, f, lambda: node.terminate(f.arg), started)
    if f.kind == "kill-worker":
        return node.signal_worker(int(f.arg), signal.SIGKILL)
    if f.kind == "sighup":
        return node.hangup()
    node.step_clock(f.arg)  # clock-step
    started()
    await asyncio.sleep(f.hold_s)
    node.unstep_clock(f.arg)
    return True


async def _store_fault(parts: Parts, f: Fault, started: Callable[[], None]) -> bool:
    store = parts.store
    if f.kind == "store-restart":
        return await store.restart()
    if f.kind in ("store-down", "store-crash"):
        if not await (store.take_down() if f.kind == "store-down" else store.crash()):
            return False
        started()
        await asyncio.sleep(f.hold_s)
        await store.bring_up()
        return True
    if f.kind == "store-partition":
        if not store.partition():
            return False
        started()
        await asyncio.sleep(f.hold_s)
        store.unpartition()
        return True
    if not await store.lock():  # store-locked
        return False
    started()
    await asyncio.sleep(f.hold_s)
    await store.unlock()
    return True


async def _apply(parts: Parts, f: Fault, load_start: float) -> None:
    """Wait for ``f``'s start, apply it, hold it, heal it; record it as applied when it
    did something."""
    await asyncio.sleep(max(0.0, load_start + f.at_s - time.monotonic()))
    counted = False

    def started() -> None:
        nonlocal counted
        if not counted:
            counted = True
            parts.applied.append(f)

    try:
        if f.kind.startswith("upstream-"):
            parts.sink.start_fault(f.kind, f.arg)
            started()
            await asyncio.sleep(f.hold_s)
            parts.sink.end_fault(f.kind, f.arg)
            return
        act = _store_fault if f.kind.startswith("store-") else _relay_fault
        if await act(parts, f, started):
            started()
    except Exception as exc:  # a fault that failed is noted; the heal puts things right
        parts.notes.append(f"{f.describe()}: {type(exc).__name__}: {str(exc)[:300]}")


async def heal(parts: Parts) -> None:
    """End every fault: the smarthost answers, the store runs and is reachable, every
    relay's clock is true and every relay runs."""
    parts.sink.heal()
    await parts.store.heal()
    for node in parts.relays:
        node.reset_clock()
        node.down = 0
        if not node.running:
            await node.start()


# ------------------------------------------------------------------------------------------
# the load
# ------------------------------------------------------------------------------------------


class Balancer:
    """Hands each new connection to the next relay in turn (round robin), as a TCP load
    balancer does; a relay that refuses the connection is passed over for the next one
    within the same attempt (a balancer's redispatch)."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self._turn = 0

    async def attempt(self, msg: BenchMessage, timeout_s: float) -> Attempt:
        first = self._turn % len(self.ports)
        self._turn += 1
        attempt = Attempt(self.ports[first], None, "", error="connect: no relay")
        for port in self.ports[first:] + self.ports[:first]:
            attempt = await send_once(port, msg, timeout_s)
            if not attempt.error.startswith("connect"):
                break
        return attempt


async def _client(msg: BenchMessage, balancer: Balancer, policy: RetryPolicy,
                  deadline: float, gate: asyncio.Semaphore, rng: random.Random) -> ClientRecord:
    """Send ``msg`` until 2yz or 5yz or ``deadline`` (monotonic), backing off as an MTA."""
    record = ClientRecord(msg.key, msg.rcpts)
    while time.monotonic() < deadline:
        async with gate:
            a = await balancer.attempt(msg, policy.timeout_s)
        record.replies.append(Reply(time.time(), a.port, a.code, a.text, a.error))
        if a.code is not None and (a.code < 400 or a.code >= 500):
            record.end = "accepted" if a.code < 400 else "gave_up"
            return record
        pause = policy.backoff_s(len(record.replies) - 1, rng)
        await asyncio.sleep(max(0.0, min(pause, deadline - time.monotonic())))
    return record


async def _load(msgs: list[BenchMessage], balancer: Balancer, cfg: NemesisConfig,
                load_start: float) -> list[ClientRecord]:
    gate = asyncio.Semaphore(CONCURRENCY)
    deadline = load_start + cfg.duration_s + cfg.heal_s
    policy = RetryPolicy(timeout_s=client_timeout_s(cfg.seed))

    async def one(msg: BenchMessage) -> ClientRecord:
        await asyncio.sleep(max(0.0, load_start + msg.index / cfg.rate - time.monotonic()))
        return await _client(msg, balancer, policy, deadline, gate,
                             random.Random(cfg.seed * 100_003 + msg.index))

    return list(await asyncio.gather(*(one(m) for m in msgs)))


# ------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------


def _new_store(store: str, workdir: Path) -> BenchRedis | BenchPostgres | BenchSqlite:
    if store == "postgres":
        return BenchPostgres(workdir)
    if store == "sqlite":
        return BenchSqlite(workdir / "sqlite")
    return BenchRedis(workdir / "redis")


def _relay_node(i: int, cfg: NemesisConfig, schedule: list[Fault], parts_url: str,
                sink_port: int, prefix: str, ledger_url: str, workdir: Path,
                grace_s: float) -> RelayNode:
    home = workdir / f"relay{i}"
    home.mkdir(parents=True, exist_ok=True)
    steps = any(f.kind == "clock-step" and f.relay == i for f in schedule)
    node = RelayNode(RelayProcess(
        port=free_port(), upstream_port=sink_port, store_url=parts_url, store_prefix=prefix,
        log_path=home / "relay.log",
        config=RelayConfig(shutdown_grace_s=grace_s, unknown_policy=cfg.unknown_policy)),
        clock_file=home / "faketime.rc" if steps else None)
    node.process.extra_env.update({
        "RELAY_LEDGER": ledger_url, "RELAY_LEDGER_RECIPIENTS": "full",
        "RELAY_LEDGER_KEYS": "plain", **node.clock_env(),
        **(shim_env(workdir / "defect", cfg.defect) if cfg.defect else {})})
    return node


async def run_nemesis(cfg: NemesisConfig, workdir: Path,
                      schedule: list[Fault] | None = None) -> NemesisResult:
    """Run ``cfg`` (with ``schedule``, or the one its seed draws) end to end, check the
    history, and return the result; every process is stopped on return. Bounded by about
    ``duration_s + heal_s`` plus start, stop and collection (a minute at most)."""
    if schedule is None:
        schedule = draw_schedule(cfg.seed, cfg.duration_s, cfg.store, cfg.relays)
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    tag = f"s{cfg.seed}-{uuid.uuid4().hex[:6]}"
    prefix = f"nemesis:{tag}:"
    msgs = make_messages(max(1, int(cfg.rate * cfg.duration_s)), tag, big_every=10,
                         big_bytes=200_000)
    grace_s = round(random.Random(f"grace {cfg.seed}").uniform(0.3, 3.0), 2)
    store = StoreControl(_new_store(cfg.store, workdir))
    sink: SinkServer | None = None
    nodes: list[RelayNode] = []
    with ledger_schema() as ledger_url:
        try:
            await store.start()
            sink = await start_nemesis_sink(workdir, cfg.seed)
            nodes = [_relay_node(i, cfg, schedule, store.url, sink.port, prefix, ledger_url,
                                 workdir, grace_s) for i in range(cfg.relays)]
            await asyncio.gather(*(n.start() for n in nodes))
            for n in nodes:
                n.keep()
            parts = Parts(store, sink.handler, nodes)
            parts.notes.append(f"relays' shutdown grace {grace_s:g} s, clients' wait for a "
                               f"reply {client_timeout_s(cfg.seed):g} s")
            clients = await _run_load(parts, schedule, msgs, cfg)
            await asyncio.sleep(SETTLE_S)
            await asyncio.gather(*(n.close() for n in nodes))
            history = await collect(clients, workdir, store.direct_url, prefix, ledger_url,
                                    [n.process.log_path for n in nodes])
        finally:
            await _stop_all(nodes, sink, store)
    logs = [n.process.log_path for n in nodes]
    notes = [*parts.notes, *(f"relay {i}: {note}" for i, n in enumerate(nodes)
                             for note in n.notes)]
    if lost_rows := ledger_rows_lost(logs):
        notes.append(f"audit ledger rows the relays stopped without writing: {lost_rows}")
    return NemesisResult(cfg, list(schedule), sorted(parts.applied, key=lambda f: f.at_s),
                         check(history), history, workdir, notes, unhandled_errors(logs))


async def _run_load(parts: Parts, schedule: list[Fault], msgs: list[BenchMessage],
                    cfg: NemesisConfig) -> list[ClientRecord]:
    """The load with the faults, then the heal; the clients' records."""
    balancer = Balancer([n.process.port for n in parts.relays])
    load_start = time.monotonic()
    faults = [asyncio.create_task(_apply(parts, f, load_start)) for f in schedule]
    load = asyncio.create_task(_load(msgs, balancer, cfg, load_start))
    try:
        await asyncio.sleep(max(0.0, load_start + cfg.duration_s - time.monotonic()))
        _, late = await asyncio.wait(faults, timeout=60)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        await heal(parts)
        return await load
    finally:
        load.cancel()
        for task in faults:
            task.cancel()
        await asyncio.gather(*faults, load, return_exceptions=True)


async def _stop_all(nodes: list[RelayNode], sink: SinkServer | None,
                    store: StoreControl) -> None:
    """Stop the relays, the smarthost and the store, each whatever happened to the others."""
    try:
        for node in nodes:
            with contextlib.suppress(Exception):
                await node.close()
    finally:
        try:
            if sink is not None:
                sink.close()
        finally:
            await store.close()
