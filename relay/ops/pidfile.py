"""The pid file (setting ``pid_file``): the process id of the serving relay, for
``dedup-relay reload`` (which sends it SIGHUP) and service managers."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_pid_file(path: Path, pid: int | None = None) -> None:
    """Write ``pid`` (default: this process's) and a newline to ``path``, atomically (a
    reader sees the old content or the new, never a partial one). Raises OSError."""
    pid = os.getpid() if pid is None else pid
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(f"{pid}\n", encoding="ascii")
        temporary.replace(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def read_pid_file(path: Path) -> int:
    """The process id in ``path``. Raises OSError when it cannot be read, ValueError when it
    holds no positive integer."""
    text = path.read_text(encoding="ascii", errors="replace").strip()
    pid = int(text)
    if pid <= 0:
        raise ValueError(f"{pid} is no process id")
    return pid


def remove_pid_file(path: Path, pid: int | None = None) -> None:
    """Remove ``path`` when it still holds ``pid`` (default: this process's): a relay started
    since, writing its own, keeps its file. Never raises."""
    pid = os.getpid() if pid is None else pid
    with contextlib.suppress(OSError, ValueError):
        if read_pid_file(path) == pid:
            path.unlink()
