"""The admin commands while ``fingerprint_secret_previous`` is set (design.md §2.3): a
recipient and key name the fingerprint's key and its key under the previous secret;
``fingerprint`` prints both, ``inspect``, ``release`` and ``mark-sent`` find the record under
either (the current key first); the settings refuse a previous secret that is the current one
or one without a current secret (exit 78)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from relay.core.interfaces import Settle, SettleOp, State
from relay.core.keys import KeyRules, recipient_key
from relay.store.sqlite.store import SqliteStore
from tests.support.cli import run_cli

RCPT = "jane@example.net"
SELECT = ("--rcpt", RCPT, "--template", "receipt", "--key", "order-7")
ROTATING = {"RELAY_FINGERPRINT_SECRET": "new secret", "RELAY_FINGERPRINT_SECRET_PREVIOUS":
            "old secret", "RELAY_STORE": "sqlite:///fp.db"}
CURRENT = recipient_key(RCPT, "receipt", "order-7", KeyRules(secret=b"new secret")).key
PREVIOUS = recipient_key(RCPT, "receipt", "order-7", KeyRules(secret=b"old secret")).key


def _write(path: Path, key: str, action: Settle) -> None:
    """What the relay keyed with the old secret left: ``key`` settled by ``action``."""
    async def write() -> None:
        store = await SqliteStore.open(str(path))
        try:
            await store.reserve([key], token="t", lease_s=60.0)
            await store.settle([SettleOp(key, action, "250 ok")], token="t", window_s=3600.0)
        finally:
            await store.close()

    asyncio.run(write())


def _state(path: Path, key: str) -> State:
    async def read() -> State:
        store = await SqliteStore.open(str(path))
        try:
            return (await store.inspect(key)).state
        finally:
            await store.close()

    return asyncio.run(read())


def test_fingerprint_prints_the_key_and_the_previous_secrets_key(tmp_path: Path) -> None:
    done = run_cli("fingerprint", *SELECT, cwd=tmp_path, env=ROTATING)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert (printed["key"], printed["previous_key"]) == (CURRENT, PREVIOUS)


def test_inspect_and_release_find_the_record_under_the_previous_key(tmp_path: Path) -> None:
    _write(tmp_path / "fp.db", PREVIOUS, Settle.UNKNOWN)
    seen = run_cli("inspect", *SELECT, cwd=tmp_path, env=ROTATING)
    assert seen.returncode == 0, seen.stderr
    assert json.loads(seen.stdout)["key"] == PREVIOUS
    assert json.loads(seen.stdout)["state"] == "unknown"
    released = run_cli("release", *SELECT, "--reason", "upstream log: not delivered",
                       cwd=tmp_path, env=ROTATING)
    assert released.returncode == 0, released.stderr
    said = json.loads(released.stdout)
    assert said["released"] and said["previous"]["key"] == PREVIOUS
    assert _state(tmp_path / "fp.db", PREVIOUS) is State.ABSENT


def test_a_record_under_the_current_key_is_the_one_found(tmp_path: Path) -> None:
    _write(tmp_path / "fp.db", PREVIOUS, Settle.UNKNOWN)
    _write(tmp_path / "fp.db", CURRENT, Settle.SENT)
    seen = run_cli("inspect", *SELECT, cwd=tmp_path, env=ROTATING)
    assert (json.loads(seen.stdout)["key"], json.loads(seen.stdout)["state"]) == (
        CURRENT, "sent")


def test_mark_sent_of_a_fingerprint_found_nowhere_marks_the_current_key(
        tmp_path: Path) -> None:
    _write(tmp_path / "fp.db", "other:key", Settle.SENT)  # the file exists
    done = run_cli("mark-sent", *SELECT, "--reason", "upstream log: delivered", cwd=tmp_path,
                   env=ROTATING)
    assert done.returncode == 0, done.stderr
    assert _state(tmp_path / "fp.db", CURRENT) is State.SENT
    assert _state(tmp_path / "fp.db", PREVIOUS) is State.ABSENT


@pytest.mark.parametrize(("env", "words"), [
    ({"RELAY_FINGERPRINT_SECRET": "same", "RELAY_FINGERPRINT_SECRET_PREVIOUS": "same"},
     "it is the current fingerprint secret"),
    ({"RELAY_FINGERPRINT_SECRET_PREVIOUS": "old"}, "set the current one too"),
])
def test_check_config_refuses_a_previous_secret_that_names_no_rotation(
        tmp_path: Path, env: dict[str, str], words: str) -> None:
    done = run_cli("check-config", "--upstream", "127.0.0.1:25", cwd=tmp_path, env=env)
    assert done.returncode == 78, done
    assert words in done.stderr, done.stderr


def test_explain_names_both_store_keys_and_the_content_digest(tmp_path: Path) -> None:
    saved = tmp_path / "receipt.eml"
    saved.write_bytes(b"From: shop@shop.example\r\nTo: jane@example.net\r\n"
                      b"X-Template: receipt\r\nX-Dedupe-Key: order-7\r\nSubject: Receipt\r\n"
                      b"\r\nThanks for your order of 2024-01-08 09:00.\r\n")
    done = run_cli("explain", str(saved), "--json", cwd=tmp_path, env=ROTATING)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["store_keys"] == {RCPT: CURRENT}
    assert found["previous_store_keys"] == {RCPT: PREVIOUS}
    digest = found["content_digest"]
    assert isinstance(digest, str) and len(digest) == 10
    later = saved.read_bytes().replace(b"09:00", b"09:05")  # a retry's timestamp: one content
    saved.write_bytes(later)
    again = json.loads(run_cli("explain", str(saved), "--json", cwd=tmp_path,
                               env=ROTATING).stdout)
    assert again["content_digest"] == digest
