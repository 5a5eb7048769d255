"""The nemesis's fault schedules: which faults, when, for how long, drawn from a seed.

A schedule is a list of :class:`Fault` (start and hold in seconds after the load began). It is
drawn by :func:`draw_schedule` from ``(seed, duration, store, relays)`` alone, so one seed
always names one schedule; it prints as one line per fault (:meth:`Fault.describe`) and
round-trips through JSON (:func:`schedule_json`, :func:`schedule_from_json`) so that a
developer can run a printed (or shrunk) schedule again with ``--schedule``.

Faults overlap on purpose: about half start inside the window of a fault drawn before them
(a relay killed while its store is down, a SIGTERM while the upstream hangs after the dot),
because the breaks are where two faults meet. Every fault ends by :data:`LAST_END` of the
load's duration; the run heals whatever is left at the end of the load anyway.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

STORES = ("redis", "sqlite", "postgres")

RELAY_KINDS = ("kill-worker", "kill-relay", "sigterm", "sighup", "clock-step")
"""Faults of one relay (``Fault.relay`` names which)."""
UPSTREAM_KINDS = ("upstream-4yz", "upstream-hang", "upstream-close", "upstream-stall")
"""Faults of the smarthost: for ``hold_s`` a share (``Fault.arg``) of its transactions
answers 451 (at RCPT or the dot), takes the message and hangs past the relay's timeout, takes
it and closes without a reply, or stops reading after its 354."""
STORE_KINDS = {
    "redis": ("store-down", "store-restart", "store-crash", "store-partition"),
    "postgres": ("store-down", "store-restart", "store-crash", "store-partition"),
    "sqlite": ("store-locked",),
}
"""Faults of each store: stopped for ``hold_s``; restarted; killed (SIGKILL) and started
``hold_s`` later; partitioned (a proxy holds every byte for ``hold_s``, then passes them
on); SQLite: another process holds the file's write lock for ``hold_s``."""

WEIGHTS = {
    "kill-worker": 2.0, "kill-relay": 2.0, "sigterm": 2.0, "sighup": 1.0, "clock-step": 1.0,
    "store-down": 2.0, "store-restart": 1.0, "store-crash": 1.5, "store-partition": 2.0,
    "store-locked": 3.0, "upstream-4yz": 1.0, "upstream-hang": 1.5, "upstream-close": 1.5,
    "upstream-stall": 1.0,
}
"""How often each kind is drawn, relative to the others a store has."""

FIRST_START = 0.1
"""No fault starts before this share of the load's duration (the relays warm up)."""
LAST_END = 0.9
"""Every fault ends (is healed) by this share of the load's duration."""
MAX_FAULTS = 60
"""Most faults one schedule holds, whatever the duration."""
SQLITE_MAX_STEP_S = 1.0
"""Largest clock step of a relay on SQLite, seconds: that store dates leases on the relay's
wall clock, and design.md §3 leaves a step near the lease (5 s here) out of the promise; two
relays' offsets then differ by at most 2 s, under the 2/3 lease less a store timeout that a
renewed reservation outlives."""
SERVER_MAX_STEP_S = 120.0
"""Largest clock step of a relay on Redis or PostgreSQL, seconds (their times are the
server's)."""


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule.

    ``kind``: one of :data:`RELAY_KINDS`, :data:`UPSTREAM_KINDS`, :data:`STORE_KINDS`;
    ``at_s``: when it starts, seconds after the load began; ``hold_s``: how long it lasts
    (a kill: until the restart; a clock step: until the clock is stepped back; 0 for a
    SIGHUP, a worker's kill, a store restart); ``relay``: the relay it hits (relay faults);
    ``arg``: kind-specific (``sigterm``: seconds until SIGKILL follows, as an orchestrator's
    stop timeout; ``clock-step``: the step in seconds; ``kill-worker``: which worker, 0 or 1;
    upstream faults: the share of transactions hit, 0-1).
    """

    kind: str
    at_s: float
    hold_s: float = 0.0
    relay: int = 0
    arg: float = 0.0

    def describe(self) -> str:
        """One line: ``t+12.3s kill-relay relay 1, restarted 1.5 s later``."""
        return f"t+{self.at_s:.1f}s {self.kind}{_detail(self)}"


def _detail(f: Fault) -> str:
    relay = f" relay {f.relay}"
    details = {
        "kill-worker": f"{relay} worker {int(f.arg)} (SIGKILL; its supervisor restarts it)",
        "kill-relay": f"{relay} (SIGKILL to every process), restarted {f.hold_s:.1f} s later",
        "sigterm": f"{relay}, SIGKILL after {f.arg:.1f} s if still running, restarted "
                   f"{f.hold_s:.1f} s after it exited",
        "sighup": f"{relay} (reload)",
        "clock-step": f"{relay} wall clock {f.arg:+.1f} s for {f.hold_s:.1f} s",
        "store-down": f" for {f.hold_s:.1f} s",
        "store-restart": "",
        "store-crash": f" (SIGKILL), started {f.hold_s:.1f} s later",
        "store-partition": f" (bytes held) for {f.hold_s:.1f} s",
        "store-locked": f" (write lock held by another process) for {f.hold_s:.1f} s",
    }
    if f.kind in details:
        return details[f.kind]
    return f" {f.arg:.0%} of transactions for {f.hold_s:.1f} s"


def kinds_for(store: str) -> tuple[str, ...]:
    """Every fault kind a run on ``store`` can draw."""
    return (*RELAY_KINDS, *STORE_KINDS[store], *UPSTREAM_KINDS)


def _hold_and_arg(kind: str, rng: random.Random, store: str) -> tuple[float, float]:
    """A new fault's (hold_s, arg), drawn."""
    max_step = SQLITE_MAX_STEP_S if store == "sqlite" else SERVER_MAX_STEP_S
    draws = {
        "kill-worker": lambda: (0.0, float(rng.randrange(2))),
        "kill-relay": lambda: (rng.uniform(0.2, 4.0), 0.0),
        "sigterm": lambda: (rng.uniform(0.2, 3.0), rng.uniform(0.2, 8.0)),
        "sighup": lambda: (0.0, 0.0),
        "clock-step": lambda: (rng.uniform(2.0, 15.0),
                               rng.choice((-1, 1)) * rng.uniform(0.2, max_step)),
        "store-down": lambda: (rng.uniform(0.5, 8.0), 0.0),
        "store-restart": lambda: (0.0, 0.0),
        "store-crash": lambda: (rng.uniform(0.0, 3.0), 0.0),
        "store-partition": lambda: (rng.uniform(0.5, 8.0), 0.0),
        "store-locked": lambda: (rng.uniform(0.5, 6.0), 0.0),
        "upstream-4yz": lambda: (rng.uniform(1.0, 10.0), rng.uniform(0.3, 1.0)),
        "upstream-hang": lambda: (rng.uniform(1.0, 10.0), rng.uniform(0.1, 0.5)),
        "upstream-close": lambda: (rng.uniform(1.0, 10.0), rng.uniform(0.1, 0.5)),
        "upstream-stall": lambda: (rng.uniform(1.0, 10.0), rng.uniform(0.2, 1.0)),
    }
    return draws[kind]()


def draw_schedule(seed: int, duration_s: float, store: str, relays: int) -> list[Fault]:
    """The schedule of ``seed`` for a load of ``duration_s`` seconds on ``store`` with
    ``relays`` relays (1 or 2), ordered by start: between ``duration_s / 8`` and
    ``duration_s / 3`` faults (at least 1 and 2, at most :data:`MAX_FAULTS`). Raises
    ``ValueError`` for an unknown store."""
    if store not in STORE_KINDS:
        raise ValueError(f"unknown store {store!r}: one of {', '.join(STORES)}")
    rng = random.Random(f"nemesis {seed} {store} {relays} {duration_s:g}")
    kinds = kinds_for(store)
    weights = [WEIGHTS[k] for k in kinds]
    low = max(1, int(duration_s / 8))
    count = min(MAX_FAULTS, rng.randint(low, max(low + 1, int(duration_s / 3))))
    first, last = FIRST_START * duration_s, LAST_END * duration_s
    faults: list[Fault] = []
    for _ in range(count):
        kind = rng.choices(kinds, weights)[0]
        hold_s, arg = _hold_and_arg(kind, rng, store)
        if faults and rng.random() < 0.5:  # inside an earlier fault's window: they overlap
            other = rng.choice(faults)
            at_s = other.at_s + rng.uniform(0.0, max(0.5, other.hold_s))
        else:
            at_s = rng.uniform(first, last)
        at_s = min(max(first, at_s), last - 0.2)
        hold_s = min(hold_s, max(0.0, last - at_s))
        faults.append(Fault(kind, round(at_s, 2), round(hold_s, 2),
                            relay=rng.randrange(relays), arg=round(arg, 2)))
    return sorted(faults, key=lambda f: f.at_s)


def schedule_json(faults: Sequence[Fault]) -> str:
    """``faults`` as one line of JSON (what ``--schedule`` reads back)."""
    return json.dumps([asdict(f) for f in faults], separators=(",", ":"))


def schedule_from_json(text: str, store: str, relays: int) -> list[Fault]:
    """The schedule ``text`` (:func:`schedule_json`'s form) holds, ordered by start. Raises
    ``ValueError`` for malformed JSON, a kind ``store`` has not, or a relay index out of
    range."""
    try:
        items = json.loads(text)
        faults = [Fault(kind=str(i["kind"]), at_s=float(i["at_s"]),
                        hold_s=float(i.get("hold_s", 0.0)), relay=int(i.get("relay", 0)),
                        arg=float(i.get("arg", 0.0))) for i in items]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"not a schedule (a JSON list of faults): {exc}") from exc
    for f in faults:
        if f.kind not in kinds_for(store):
            raise ValueError(f"{f.kind!r} is no fault of a {store} run")
        if not 0 <= f.relay < relays:
            raise ValueError(f"{f.describe()}: there are {relays} relay(s)")
    return sorted(faults, key=lambda f: f.at_s)


def count_kinds(faults: Iterable[Fault]) -> Counter[str]:
    """How many faults of each kind."""
    return Counter(f.kind for f in faults)


def without(faults: Sequence[Fault], drop: Iterable[int]) -> list[Fault]:
    """``faults`` less those at the indexes ``drop``."""
    gone = set(drop)
    return [f for i, f in enumerate(faults) if i not in gone]
