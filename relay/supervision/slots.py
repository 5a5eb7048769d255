"""A worker slot: the supervisor's record of worker ``index`` across its processes (the
current one, whether it serves, since when, its reload confirmations, its restart state)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from dataclasses import dataclass, field

from relay.supervision.policy import Restarts


@dataclass
class WorkerSlot:
    """One worker slot: its current process, whether it served, its restart state."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    serving: bool = False
    since: float = 0.0  # monotonic time it started serving
    restarts: Restarts = field(init=False)
    served: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    reloads: int = 0  # reloads its processes confirmed on the status pipe (applied or not)
    reload_ok: bool = True  # whether the last one was applied

    def __post_init__(self) -> None:
        self.restarts = Restarts(self.index)

    @property
    def alive(self) -> bool:
        """Whether its process was started and has not been seen to exit."""
        return self.proc is not None and self.proc.returncode is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process when it is alive (one that just died: nothing)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL its process when it is alive."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def mark_serving(self) -> None:
        """Its process said ``serving`` (now, monotonic)."""
        self.serving = True
        self.since = time.monotonic()
        self.served.set()

    def left(self) -> float | None:
        """Its process exited: how long it had served (seconds), None when it never did."""
        if not self.serving:
            return None
        self.serving = False
        return time.monotonic() - self.since
