"""A private PostgreSQL server for one run: its own cluster in a temp dir, a free loopback port,
started, stopped, restarted and killed on request, always gone at the end.

The fault bench (``bench/faultbench/lib.py``) and the benchmark (``bench/run.py``) use
it instead of the shared server on 5432, which they must not stop. ``initdb`` runs once per
process into a template directory (removed at exit); every :class:`PrivatePostgres` copies it,
with the store's schema already applied (what ``dedup-relay db upgrade`` runs) unless
``schema=False``.

We usually run as root, which ``initdb`` and ``postgres`` refuse: as root every PostgreSQL
command runs as the ``postgres`` OS user (``runuser -u postgres --``), and the cluster lives in
a directory that user owns. Authentication is ``trust`` for ``postgres`` over loopback TCP and
the socket directory; durability is PostgreSQL's default (``fsync = on``,
``synchronous_commit = on``). Every wait is bounded; each postmaster started here is also
killed (SIGKILL to its process group) at interpreter exit when a caller's ``finally`` could not
run.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tests.support.postgres import run_apart, upgrade_store

OS_USER = "postgres"
"""The OS user PostgreSQL runs as when we are root (Debian's package creates it)."""
START_TIMEOUT_S = 30
"""Bound of ``pg_ctl start`` / ``restart`` / ``stop`` (crash recovery included), seconds."""

_TEMPLATES: dict[bool, Path] = {}  # by "with the store's schema"
_TEMPLATE_LOCK = threading.Lock()
_LIVE: set[int] = set()  # postmaster pids started here and not yet stopped


class PostgresError(RuntimeError):
    """A PostgreSQL program failed or a wait ran out; the message carries its output."""


def bin_dir() -> Path:
    """The newest ``/usr/lib/postgresql/N/bin`` (Debian's layout), else the dir of ``initdb``
    on the PATH. Raises :class:`PostgresError` when PostgreSQL is not installed."""
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                      key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.parent.name)])
    if versions:
        return versions[-1].parent
    found = shutil.which("initdb")
    if found is None:
        raise PostgresError("PostgreSQL is not installed (Debian package postgresql)")
    return Path(found).resolve().parent


def version() -> str:
    """The server's version, e.g. ``15.8`` (``?`` when it cannot be read)."""
    try:
        out = subprocess.run([str(bin_dir() / "postgres"), "--version"], capture_output=True,
                             text=True, timeout=10, check=False).stdout
    except (OSError, PostgresError, subprocess.TimeoutExpired):
        return "?"
    m = re.search(r"(\d+(\.\d+)?)", out)
    return m.group(1) if m else "?"


def _as_owner(argv: list[str]) -> list[str]:
    """``argv`` run as :data:`OS_USER` when we are root, else as we are."""
    if os.geteuid() == 0:
        return ["runuser", "-u", OS_USER, "--", *argv]
    return argv


def _chown_tree(path: Path) -> None:
    """Give ``path`` (a dir) to :data:`OS_USER` when we are root."""
    if os.geteuid() == 0:
        entry = pwd.getpwnam(OS_USER)
        for root, dirs, files in os.walk(path):
            for name in [*dirs, *files]:
                os.lchown(Path(root) / name, entry.pw_uid, entry.pw_gid)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _run(argv: list[str], timeout_s: float = START_TIMEOUT_S + 10) -> str:
    """Run ``argv`` (as the cluster's owner); its output, or :class:`PostgresError`."""
    try:
        done = subprocess.run(_as_owner(argv), capture_output=True, text=True,
                              timeout=timeout_s, check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise PostgresError(f"{Path(argv[0]).name} did not finish in {timeout_s:g} s") from exc
    if done.returncode != 0:
        raise PostgresError(f"{' '.join(argv)} exited {done.returncode}: "
                            f"{(done.stdout + done.stderr).strip()[-800:]}")
    return done.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _new_base(prefix: str) -> Path:
    """A new temp dir the cluster's owner can enter (pytest's tmp dirs are 0700 root's)."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    base.chmod(0o755)
    _chown_tree(base)
    return base


def template(*, schema: bool = True) -> Path:
    """The data directory of this process's template cluster (``initdb`` once; with
    ``schema`` also the store's tables, made by the code of ``dedup-relay db upgrade``).
    Removed at interpreter exit. Raises :class:`PostgresError` (asyncpg's errors when the
    schema cannot be applied)."""
    with _TEMPLATE_LOCK:
        if schema not in _TEMPLATES:
            base = _new_base("pg-template-")
            atexit.register(shutil.rmtree, base, ignore_errors=True)
            data = base / "data"
            _run([str(bin_dir() / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
                  "-E", "UTF8", "--locale=C", "--no-sync"])
            if schema:
                server = PrivatePostgres(data_from=data, copy=False)
                try:
                    server.start()
                    # what `dedup-relay db upgrade --store URL` runs, without a process start
                    run_apart(upgrade_store(server.url))
                finally:
                    server.stop("fast")
                    (data / "postmaster.opts").unlink(missing_ok=True)
            _TEMPLATES[schema] = data
        return _TEMPLATES[schema]


class PrivatePostgres:
    """One private cluster: a copy of the template (or ``data_from``) under its own temp dir,
    served on ``port`` (free, loopback) with its socket and log (``postgres.log``) beside it.

    ``settings``: more ``-c NAME=VALUE`` server settings. Call :meth:`close` when done (it
    stops the server if running and removes the directory); the methods raise
    :class:`PostgresError` when a PostgreSQL program fails or a bounded wait runs out.
    """

    def __init__(self, *, schema: bool = True, settings: dict[str, str] | None = None,
                 data_from: Path | None = None, copy: bool = True) -> None:
        source = data_from if data_from is not None else template(schema=schema)
        if copy:
            self.base = _new_base("pg-private-")
            self.data = self.base / "data"
            subprocess.run(["cp", "-a", str(source), str(self.data)], check=True, timeout=120)
            _chown_tree(self.base)
        else:
            self.base, self.data = source.parent, source
        self.owns_base = copy
        self.port = _free_port()
        self.log_path = self.base / "postgres.log"
        self.settings = {"listen_addresses": "127.0.0.1", "fsync": "on",
                         "synchronous_commit": "on", **(settings or {})}
        self.pid: int | None = None

    @property
    def url(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres``."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _pg_ctl(self, *args: str) -> str:
        return _run([str(bin_dir() / "pg_ctl"), "-D", str(self.data), *args],
                    timeout_s=START_TIMEOUT_S + 10)

    def _options(self) -> str:
        opts = [f"-p {self.port}", f"-k {self.base}"]
        opts += [f"-c {name}={value}" for name, value in self.settings.items()]
        return " ".join(opts)

    def _read_pid(self) -> int:
        lines = (self.data / "postmaster.pid").read_text().splitlines()
        return int(lines[0])

    def start(self) -> None:
        """Start the server (crash recovery first, after a kill) and wait until it accepts
        connections."""
        self._pg_ctl("start", "-w", "-t", str(START_TIMEOUT_S), "-l", str(self.log_path),
                     "-o", self._options())
        self.pid = self._read_pid()
        _LIVE.add(self.pid)

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m MODE`` (``smart``, ``fast`` or ``immediate``: no checkpoint, crash
        recovery at the next start) and wait until the postmaster is gone."""
        if self.pid is None:
            return
        self._pg_ctl("stop", "-w", "-t", str(START_TIMEOUT_S), "-m", mode)
        _LIVE.discard(self.pid)
        self.pid = None

    def restart(self, mode: str = "fast") -> None:
        """``pg_ctl restart -m MODE``: stopped, then started with the same settings."""
        self._pg_ctl("restart", "-w", "-t", str(START_TIMEOUT_S), "-m", mode,
                     "-l", str(self.log_path), "-o", self._options())
        if self.pid is not None:
            _LIVE.discard(self.pid)
        self.pid = self._read_pid()
        _LIVE.add(self.pid)

    def kill(self, wait_s: float = 10.0) -> None:
        """SIGKILL to the postmaster alone (as the OOM killer does); its backends notice and
        exit by themselves; any still there after ``wait_s`` seconds is killed too, so that
        :meth:`start` can run (a new postmaster refuses while old backends hold the shared
        memory)."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        children = _descendants(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _LIVE.discard(pid)
        deadline = time.monotonic() + wait_s
        left = [pid, *children]
        while left and time.monotonic() < deadline:
            left = [p for p in left if _alive(p)]
            time.sleep(0.02)
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        # The dead postmaster stays a zombie until PID 1 reaps it, and a zombie's pid in
        # postmaster.pid reads as a server still running: wait for the reaping (bounded), then
        # take the lock file away (every process of the old server is dead by now).
        deadline = time.monotonic() + 5.0
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if Path(f"/proc/{pid}").exists():
            (self.data / "postmaster.pid").unlink(missing_ok=True)

    def close(self, *, log_to: Path | None = None) -> None:
        """Stop the server (``immediate``; SIGKILL when that fails), copy its log to
        ``log_to`` (when given) and remove its dir."""
        try:
            if self.pid is not None:
                try:
                    self.stop("immediate")
                except PostgresError:
                    self.kill()
        finally:
            if log_to is not None:
                with contextlib.suppress(OSError):
                    shutil.copyfile(self.log_path, log_to)
            if self.owns_base:
                shutil.rmtree(self.base, ignore_errors=True)


def _descendants(root: int) -> list[int]:
    """The live descendants of ``root`` (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                raw = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(raw[raw.rindex(")") + 2:].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@atexit.register
def _kill_leftover_servers() -> None:
    """Last resort: SIGKILL every postmaster started here and still running, with its process
    group (``pg_ctl`` starts the postmaster in a session of its own)."""
    for pid in list(_LIVE):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
