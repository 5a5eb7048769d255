"""A private Postfix instance on loopback (its own config, queue and data directories in a
temporary folder; the system's /etc/postfix is never touched): the benchmark's baseline
(bench/run.py) and the local queue in front of the relay (docs/deploy/local-queue.md). Needs
root (Postfix's daemons drop to the user ``postfix``) and Debian's postfix package."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

POSTFIX = "/usr/sbin/postfix"
POSTQUEUE = "/usr/sbin/postqueue"


def available() -> bool:
    """Whether a private instance can run here: Postfix installed, and this process root."""
    return Path(POSTFIX).exists() and os.geteuid() == 0


def queued(queue_dir: Path, subs: tuple[str, ...] = (
        "maildrop", "incoming", "active", "deferred", "hold")) -> int:
    """Messages in a Postfix queue directory's ``subs`` (all its queues by default;
    ``("deferred",)``: those whose delivery attempt failed and that wait for a retry)."""
    count = 0
    for sub in subs:
        for _, _, files in os.walk(queue_dir / sub):
            count += len(files)
    return count


def postfix_main_cf(conf: Path, queue: Path, data: Path, relaying: str) -> str:
    """main.cf of a private Postfix instance that relays for 127.0.0.0/8 as ``relaying`` (its
    ``relayhost`` and the settings around it) says."""
    return f"""\
compatibility_level = 3.6
config_directory = {conf}
queue_directory = {queue}
data_directory = {data}
myhostname = postfix.bench
mydomain = bench
myorigin = postfix.bench
mydestination =
inet_interfaces = 127.0.0.1
inet_protocols = ipv4
mynetworks = 127.0.0.0/8
smtpd_relay_restrictions = permit_mynetworks, reject
smtpd_tls_security_level = none
biff = no
append_dot_mydomain = no
alias_maps =
alias_database =
local_recipient_maps =
smtp_host_lookup = native
maillog_file = {conf.parent / "maillog"}
maillog_file_prefixes = {conf.parent}
multi_instance_enable = no
""" + relaying


def postfix_master_cf(port: int) -> str:
    """master.cf of the private instance: smtpd on 127.0.0.1:``port``, no chroot."""
    services = [
        (f"127.0.0.1:{port}", "inet", "n", "-", "n", "-", "-", "smtpd"),
        ("pickup", "unix", "n", "-", "n", "60", "1", "pickup"),
        ("cleanup", "unix", "n", "-", "n", "-", "0", "cleanup"),
        ("qmgr", "unix", "n", "-", "n", "300", "1", "qmgr"),
        ("rewrite", "unix", "-", "-", "n", "-", "-", "trivial-rewrite"),
        ("bounce", "unix", "-", "-", "n", "-", "0", "bounce"),
        ("defer", "unix", "-", "-", "n", "-", "0", "bounce"),
        ("trace", "unix", "-", "-", "n", "-", "0", "bounce"),
        ("verify", "unix", "-", "-", "n", "-", "1", "verify"),
        ("flush", "unix", "n", "-", "n", "1000?", "0", "flush"),
        ("proxymap", "unix", "-", "-", "n", "-", "-", "proxymap"),
        ("smtp", "unix", "-", "-", "n", "-", "-", "smtp"),
        ("relay", "unix", "-", "-", "n", "-", "-", "smtp"),
        ("showq", "unix", "n", "-", "n", "-", "-", "showq"),
        ("error", "unix", "-", "-", "n", "-", "-", "error"),
        ("retry", "unix", "-", "-", "n", "-", "-", "error"),
        ("discard", "unix", "-", "-", "n", "-", "-", "discard"),
        ("anvil", "unix", "-", "-", "n", "-", "1", "anvil"),
        ("scache", "unix", "-", "-", "n", "-", "1", "scache"),
        ("postlog", "unix-dgram", "n", "-", "n", "-", "1", "postlogd"),
    ]
    return "".join(" ".join(s) + "\n" for s in services)


@contextmanager
def private_postfix(folder: Path, port: int, relaying: str) -> Iterator[Path]:
    """A private instance listening on 127.0.0.1:``port``, relaying as ``relaying`` says;
    yields its queue directory; stopped (and waited for) at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)  # Postfix's daemons (user postfix) reach their dirs through it
    conf, queue, data = folder / "etc", folder / "queue", folder / "data"
    for d in (conf, queue, data):
        d.mkdir()
    shutil.chown(data, "postfix")
    (conf / "main.cf").write_text(postfix_main_cf(conf, queue, data, relaying))
    (conf / "master.cf").write_text(postfix_master_cf(port))
    _postfix(conf, "set-permissions", check=True)
    _postfix(conf, "start", check=True)
    pid_file = queue / "pid" / "master.pid"
    try:
        for _ in range(100):
            if pid_file.exists() and pid_file.read_text().strip():
                break
            time.sleep(0.05)
        yield queue
    finally:
        pid = pid_file.read_text().split()[0] if pid_file.exists() else ""
        _postfix(conf, "stop", check=False)
        for _ in range(200):
            if not pid or not Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.05)


def _postfix(conf: Path, command: str, *, check: bool) -> None:
    subprocess.run([POSTFIX, "-c", str(conf), command], check=check, timeout=60,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def flush(queue: Path) -> None:
    """Ask the instance whose queue is ``queue`` to deliver its deferred mail now."""
    subprocess.run([POSTQUEUE, "-c", str(queue.parent / "etc"), "-f"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
