"""The files and directories the relay creates are its user's alone, whatever the umask it was
started with (relay.cli.group.private_files): files 0600, directories 0700."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

from tests.support.cli import smtp_send, wait_for_port
from tests.support.clients import message
from tests.support.net import free_port

STORE_PREFIX = "email:fp:"


def mode(path: Path) -> int:
    """The permission bits of ``path``."""
    return stat.S_IMODE(path.stat().st_mode)


def owed_journal(path: Path, store_url: str) -> None:
    """A settle journal with one settle owed to the relay's store (paid at its start, so the
    relay rewrites the file) and one owed to another store (kept, so the file stays)."""
    lines = [{"store": f"{store_url} prefix={STORE_PREFIX}", "token": "t1", "key": "k1",
              "action": "release", "reply": ""},
             {"store": "redis://elsewhere:6379/0 prefix=x:", "token": "t2", "key": "k2",
              "action": "release", "reply": ""}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def test_files_the_relay_creates_are_private_under_umask_000(tmp_path: Path) -> None:
    """Under umask 000 the SQLite store and its WAL, the rewritten settle journal and its lock,
    the pid file, the Maildir and the metrics directory with its files are 0600 / 0700."""
    port, metrics_port = free_port(), free_port()
    store = tmp_path / "state" / "relay.db"
    store.parent.mkdir()
    journal = tmp_path / "owed.jsonl"
    owed_journal(journal, f"sqlite:///{store}")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env["TMPDIR"] = str(temporary)
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "serve", "--listen", f"127.0.0.1:{port}",
         "--upstream", f"maildir:{tmp_path / 'mail'}", "--store", f"sqlite:///{store}",
         "--metrics-listen", f"127.0.0.1:{metrics_port}", "--workers", "2",
         "--pid-file", str(tmp_path / "relay.pid"), "--settle-journal", str(journal)],
        cwd=tmp_path, env=env, umask=0, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        wait_for_port(port, proc)
        code, _ = smtp_send(port, message(key="private-files"))
        assert code == 250
        files = [store, Path(f"{store}-wal"), journal, tmp_path / "owed.jsonl.lock",
                 tmp_path / "relay.pid"]
        files += [p for p in (tmp_path / "mail").rglob("*") if p.is_file()]
        metrics_dirs = list(temporary.glob("dedup-relay-metrics-*"))
        assert len(metrics_dirs) == 1
        files += list(metrics_dirs[0].iterdir())
        directories = [metrics_dirs[0], tmp_path / "mail"]
        directories += [p for p in (tmp_path / "mail").rglob("*") if p.is_dir()]
        assert {str(p): oct(mode(p)) for p in files if mode(p) != 0o600} == {}
        assert {str(p): oct(mode(p)) for p in directories if mode(p) != 0o700} == {}
        assert len(journal.read_text(encoding="utf-8").splitlines()) == 1  # it was rewritten
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)
