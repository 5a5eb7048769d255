"""Admin commands (design.md §6.5) as an operator runs them: `dedup-relay fingerprint`,
`inspect` and `release` as processes, against the store a real relay process wrote to."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.core.fingerprint import fingerprint, store_key
from relay.core.recipients import normalize_recipient
from tests.support.cli import run_cli, smtp_send
from tests.support.clients import message
from tests.support.net import maildir_files
from tests.support.relays import REDIS_URL, delete_prefix

SEED_FP = "30c8e812a32d46b8971d68a9c547dce6f95a92a86987f0ad79879616407139b6"


def test_fingerprint_prints_the_seed_value(tmp_path: Path) -> None:
    """The pinned seed value, from the command line, with no store and no upstream set up."""
    done = run_cli("fingerprint", "--rcpt", "User@Example.com ", "--template", "welcome",
                   "--key", "W-1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"fingerprint": SEED_FP, "key": "email:fp:" + SEED_FP}


def test_fingerprint_follows_prefix_secret_and_several_keys(tmp_path: Path) -> None:
    """RELAY_STORE_PREFIX / RELAY_FINGERPRINT_SECRET apply; repeated --key is the key set."""
    env = {"RELAY_STORE_PREFIX": "app:", "RELAY_FINGERPRINT_SECRET": "s3cret"}
    done = run_cli("fingerprint", "--rcpt", "u@example.net", "--key", "B", "--key", "A",
                   "--key", "A", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    fp = fingerprint("u@example.net", "", "A\x1fB", secret=b"s3cret")
    assert json.loads(done.stdout) == {"fingerprint": fp, "key": "app:" + fp}


@pytest.mark.parametrize("args", [
    ("--rcpt", "user", "--key", "k"),                 # no domain: the relay refuses it
    ("--rcpt", "u@example.net", "--key", " "),        # an empty key: never deduplicated
    ("--rcpt", "u@example.net", "--key", "a\x01b"),   # a control character: 554 at DATA
])
def test_fingerprint_refuses_what_the_relay_refuses(tmp_path: Path, args: tuple[str, ...]
                                                    ) -> None:
    """Inputs the relay would refuse have no fingerprint: exit 2 with a reason."""
    done = run_cli("fingerprint", *args, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith("dedup-relay: "), done


def test_inspect_and_release_on_the_embedded_store(
        serve: tuple[int, int, subprocess.Popen[str]], tmp_path: Path) -> None:
    """Sent once -> SENT; released (audit line) -> absent; the next send is relayed again."""
    port, _, _ = serve
    assert smtp_send(port, message(key="order-42", template="receipt"))[0] == 250
    select = ("--rcpt", "user@example.net", "--template", "receipt", "--key", "order-42")
    seen = run_cli("inspect", *select, cwd=tmp_path)
    assert seen.returncode == 0, seen.stderr
    record = json.loads(seen.stdout)
    assert record["state"] == "sent" and record["reply"] and record["ttl_s"] > 80000
    assert smtp_send(port, message(key="order-42", template="receipt"))[0] == 250
    assert len(maildir_files(tmp_path / "maildir")) == 1  # the retry was a duplicate
    gone = run_cli("release", *select, "--reason", "customer asked for a copy", cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout)["released"] is True
    audit = json.loads(gone.stderr.strip().splitlines()[-1])
    assert audit["logger"] == "relay.audit" and audit["event"] == "admin_release"
    assert audit["reason"] == "customer asked for a copy"
    assert audit["previous"]["state"] == "sent" and audit["operator"]
    after = run_cli("inspect", *select, cwd=tmp_path)
    assert after.returncode == 1 and json.loads(after.stdout)["state"] == "absent"
    assert smtp_send(port, message(key="order-42", template="receipt"))[0] == 250
    assert len(maildir_files(tmp_path / "maildir")) == 2


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A random key prefix on the test Redis, deleted afterwards."""
    prefix = f"test:{uuid.uuid4().hex}:"
    yield prefix
    delete_prefix(REDIS_URL, prefix)


def test_release_by_store_key_on_redis(tmp_path: Path, redis_prefix: str) -> None:
    """--store-key selects the key directly; releasing nothing exits 1 and says so."""
    import redis

    key = store_key(redis_prefix, fingerprint(normalize_recipient("a@example.net"), "t", "k"))
    client = redis.Redis.from_url(REDIS_URL)
    client.set(key, "U|1700000000000", px=60_000)  # an in-doubt record, as the relay writes it
    env = {"RELAY_STORE": REDIS_URL, "RELAY_STORE_PREFIX": redis_prefix}
    seen = run_cli("inspect", "--store-key", key, cwd=tmp_path, env=env)
    assert json.loads(seen.stdout)["state"] == "unknown"
    assert json.loads(seen.stdout)["at"] == "2023-11-14T22:13:20.000000Z"
    first = run_cli("release", "--store-key", key, "--reason", "upstream log: not delivered",
                    cwd=tmp_path, env=env)
    assert first.returncode == 0 and client.exists(key) == 0, first.stderr
    again = run_cli("release", "--store-key", key, "--reason", "twice", cwd=tmp_path, env=env)
    assert again.returncode == 1 and json.loads(again.stdout)["released"] is False
    client.close()


def test_admin_commands_refuse_a_missing_sqlite_file(tmp_path: Path) -> None:
    """Run in the wrong directory, inspect does not create an empty database and say absent."""
    done = run_cli("inspect", "--store-key", "email:fp:x", cwd=tmp_path)
    assert done.returncode == 78 and "no database at data/dedup-relay.db" in done.stderr
    assert "--store, RELAY_STORE" in done.stderr
    assert not (tmp_path / "data").exists()


def test_admin_commands_report_a_store_that_is_down(tmp_path: Path) -> None:
    """A Redis that does not answer: exit 3 with the store's error, not a traceback."""
    done = run_cli("inspect", "--store", "redis://127.0.0.1:1/0", "--store-key", "email:fp:k",
                   cwd=tmp_path, env={"RELAY_STORE_TIMEOUT": "1"})
    assert done.returncode == 3 and "store failed" in done.stderr, done
    assert "Traceback" not in done.stderr


def test_fingerprint_with_auth_user_follows_scope_by_auth(tmp_path: Path) -> None:
    """--auth-user adds the tenant part when scope_by_auth is on, and is refused when off."""
    scoped = run_cli("fingerprint", "--rcpt", "u@example.net", "--key", "k", "--auth-user",
                     "shop@example.com", cwd=tmp_path, env={"RELAY_SCOPE_BY_AUTH": "true"})
    assert scoped.returncode == 0, scoped.stderr
    expected = fingerprint("u@example.net", "", "k", scope="shop@example.com")
    assert json.loads(scoped.stdout)["fingerprint"] == expected
    assert expected != fingerprint("u@example.net", "", "k")
    off = run_cli("fingerprint", "--rcpt", "u@example.net", "--key", "k", "--auth-user",
                  "shop@example.com", cwd=tmp_path)
    assert off.returncode == 2 and "scope_by_auth is off" in off.stderr


def _env(prefix: str, **extra: str) -> dict[str, str]:
    return {"RELAY_STORE": REDIS_URL, "RELAY_STORE_PREFIX": prefix, **extra}


def test_in_flight_records_are_refused_unless_forced(tmp_path: Path, redis_prefix: str) -> None:
    """PENDING, and SENDING within the lease, may still be delivered: release and mark-sent
    exit 4 and change nothing; --force acts; SENDING past the lease reads as unknown. The
    records live an hour and the lease is ten minutes, far beyond the six CLI runs before
    the last release (each a Python start; seconds apiece on a loaded runner)."""
    import time

    import redis

    client = redis.Redis.from_url(REDIS_URL)
    pending, sending, old = (redis_prefix + n for n in ("p", "s", "o"))
    now_ms = int(time.time() * 1000)
    client.set(pending, "P|tok", px=3_600_000)
    client.set(sending, f"D|tok|{now_ms}", px=3_600_000)
    client.set(old, f"D|tok|{now_ms - 1_200_000}", px=3_600_000)  # its relay died 20 min ago
    env = _env(redis_prefix, RELAY_LEASE="600", RELAY_UPSTREAM_TIMEOUT="30")
    for key in (pending, sending):
        for command in ("release", "mark-sent"):
            done = run_cli(command, "--store-key", key, "--reason", "r", cwd=tmp_path, env=env)
            assert done.returncode == 4 and "in flight" not in done.stdout, done
            assert "may still be delivering" in done.stderr
    assert client.exists(pending, sending) == 2
    seen = json.loads(run_cli("inspect", "--store-key", old, cwd=tmp_path, env=env).stdout)
    assert (seen["state"], seen["reads_as"]) == ("sending", "unknown")
    assert run_cli("release", "--store-key", old, "--reason", "dead relay", cwd=tmp_path,
                   env=env).returncode == 0
    forced = run_cli("release", "--store-key", pending, "--reason", "stuck", "--force",
                     cwd=tmp_path, env=env)
    assert forced.returncode == 0 and client.exists(pending, old) == 0
    client.close()


def test_mark_sent_turns_an_in_doubt_record_into_a_duplicate(
        tmp_path: Path, redis_prefix: str) -> None:
    """The upstream's log shows the in-doubt message delivered: mark-sent makes retries
    duplicates (SENT for the dedup window), with an audit line."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    key = redis_prefix + "u"
    client.set(key, "U|1700000000000", px=60_000)
    env = _env(redis_prefix, RELAY_DEDUP_WINDOW="7200")
    done = run_cli("mark-sent", "--store-key", key, "--reason", "smarthost log: queued as X1",
                   cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["previous"]["state"] == "unknown"
    audit = json.loads(done.stderr.strip().splitlines()[-1])
    assert audit["event"] == "admin_mark_sent" and audit["reason"].startswith("smarthost log")
    seen = json.loads(run_cli("inspect", "--store-key", key, cwd=tmp_path, env=env).stdout)
    assert seen["state"] == "sent" and "smarthost log: queued as X1" in seen["reply"]
    assert 7000 < seen["ttl_s"] <= 7200
    client.close()


@pytest.mark.parametrize("args", [
    ("inspect", "--store-key", "app:session:42"),
    ("release", "--store-key", "app:session:42", "--reason", "oops"),
    ("release", "--store-key", "email:fp:x", "--reason", "  "),
])
def test_keys_outside_the_prefix_and_empty_reasons_are_refused(
        tmp_path: Path, args: tuple[str, ...]) -> None:
    """A key of the application sharing the Redis is never touched; a reason is required."""
    done = run_cli(*args, cwd=tmp_path, env={"RELAY_STORE": REDIS_URL})
    assert done.returncode == 2 and done.stderr.startswith("dedup-relay: "), done


def test_mark_sent_gives_a_template_its_own_dedup_window(
        tmp_path: Path, redis_prefix: str) -> None:
    """mark-sent --template for a template with a [[template_policy]] window writes the
    record with that window (what the relay would have written), not dedup_window."""
    config = tmp_path / "relay.toml"
    config.write_text('[[template_policy]]\nmatch = "receipt-*"\ndedup_window = 600000\n')
    env = _env(redis_prefix, RELAY_DEDUP_WINDOW="7200", RELAY_CONFIG=str(config))
    ttls = []
    for template in ("receipt-order", "welcome"):
        args = ("--rcpt", "user@example.net", "--template", template, "--key", "K-1")
        done = run_cli("mark-sent", *args, "--reason", "smarthost log", cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr
        seen = json.loads(run_cli("inspect", *args, cwd=tmp_path, env=env).stdout)
        ttls.append(seen["ttl_s"])
    assert 599_000 < ttls[0] <= 600_000 and 7000 < ttls[1] <= 7200, ttls
