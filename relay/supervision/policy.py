"""The restart policy of a worker slot (design.md §8): what a worker's exit means.

A worker that exits on its own is restarted after a back-off (0.5 s doubling to 30 s, back to
0.5 s once it had served for a minute). A worker that cannot start :data:`MAX_START_FAILURES`
times in a row, or exits with a start error (69, 78: :data:`START_ERRORS`) before it served,
ends the relay with that code (69 otherwise). Worker 0's first start error is reported by the
worker itself (its one ``dedup-relay: ...`` line), not logged again here.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from dataclasses import dataclass

log = logging.getLogger("relay.supervisor")

EX_UNAVAILABLE = 69  # sysexits.h, as relay.cli.exit_codes.ExitCode.UNAVAILABLE
EX_CONFIG = 78  # as ExitCode.CONFIG
START_ERRORS = (EX_UNAVAILABLE, EX_CONFIG)
MAX_START_FAILURES = 5
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 60.0  # a worker that served this long restarts at the first back-off again


@dataclass
class Restarts:
    """The restart state of worker ``index``: its failed starts in a row and the back-off
    (seconds) before its next start."""

    index: int
    start_failures: int = 0
    backoff_s: float = BACKOFF_FIRST_S

    def after_exit(self, code: int, served_s: float | None) -> int | None:
        """Log the exit of the worker (``code``: its exit code, negative: the signal that ended
        it; ``served_s``: how long it served, None when it never did). None: restart it after
        :attr:`backoff_s`; else the exit code the relay gives up with."""
        if served_s is not None:
            self.start_failures = 0
            if served_s > BACKOFF_RESET_S:
                self.backoff_s = BACKOFF_FIRST_S
            log.error("worker %d exited (%s) after %.1f s: restarting in %.1f s",
                      self.index, exit_text(code), served_s, self.backoff_s)
            return None
        self.start_failures += 1
        if code in START_ERRORS or self.start_failures >= MAX_START_FAILURES:
            if code not in START_ERRORS or self.index > 0 or self.start_failures > 1:
                log.error("worker %d could not start (%s, %d time(s)): giving up",
                          self.index, exit_text(code), self.start_failures)
            return code if code in START_ERRORS else EX_UNAVAILABLE
        log.error("worker %d exited before serving (%s): restarting in %.1f s",
                  self.index, exit_text(code), self.backoff_s)
        return None

    def waited(self) -> None:
        """The back-off was waited out: double it for the next exit, up to 30 s."""
        self.backoff_s = min(BACKOFF_MAX_S, self.backoff_s * 2)


def exit_text(code: int) -> str:
    """``code`` in words: ``exit code N``, or ``signal NAME`` for a negative one."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"
