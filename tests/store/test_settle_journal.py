"""The settle journal file (relay/store/journal.py): several relays started from one directory
share it, so no change may drop another relay's lines."""

from __future__ import annotations

from pathlib import Path

from relay.core.interfaces import Settle, SettleOp
from relay.store.journal_file import add_to_journal, read_journal, remove_from_journal

STORE = "redis://127.0.0.1:6379/0 prefix=email:fp:"


def test_two_relays_adding_to_one_journal_keep_both_their_settles(tmp_path: Path) -> None:
    """Relay A and then relay B write what they owe at exit: the file holds both."""
    path = tmp_path / "owed.jsonl"
    a = ("token-a", SettleOp("email:fp:1", Settle.SENT, "250 ok"))
    b = ("token-b", SettleOp("email:fp:2", Settle.RELEASE))
    add_to_journal(path, [a], STORE)
    add_to_journal(path, [b, a], STORE)  # the same settle twice is kept once
    assert read_journal(path, STORE) == [a, b]


def test_removing_what_one_relay_paid_keeps_the_others(tmp_path: Path) -> None:
    """A start that paid A's settle removes that line only; the file goes once empty."""
    path = tmp_path / "owed.jsonl"
    a = ("token-a", SettleOp("email:fp:1", Settle.UNKNOWN))
    b = ("token-b", SettleOp("email:fp:2", Settle.SENT, "250 queued"))
    add_to_journal(path, [a, b], STORE)
    remove_from_journal(path, [a], STORE)
    assert read_journal(path, STORE) == [b]
    remove_from_journal(path, [b], STORE)
    assert not path.exists()


def test_a_line_that_is_no_settle_is_skipped(tmp_path: Path) -> None:
    """A damaged line is skipped (and logged), the good ones are read."""
    path = tmp_path / "owed.jsonl"
    a = ("token-a", SettleOp("email:fp:1", Settle.SENT, "250 ok"))
    add_to_journal(path, [a], STORE)
    path.write_text(path.read_text() + '{"token": "x", "action": "explode"}\nnot json\n')
    assert read_journal(path, STORE) == [a]


def test_a_relay_on_another_store_neither_reads_nor_removes_the_lines(tmp_path: Path) -> None:
    """Lines owed to one store are invisible to a relay on another store started from the same
    directory, and survive its start (a new user found the other relay took them)."""
    path = tmp_path / "owed.jsonl"
    a = ("token-a", SettleOp("email:fp:1", Settle.SENT, "250 ok"))
    add_to_journal(path, [a], STORE)
    other = "sqlite:///data/other.db prefix=email:fp:"
    assert read_journal(path, other) == []
    remove_from_journal(path, [a], other)
    assert read_journal(path, STORE) == [a]


def test_a_settle_with_its_own_dedup_window_keeps_it(tmp_path: Path) -> None:
    """A settle owed for a template with its own window is applied with that window at the next
    start; one with the relay's window (0) is written as before, without the field."""
    path = tmp_path / "owed.jsonl"
    own = SettleOp(key="k1", action=Settle.SENT, window_s=7200.0)
    relay_window = SettleOp(key="k2", action=Settle.SENT)
    add_to_journal(path, [("t1", own), ("t2", relay_window)], "store-a")
    assert read_journal(path, "store-a") == [("t1", own), ("t2", relay_window)]
    assert path.read_text().count("window_s") == 1


def test_an_append_after_a_half_written_line_starts_a_line_of_its_own(tmp_path: Path) -> None:
    """A line cut short (a writer killed mid-write) is skipped; the next append is read."""
    path = tmp_path / "owed.jsonl"
    path.write_text('{"store": "' + STORE + '", "token": "t-0", "ke')
    a = ("token-a", SettleOp("email:fp:1", Settle.RELEASE))
    add_to_journal(path, [a], STORE)
    assert read_journal(path, STORE) == [a]
