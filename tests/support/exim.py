"""A private Exim smarthost on loopback, for the tests whose evidence is Exim's logs.

Installing Debian's exim4 would remove Postfix (both provide mail-transport-agent, and the
suite needs Postfix), so Exim is unpacked privately instead: ``apt-get download`` of
``exim4-daemon-light`` and the one library its binary needs that a Debian with Postfix
lacks (``libidn12``, found with ``ldd``),
``dpkg -x`` into a cache folder (``$DEDUP_RELAY_EXIM_CACHE``, by default
``~/.cache/dedup-relay-tests/exim``), done once and shared by every test run. Debian builds
Exim with its user looked up by name at start (``EXIM_USER=ref:Debian-exim``), a user only the
package's install creates; the cached copy of the binary has that name changed to ``mail``
(a user and group every Debian system has) so nothing on the system is touched. Each
instance runs ``exim -bdf -C CONFIG`` as root, with its spool and logs in its own folder,
accepting every message to ``:blackhole:`` and refusing at end of data (an ``acl_smtp_data``
deny) any message carrying the header :data:`REFUSE_HEADER`.

No skip: when Exim cannot be fetched or started, :func:`installed` and :func:`private_exim`
raise (the tests that need it fail loudly). ``python -m tests.support.exim`` unpacks it (what
.ci/run does before the tests)."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("exim4-daemon-light", "libidn12")
REFUSE_HEADER = "X-Test-Refuse"
REFUSAL_TEXT = "refused by the test smarthost"
_USER = "mail"  # the user and group the private Exim runs its deliveries as
_DEBIAN_USER = b"Debian-exim\0"


def cache_dir() -> Path:
    """Where the unpacked Exim is kept between runs."""
    default = Path.home() / ".cache" / "dedup-relay-tests" / "exim"
    return Path(os.environ.get("DEDUP_RELAY_EXIM_CACHE", default))


def _binary(root: Path) -> Path:
    return root / "exim"


def _library_path(root: Path) -> str:
    return str(root / "usr" / "lib" / "x86_64-linux-gnu") + ":" + str(root / "usr" / "lib")


def installed() -> Path:
    """The folder of the unpacked Exim (its binary is ``exim`` in it), unpacking it first
    when absent. Raises RuntimeError (with apt's or the loader's words) when that fails."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / "root"
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist workers unpack it once between them
        if not _binary(root).exists():
            _unpack(cache, root)
    return root


def _unpack(cache: Path, root: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="unpack-", dir=cache))
    try:
        fetched = subprocess.run(["apt-get", "download", *PACKAGES], cwd=work,
                                 capture_output=True, text=True, timeout=300, check=False)
        debs = sorted(work.glob("*.deb"))
        if fetched.returncode != 0 or len(debs) != len(PACKAGES):
            raise RuntimeError(f"apt-get download {' '.join(PACKAGES)} failed: "
                               f"{fetched.stderr.strip()}")
        tree = work / "root"
        for deb in debs:
            subprocess.run(["dpkg", "-x", str(deb), str(tree)], check=True, timeout=120)
        program = (tree / "usr" / "sbin" / "exim4").read_bytes()
        if _DEBIAN_USER not in program:
            raise RuntimeError("the exim4 binary does not name Debian-exim: cannot adapt it")
        patched = _USER.encode() + b"\0" * (len(_DEBIAN_USER) - len(_USER))
        _binary(tree).write_bytes(program.replace(_DEBIAN_USER, patched))
        _binary(tree).chmod(0o755)
        _check_loads(tree)
        if root.exists():
            shutil.rmtree(root)
        tree.rename(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_loads(root: Path) -> None:
    env = {"LD_LIBRARY_PATH": _library_path(root), "PATH": "/usr/bin:/bin"}
    linked = subprocess.run(["ldd", str(_binary(root))], capture_output=True, text=True,
                            env=env, timeout=60, check=False)
    missing = [line.strip() for line in linked.stdout.splitlines() if "not found" in line]
    if missing:
        raise RuntimeError(f"the unpacked exim cannot load: {missing}")


@dataclass(frozen=True)
class Exim:
    """A running private Exim: its SMTP port on 127.0.0.1 and its logs."""

    port: int
    main_log: Path
    reject_log: Path
    folder: Path


def exim_config(root: Path, folder: Path, port: int) -> str:
    """The private instance's configuration (``-C``)."""
    return f"""\
exim_path = {_binary(root)}
keep_environment = LD_LIBRARY_PATH
exim_user = {_USER}
exim_group = {_USER}
trusted_users = root
spool_directory = {folder / "spool"}
log_file_path = {folder / "log"}/%slog
pid_file_path = {folder / "exim.pid"}
primary_hostname = exim.test
daemon_smtp_ports = {port}
local_interfaces = 127.0.0.1
host_lookup =
rfc1413_hosts =
tls_advertise_hosts =
acl_smtp_rcpt = check_rcpt
acl_smtp_data = check_data

begin acl
check_rcpt:
  accept
check_data:
  deny message = {REFUSAL_TEXT}
       condition = ${{if def:h_{REFUSE_HEADER}:}}
  accept

begin routers
discard:
  driver = redirect
  data = :blackhole:
"""


@contextmanager
def private_exim(folder: Path, port: int) -> Iterator[Exim]:
    """An Exim listening on 127.0.0.1:``port`` with its spool and logs under ``folder``
    (made here; reachable by the user ``mail``); stopped (and waited for) at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    # a copy the user mail can run (Exim re-executes itself to deliver; the cache may be
    # under root's 0700 home)
    root = shutil.copytree(installed(), folder / "exim-root", symlinks=True)
    for sub in ("spool", "log"):
        (folder / sub).mkdir(exist_ok=True)
        shutil.chown(folder / sub, _USER, _USER)
    config = folder / "exim.conf"
    config.write_text(exim_config(root, folder, port))
    config.chmod(0o644)
    env = {"LD_LIBRARY_PATH": _library_path(root), "PATH": "/usr/bin:/bin"}
    stderr = folder / "exim.stderr"
    with stderr.open("wb") as said:
        process = subprocess.Popen([str(_binary(root)), "-C", str(config), "-bdf"], env=env,
                                   stdin=subprocess.DEVNULL, stdout=said, stderr=said)
    try:
        _wait_listening(port, process, stderr)
        yield Exim(port, folder / "log" / "mainlog", folder / "log" / "rejectlog", folder)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def _wait_listening(port: int, process: subprocess.Popen[bytes], stderr: Path) -> None:
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the private exim exited ({process.returncode}): "
                               f"{stderr.read_text(errors='replace')}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the private exim did not listen on 127.0.0.1:{port} within 30 s")


if __name__ == "__main__":
    print(installed())
