"""The settle journal file (relay/settle_journal.py): several relays started from one directory
share it, so no change may drop another relay's lines."""

from __future__ import annotations

from pathlib import Path

from relay.interfaces import Settle, SettleOp
from relay.settle_journal import add_to_journal, read_journal, remove_from_journal


def test_two_relays_adding_to_one_journal_keep_both_their_settles(tmp_path: Path) -> None:
    """Relay A and then relay B write what they owe at exit: the file holds both."""
    path = tmp_path / "owed.jsonl"
    a = ("token-a", SettleOp("email:fp:1", Settle.SENT, "250 ok"))
    b = ("token-b", SettleOp("email:fp:2", Settle.RELEASE))
    add_to_journal(path, [a])
    add_to_journal(path, [b, a])  # the same settle twice is kept once
    assert read_journal(path) == [a, b]


def test_removing_what_one_relay_paid_keeps_the_others(tmp_path: Path) -> None:
    """A start that paid A's settle removes that line only; the file goes once empty."""
    path = tmp_path / "owed.jsonl"
    a = ("token-a", SettleOp("email:fp:1", Settle.UNKNOWN))
    b = ("token-b", SettleOp("email:fp:2", Settle.SENT, "250 queued"))
    add_to_journal(path, [a, b])
    remove_from_journal(path, [a])
    assert read_journal(path) == [b]
    remove_from_journal(path, [b])
    assert not path.exists()


def test_a_line_that_is_no_settle_is_skipped(tmp_path: Path) -> None:
    """A damaged line is skipped (and logged), the good ones are read."""
    path = tmp_path / "owed.jsonl"
    a = ("token-a", SettleOp("email:fp:1", Settle.SENT, "250 ok"))
    add_to_journal(path, [a])
    path.write_text(path.read_text() + '{"token": "x", "action": "explode"}\nnot json\n')
    assert read_journal(path) == [a]
