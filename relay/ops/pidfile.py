"""The pid file (setting ``pid_file``): the process id of the serving relay, for
``dedup-relay reload`` (which sends it SIGHUP) and service managers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
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


# interpreter options that take a separate argument (``python -X dev -m relay``)
_PYTHON_OPTIONS_WITH_ARGUMENT = frozenset({"-X", "-W", "-Q"})
# the console script, and the package run as a module
_ENTRY_SCRIPTS = frozenset({"dedup-relay"})
# the whole command line of a supervisor once it named itself (setproctitle, relay.supervision)
_TITLES = frozenset({"dedup-relay: supervisor"})
_ENTRY_MODULES = frozenset({"relay", "relay.cli", "relay.__main__"})


def serving_relay_argv(argv: Sequence[str]) -> bool:
    """Whether a command line ``argv`` (as ``/proc/PID/cmdline`` holds it) is ``dedup-relay
    serve``: the program is the console script ``dedup-relay`` (run directly, or as a Python
    interpreter's script) or the interpreter runs the module ``relay`` (``python -m relay``),
    and the first word after it that is no option is ``serve``.

    Only those positions count: a word elsewhere that merely contains ``dedup-relay`` (a log
    file's name given to ``tail -f``, a folder named ``dedup-relay`` on the interpreter's path)
    does not make a process the relay. A supervisor renames itself: its whole command line is
    then exactly ``dedup-relay: supervisor``; a relay whose flags held a secret rewrote its
    command line as one string (the words joined by spaces, the secret hidden).
    """
    if not argv:
        return False
    if len(argv) == 1 and argv[0].strip() in _TITLES:
        return True
    if len(argv) == 1:  # a command line rewritten as one string (secrets hidden, setproctitle)
        argv = argv[0].split()
    rest: list[str] | None = None
    if Path(argv[0]).name in _ENTRY_SCRIPTS:
        rest = list(argv[1:])
    elif Path(argv[0]).name.startswith("python"):
        rest = _after_python_entry(list(argv[1:]))
    if rest is None:
        return False
    words = [word for word in rest if not word.startswith("-")]
    return bool(words) and words[0] == "serve"


def _after_python_entry(args: list[str]) -> list[str] | None:
    """What follows the relay's entry point in a Python interpreter's arguments ``args``
    (``-m relay ...`` or ``/path/dedup-relay ...``), or None when the interpreter runs
    something else (a script, ``-c``, another module)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            module = args[i + 1] if i + 1 < len(args) else ""
            return args[i + 2:] if module in _ENTRY_MODULES else None
        if arg.startswith("-m") and len(arg) > 2:
            return args[i + 1:] if arg[2:] in _ENTRY_MODULES else None
        if arg == "-c" or arg.startswith("-c"):
            return None
        if arg in _PYTHON_OPTIONS_WITH_ARGUMENT:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return args[i + 1:] if Path(arg).name in _ENTRY_SCRIPTS else None
    return None


def is_serving_relay(pid: int) -> bool | None:
    """True when process ``pid`` is ``dedup-relay serve`` (:func:`serving_relay_argv` of its
    ``/proc/PID/cmdline``), False when it is another program or gone, None when this system
    has no ``/proc`` to tell."""
    if not Path("/proc/self/cmdline").exists():
        return None
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return serving_relay_argv([a.decode(errors="replace") for a in raw.split(b"\0") if a])
