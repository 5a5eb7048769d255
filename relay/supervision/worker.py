"""A worker process's entry (:func:`worker_main`, run by :data:`relay.supervision.spawn.
WORKER_COMMAND`): one relay process on the sockets its supervisor bound (design.md §8).

It imports none of the supervisor's side (the supervisor, the servers it hosts, reload
forwarding: import contracts in pyproject.toml)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

from setproctitle import setproctitle

from relay.core.errors import ConfigError, StartupError
from relay.listen import Inherited
from relay.ops.logs import setup_logging
from relay.reload import Reloader, SnapshotSource, worker_hangup
from relay.serving import run
from relay.supervision.loop import run_loop_for
from relay.supervision.policy import EX_CONFIG, EX_UNAVAILABLE
from relay.supervision.spawn import WorkerSpec, read_settings
from relay.supervision.status import StatusWriter


def worker_main(early: list[int]) -> None:
    """A worker process's entry (``python -c``): read its settings and sockets from the
    descriptors :data:`relay.supervision.spawn.WORKER_ENV` names, serve until SIGTERM/SIGINT
    (SIGHUP: apply the reloadable settings, confirmed on the status pipe); exit 69 or 78 with
    one ``dedup-relay: ...`` line on stderr when it cannot start. ``early``: the signals that
    arrived before the event loop's handlers were installed (sent again once they are)."""
    spec = WorkerSpec.from_env()
    settings, source = read_settings(spec.settings)
    setproctitle(f"dedup-relay: worker {spec.index}")  # not a `python3 -c "..."` blob in ps
    setup_logging(settings.log_level, settings.log_format, worker=spec.index,
                  mask_addresses=not settings.log_recipients)
    status = StatusWriter(spec.status)
    # a worker applies what its supervisor read and checked (SnapshotSource), never the file
    hangup = None if source is None else worker_hangup(
        Reloader(SnapshotSource(Path(spec.reload_snapshot)), settings), status.confirm)
    inherited = Inherited(listen=_sockets(spec.listen), tls_listen=_sockets(spec.tls_listen),
                          index=spec.index, metrics_port=spec.metrics_port)

    async def main() -> None:
        serve = asyncio.create_task(run(settings, inherited=inherited, started=status.serving,
                                        hangup=hangup))
        await asyncio.sleep(0)  # run() installed its signal handlers: what came early, again
        for sig in early:
            os.kill(os.getpid(), sig)
        await serve

    try:
        run_loop_for(settings, main())
    except ConfigError as exc:
        sys.stderr.write(f"dedup-relay: invalid configuration:\n{exc}\n")
        sys.exit(EX_CONFIG)
    except StartupError as exc:
        sys.stderr.write(f"dedup-relay: cannot start: {exc}\n")
        sys.exit(EX_UNAVAILABLE)


def _sockets(fds: tuple[int, ...]) -> tuple[socket.socket, ...]:
    """The inherited listening sockets of descriptors ``fds``."""
    return tuple(socket.socket(fileno=fd) for fd in fds)
