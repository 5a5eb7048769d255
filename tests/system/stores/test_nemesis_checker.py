"""The nemesis's checker and schedules on histories written by hand: each rule of
bench/faultbench/checker.py counts what it says, and nothing else; a seed names one
schedule, and a printed schedule runs again as it was; the fault bench's report keeps the
nemesis's section when it is written again."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from bench.faultbench.checker import ClientRecord, Dot, History, Reply, check, timeline
from bench.faultbench.schedule import (
    STORE_KINDS,
    draw_schedule,
    kinds_for,
    schedule_from_json,
    schedule_json,
)
from tools.faultbench_nemesis import SECTION, kept_section

RCPT = "a@example.net"
FP = (RCPT, "k1")
OK = Reply(1.0, 2525, 250, "2.0.0 Ok: relayed 1; id=x")
IN_DOUBT = Reply(1.0, 2525, 250, "2.0.0 Ok: duplicate suppressed for 1 recipient(s); 1 in "
                                 "doubt since 2026-01-01T00:00:00Z")


def client(*replies: Reply, end: str = "accepted") -> ClientRecord:
    return ClientRecord("k1", (RCPT,), list(replies), end)


def dot(*, taken: bool = True, fate: str = "ok") -> Dot:
    return Dot(1.0, "k1", (RCPT,), fate, taken)


def test_one_copy_for_a_250_is_clean() -> None:
    """A 250 with one copy taken is neither a duplicate, a loss, in doubt nor unfinished."""
    c = check(History([client(OK)], [dot()], records={FP: "sent"}))
    assert (c.keys, c.copies, c.duplicates, c.lost, c.in_doubt, c.unfinished) == (1, 1, 0, 0, 0, 0)
    assert not c.broken


def test_two_copies_taken_are_a_duplicate() -> None:
    """Two copies taken for one fingerprint are a duplicate, even when it is listed in doubt
    (unknown_policy = suppress never sends an in-doubt record again)."""
    c = check(History([client(OK)], [dot(), dot()], records={FP: "unknown"}, listed={FP}))
    assert c.duplicates == 1 and c.concerned["duplicates"] == [FP] and c.broken


def test_a_copy_announced_as_resent_in_doubt_is_no_duplicate() -> None:
    """A second copy that a relay announced as sent again over a record in doubt
    (unknown_policy = send) is the documented in-doubt copy; a third is a duplicate."""
    one_resend = History([client(OK)], [dot(), dot()], resent=Counter({FP: 1}))
    assert check(one_resend).duplicates == 0
    one_resend.dots.append(dot())
    assert check(one_resend).duplicates == 1


def test_a_resent_copy_of_a_fingerprint_a_relay_had_relayed_is_a_duplicate() -> None:
    """Two copies both logged as relayed (the first one's SENT mark lost, the second sent
    over the record left in doubt) are a duplicate although the second was announced."""
    history = History([client(OK)], [dot(), dot()], resent=Counter({FP: 1}),
                      relayed=Counter({FP: 2}))
    assert check(history).duplicates == 1
    history.relayed = Counter({FP: 1})  # the first copy's reply never read: real doubt
    assert check(history).duplicates == 0


def test_refused_dots_are_no_copies() -> None:
    """Dots the smarthost refused (451 at the dot) count as no copy: a 250 after them with
    one copy taken is clean."""
    c = check(History([client(OK)], [dot(taken=False, fate="temp_dot"), dot()]))
    assert (c.copies, c.duplicates, c.lost) == (1, 0, 0)


def test_a_250_without_a_copy_and_not_listed_is_lost() -> None:
    """A 250 with no copy taken, not listed by in-doubt, is a loss, even when its final
    record reads in doubt."""
    c = check(History([client(IN_DOUBT)], [], records={FP: "unknown"}))
    assert c.lost == 1 and c.broken
    assert c.in_doubt == 1 and c.unlisted == 1 and c.doubt_without_dot == 1


def test_a_250_in_doubt_without_a_copy_but_listed_is_in_doubt_not_lost() -> None:
    """A 250 with no copy taken that in-doubt lists is the honest exception: in doubt, not
    lost."""
    c = check(History([client(IN_DOUBT)], [dot(taken=False, fate="temp_dot")],
                      records={FP: "unknown"}, listed={FP}))
    assert (c.lost, c.in_doubt, c.unlisted, c.doubt_refused) == (0, 1, 0, 1)
    assert not c.broken


def test_doubt_no_attempt_explains_is_counted_apart() -> None:
    """A 250 "in doubt" after attempts that all had definite replies (the relay answered the
    smarthost's 451, then the record was found in doubt; connections refused reach no relay)
    is counted as unexplained; one after an attempt cut without a reply, or after the relay's
    own 451 4.4.2, is not."""
    refused = Reply(1.0, 2525, 451, "4.3.0 upstream: bench: temporary failure")
    told = Reply(1.0, 2525, 451, "4.4.2 Upstream did not confirm the message; it is held as "
                                 "in doubt, try again later")
    cut = Reply(1.0, 2525, None, "", "closed")
    refused_connection = Reply(1.0, 2525, None, "", "connect: ConnectionRefusedError")
    counts = [check(History([client(*replies, IN_DOUBT)], [], records={FP: "unknown"},
                            listed={FP})).doubt_unexplained
              for replies in ([refused], [refused, refused_connection], [refused, cut],
                              [told], [])]
    assert counts == [1, 1, 0, 0, 1]


def test_a_sending_record_at_the_end_is_in_doubt() -> None:
    """A SENDING record left when every attempt has ended counts as in doubt."""
    c = check(History([client(OK)], [dot()], records={FP: "sending"}))
    assert (c.in_doubt, c.unlisted, c.lost) == (1, 1, 0)


def test_a_client_without_a_final_reply_is_unfinished_not_lost() -> None:
    """A client with only 4yz and no reply by the end is unfinished, not a loss."""
    c = check(History([client(Reply(1.0, 2525, 451, "4.3.0 store"), end="unfinished")], []))
    assert (c.unfinished, c.lost, c.broken) == (1, 0, False)


def test_a_5yz_without_a_copy_is_not_lost() -> None:
    """A client that got 5yz bounced the message: no copy is no loss."""
    c = check(History([client(Reply(1.0, 2525, 554, "5.6.0 no"), end="gave_up")], []))
    assert (c.lost, c.unfinished) == (0, 0)


def test_each_recipient_is_its_own_fingerprint() -> None:
    """A message to two recipients is two fingerprints: a copy for one of them leaves the
    other lost."""
    two = ClientRecord("k1", (RCPT, "B@example.net"), [OK], "accepted")
    c = check(History([two], [dot()]))
    assert c.keys == 2 and c.concerned["lost"] == [("b@example.net", "k1")]


def test_the_timeline_lists_replies_dots_and_the_final_record_in_time_order() -> None:
    """A fingerprint's timeline orders client replies, dots and relay lines by time and ends
    with its final record and listing."""
    history = History([client(Reply(3.0, 2525, 250, "ok"))], [Dot(2.0, "k1", (RCPT,), "ok", True)],
                      records={FP: "sent"})
    lines = timeline(history, FP, [(1.0, "relay 0 reserved")])
    assert ["relay 0" in lines[0], "smarthost" in lines[1], "client" in lines[2]] == [True] * 3
    assert lines[-1] == "  final record sent; not listed by in-doubt"


@pytest.mark.parametrize("store", sorted(STORE_KINDS))
def test_a_seed_names_one_schedule_and_its_json_runs_it_again(store: str) -> None:
    """One seed draws one schedule (kinds of its store only, each within the load), and the
    JSON a failing run prints reads back as the same schedule."""
    first = draw_schedule(7, 60.0, store, 2)
    assert first == draw_schedule(7, 60.0, store, 2)
    assert first != draw_schedule(8, 60.0, store, 2)
    assert {f.kind for f in first} <= set(kinds_for(store))
    assert all(f.at_s >= 6.0 and f.at_s + f.hold_s <= 54.0 + 1e-6 for f in first)
    assert schedule_from_json(schedule_json(first), store, 2) == first


def test_a_schedule_with_a_fault_the_store_has_not_is_refused() -> None:
    """A schedule naming a fault its store cannot take (a lock on Redis) is refused."""
    with pytest.raises(ValueError, match="store-locked"):
        schedule_from_json('[{"kind": "store-locked", "at_s": 1}]', "redis", 1)


def test_rewriting_the_report_keeps_the_nemesis_section(tmp_path: Path) -> None:
    """The nemesis's section of docs/reliability.md (from its heading to the end) is what a
    rewrite of the report carries over; a report without one carries nothing."""
    report = tmp_path / "reliability.md"
    assert kept_section(report) == ""
    report.write_text(f"# Reliability\n\n| table |\n\n{SECTION}\n\nby hand\n")
    assert kept_section(report) == f"\n{SECTION}\n\nby hand\n"
    report.write_text("# Reliability\n\n## The nemesis's cousin\n")
    assert kept_section(report) == ""
