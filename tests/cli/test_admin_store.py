"""The admin commands say which store they read: an operator whose relay runs on Redis, who
gets "absent" from the quick start's SQLite file, sees why."""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

from tests.support.cli import run_cli


def test_inspect_names_the_sqlite_file_it_read(
        serve: tuple[int, int, subprocess.Popen[str]], tmp_path: Path) -> None:
    """The embedded store's absolute path, its kind and the key prefix, on stderr before the
    answer (stdout stays the JSON record)."""
    done = run_cli("inspect", "--store-key", "email:fp:none", cwd=tmp_path)
    assert done.returncode == 1, done
    assert (f"dedup-relay: store: sqlite:///{tmp_path}/data/dedup-relay.db (embedded sqlite), "
            "prefix email:fp:, hex keys") in done.stderr.splitlines()
    assert '"state": "absent"' in done.stdout


def test_release_names_the_redis_store_without_its_password(tmp_path: Path) -> None:
    """The Redis URL with its password masked, said even when the store then fails (exit 3:
    this Redis wants no password)."""
    done = run_cli("release", "--store", "redis://:hunter2@127.0.0.1:6379/0", "--store-key",
                   "app:fp:k", "--reason", "test", cwd=tmp_path,
                   env={"RELAY_STORE_PREFIX": "app:fp:", "RELAY_STORE_TIMEOUT": "1"})
    assert ("dedup-relay: store: redis://:***@127.0.0.1:6379/0 (redis), prefix app:fp:, "
            "hex keys") in done.stderr.splitlines(), done
    assert "hunter2" not in done.stderr + done.stdout


def test_inspect_names_the_key_format_it_computes(tmp_path: Path) -> None:
    """store_key_format compact: the line says so, since a hex-key inspect of a compact-key
    relay's record answers "absent"."""
    sqlite3.connect(tmp_path / "d.db").close()  # an existing file (a missing one is refused)
    done = run_cli("inspect", "--store", "sqlite:///d.db", "--store-key", "email:fp:none",
                   cwd=tmp_path, env={"RELAY_STORE_KEY_FORMAT": "compact"})
    assert any(line.endswith("prefix email:fp:, compact keys")
               for line in done.stderr.splitlines()), done
