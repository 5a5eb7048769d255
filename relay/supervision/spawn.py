"""Starting a worker process and following it to its exit (design.md §8).

A worker is ``python -c`` :data:`WORKER_COMMAND`: it learns its index and the descriptors it
inherits from :data:`WORKER_ENV` (JSON, :class:`WorkerSpec`), and reads its settings pickled
over a private pipe (secrets never in the environment or on the command line). It is started
with SIGHUP blocked (:func:`spawn_worker`) and dies with its supervisor (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from relay.listen import Listeners
from relay.reload import SettingsSource
from relay.settings import Settings

WORKER_ENV = "DEDUP_RELAY_WORKER"  # JSON: index and the inherited descriptors of one worker
# A worker's first lines, before the relay's imports: it dies with its supervisor (Linux
# PR_SET_PDEATHSIG: a supervisor killed with SIGKILL takes its workers along, as one process
# would, instead of leaving them on the port; gone already: exit); a stop signal or a SIGHUP
# forwarded while it still imports is kept, and handled once its loop runs.
WORKER_COMMAND = (
    "import ctypes, os, signal; early = []\n"
    "try: ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"  # 1: PR_SET_PDEATHSIG
    "except (OSError, AttributeError): pass\n"
    "if os.getppid() != {supervisor}: os._exit(1)\n"
    "for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
    "    signal.signal(sig, lambda n, _: early.append(n))\n"
    # started with SIGHUP blocked (spawn_worker): one that came meanwhile is delivered now
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGHUP}})\n"
    "from relay.supervision.worker import worker_main; worker_main(early)")


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker finds in :data:`WORKER_ENV`: its ``index``, the descriptors of the
    listening sockets it inherits (``listen``, ``tls_listen``), of its settings pipe's read end
    (``settings``) and its status pipe's write end (``status``), the supervisor's
    ``metrics_port`` (0: off) and the file a reload's settings are handed over in."""

    index: int
    listen: tuple[int, ...]
    tls_listen: tuple[int, ...]
    settings: int
    status: int
    metrics_port: int
    reload_snapshot: str

    def dumps(self) -> str:
        """The JSON object for :data:`WORKER_ENV`."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> WorkerSpec:
        """The worker's spec, taken out of its environment. Raises KeyError without one."""
        spec = json.loads(os.environ.pop(WORKER_ENV))
        return cls(index=int(spec["index"]), listen=tuple(spec["listen"]),
                   tls_listen=tuple(spec["tls_listen"]), settings=int(spec["settings"]),
                   status=int(spec["status"]), metrics_port=int(spec["metrics_port"]),
                   reload_snapshot=str(spec["reload_snapshot"]))


def worker_share(settings: Settings, count: int) -> Settings:
    """A worker's settings: its share of ``max_connections`` among ``count`` workers (rounded
    up), the rest as ``settings``."""
    share = -(-settings.max_connections // count)
    # as plain Settings: those read with --config are of a class made for the file, which
    # pickle cannot name (the worker got no settings: `serve --config F --workers 2` hung)
    return Settings.model_construct(**{**dict(settings), "max_connections": share})


def start_worker(index: int, listeners: Listeners, *, metrics_port: int,
                 metrics_dir: str | None, snapshot: Path
                 ) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start worker ``index`` on ``listeners``; its process, the write end of its settings
    pipe (for :func:`hand_settings`) and the read end of its status pipe. ``metrics_dir``: the
    prometheus-client multiprocess directory (None: metrics off). Raises OSError."""
    settings_r, settings_w = os.pipe()
    status_r, status_w = os.pipe()
    spec = WorkerSpec(index=index, listen=listeners.listen, tls_listen=listeners.tls_listen,
                      settings=settings_r, status=status_w, metrics_port=metrics_port,
                      reload_snapshot=str(snapshot))
    env = dict(os.environ, **{WORKER_ENV: spec.dumps()})
    if metrics_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        proc = spawn_worker(
            [sys.executable, "-c", WORKER_COMMAND.format(supervisor=os.getpid())],
            env=env, pass_fds=(*listeners.listen, *listeners.tls_listen, settings_r, status_w))
    finally:
        os.close(settings_r)
        os.close(status_w)
    return proc, settings_w, status_r


async def hand_settings(fd: int, settings: Settings, source: SettingsSource | None) -> None:
    """Write ``settings`` and ``source`` (where a reload reads them again) to a worker's
    settings pipe ``fd``, then close it. A worker that died at once (the pipe broken) is
    left to its exit code, which tells why."""
    with contextlib.suppress(BrokenPipeError), os.fdopen(fd, "wb") as out:
        payload = pickle.dumps((settings, source))
        await asyncio.to_thread(out.write, payload)


def read_settings(fd: int) -> tuple[Settings, SettingsSource | None]:
    """The worker's end of :func:`hand_settings`: the settings and their source read from
    ``fd`` (closed after)."""
    with os.fdopen(fd, "rb") as pipe:
        # a pipe from the parent process only
        settings, source = pickle.load(pipe)  # noqa: S301
    return settings, source


def spawn_worker(args: list[str], *, env: dict[str, str], pass_fds: tuple[int, ...]
                 ) -> subprocess.Popen[bytes]:
    """Start a worker process (``args``, stdin from /dev/null) with SIGHUP blocked until its
    handler is set: until then SIGHUP's default action would end it, and a reload (or a
    SIGHUP to the process group) while it starts would count as a failed start. The mask is
    set for this thread around the fork and survives ``execve(2)``; the worker unblocks it
    (:data:`WORKER_COMMAND`), and a SIGHUP that came meanwhile is delivered then.

    subprocess, not the event loop's spawn: libuv (uvloop) empties the child's signal mask.
    Raises OSError when the process cannot be started."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        # args: this interpreter and the relay's own worker command
        return subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL,  # noqa: S603
                                pass_fds=pass_fds)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


async def exited(proc: subprocess.Popen[bytes]) -> int:
    """Wait, without blocking the event loop, until ``proc`` exits; its exit code (negative:
    the signal that ended it). Waits on a pidfd (Linux >= 5.3), else in a thread."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return await asyncio.to_thread(proc.wait)
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await gone
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return proc.wait()
