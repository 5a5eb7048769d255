"""The kinds of store (relay.store.registry): which kind takes a store URL is decided in one
place, importing the registry loads no driver, and a fourth kind added to the registry alone
(tests/support/memory_store.py, an in-memory store) is validated, checked, opened and named by
the settings, serves a relay, and passes a slice of the store contract
(tests/store/test_store_contract.py, run here against it)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from uuid import uuid4

import pytest

from relay.core.errors import ConfigError
from relay.core.interfaces import FingerprintStore
from relay.settings import check_settings, load_settings
from relay.store import registry
from tests.store import test_store_contract as contract
from tests.support.clients import message, send
from tests.support.memory_store import MEMORY, MemoryStore
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

# the contract, run against the in-memory kind (what it keeps: no foreign values, no SENDING)
test_reserve_absent_key_creates_pending = contract.test_reserve_absent_key_creates_pending
test_second_reserve_finds_first_pending = contract.test_second_reserve_finds_first_pending
test_reserve_again_with_same_token_is_idempotent = \
    contract.test_reserve_again_with_same_token_is_idempotent
test_mark_sent_records_time_reply_and_window = contract.test_mark_sent_records_time_reply_and_window
test_settle_with_wrong_token_changes_nothing = contract.test_settle_with_wrong_token_changes_nothing
test_release_with_right_token_deletes = contract.test_release_with_right_token_deletes
test_mark_unknown_records_time_and_window = contract.test_mark_unknown_records_time_and_window
test_reserve_after_sent_finds_sent_with_reply = \
    contract.test_reserve_after_sent_finds_sent_with_reply
test_reply_text_round_trips = contract.test_reply_text_round_trips
test_expired_lease_is_free_and_old_token_is_void = \
    contract.test_expired_lease_is_free_and_old_token_is_void
test_many_keys_report_individually = contract.test_many_keys_report_individually
test_settle_reports_each_op = contract.test_settle_reports_each_op
test_empty_calls_return_empty_lists = contract.test_empty_calls_return_empty_lists
test_force_release_deletes_whatever_is_there = contract.test_force_release_deletes_whatever_is_there
test_ping_answers = contract.test_ping_answers

URLS = {
    "redis://127.0.0.1:6379/0": "redis",
    "rediss://h:6380/1": "redis",
    "redis+cluster://h1:7000,h2:7001": "redis",
    "rediss+sentinel://s1:26379/mymaster": "redis",
    "sqlite:///data/dedup-relay.db": "embedded sqlite",
    "sqlite:////var/lib/dedup-relay/dedup.db": "embedded sqlite",
    "postgresql://relay@db:5432/relay": "postgresql",
    "postgres://relay@db/relay": "postgresql",
}


@pytest.fixture
def with_memory_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry with the in-memory kind as its fourth line, for this test."""
    monkeypatch.setattr(registry, "KINDS", (*registry.KINDS, MEMORY))


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"test:{uuid4().hex}:"


@pytest.fixture
async def store(with_memory_kind: None, tmp_path: Path) -> AsyncIterator[FingerprintStore]:
    """An in-memory store, opened by the settings from its URL as ``serve`` opens one."""
    settings = load_settings({"upstream": "maildir:md", "store": "memory://contract",
                              "settle_journal": str(tmp_path / "journal.jsonl")})
    opened = await settings.open_store(window_s=settings.dedup_window)
    yield opened
    await opened.close()


@pytest.mark.parametrize(("url", "label"), list(URLS.items()))
def test_each_store_url_is_taken_by_one_kind(url: str, label: str) -> None:
    """Every scheme of a store URL belongs to exactly one kind of the registry."""
    takers = [kind for kind in registry.KINDS if kind.takes(url)]
    assert [kind.label for kind in takers] == [label]
    assert registry.kind_of(url) is takers[0]


@pytest.mark.parametrize("url", ["mysql://h/db", "sqlite://h/db", "REDIS://h", "memory://x", ""])
def test_a_url_of_no_kind_is_taken_by_none(url: str) -> None:
    """A URL whose scheme no kind of the registry lists has no kind, and the setting refuses
    it with every kind's URL forms."""
    assert registry.kind_of(url) is None
    with pytest.raises(ConfigError) as refused:
        load_settings({"upstream": "maildir:md", "store": url})
    assert all(kind.forms in str(refused.value) for kind in registry.KINDS)


def test_importing_the_settings_loads_no_store_driver() -> None:
    """The settings and the registry they ask import no store's driver (asyncpg may be a
    missing extra): each kind imports its store when a store of that kind is opened."""
    probe = ("import sys, relay.settings, relay.store.registry\n"
             "print(sorted(m for m in ('asyncpg', 'redis', 'sqlite3') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"


async def test_a_kind_added_to_the_registry_is_validated_checked_opened_and_named(
        with_memory_kind: None, tmp_path: Path) -> None:
    """The fourth kind's URL is taken by the store setting, its check refuses a bad one, the
    file its URL names is checked, the store opens through the settings, and the start-up
    line and the admin commands name its kind."""
    dump = tmp_path / "dump.jsonl"
    settings = load_settings({"upstream": "maildir:md", "store": f"memory://kinds?dump={dump}",
                              "settle_journal": str(tmp_path / "journal.jsonl")})
    assert settings.store_kind == "in-memory"
    assert settings.describe_store() == f"memory://kinds?dump={dump} (in-memory)"
    assert settings.store_data_file is None
    check_settings(settings)
    store = await settings.open_store(window_s=settings.dedup_window)
    assert isinstance(store, MemoryStore)
    assert await store.identity() == "memory:kinds"
    await store.close()
    assert dump.read_text(encoding="utf-8") == ""
    with pytest.raises(ConfigError, match="must name its store: memory://NAME"):
        load_settings({"upstream": "maildir:md", "store": "memory://"})
    (tmp_path / "a-file").write_text("")
    unwritable = load_settings({"upstream": "maildir:md",
                                "store": f"memory://kinds?dump={tmp_path}/a-file/dump"})
    with pytest.raises(ConfigError, match=r"the memory store's dump .*a-file/dump cannot be made"):
        check_settings(unwritable)


async def test_a_relay_on_a_kind_added_to_the_registry_relays_a_message_once(
        with_memory_kind: None, make_relay: MakeRelay, sink: Sink, tmp_path: Path) -> None:
    """A relay whose store is of the fourth kind relays a message and suppresses its copy;
    its store holds the recipient's record as SENT (written out when the relay stops)."""
    dump = tmp_path / "dump.jsonl"
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}",
                             store=f"memory://relay?dump={dump}")
    first = await send(relay.port, ["user@example.net"], message(key="memory-1"))
    again = await send(relay.port, ["user@example.net"], message(key="memory-1"))
    assert first.code == 250 and "relayed 1" in first.text, first
    assert again.code == 250 and "suppressed" in again.text, again
    assert "relayed" not in again.text and sink.handler.copies_to("user@example.net") == 1
    await relay.stop()
    rows = [json.loads(line) for line in dump.read_text(encoding="utf-8").splitlines()]
    assert [row["state"] for row in rows] == ["sent"]
