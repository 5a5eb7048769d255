"""The log sources read their logs incrementally (relay/reconcile/log_tail.py): only what was
appended since the last look, across a rotation (renamed, then compressed; or copied and
truncated in place), a line written in two pieces, the rotated history at the first look;
and a Message-ID reused across two attempts is answered per attempt. The lines are Postfix's
and Exim's own (as in tests/reconcile/logs/) with chosen stamps and ids."""

from __future__ import annotations

import gzip
import shutil
import time
from datetime import datetime
from pathlib import Path

import pytest

from relay.reconcile.evidence import Query, Verdict
from relay.reconcile.exim import EximLog
from relay.reconcile.postfix import PostfixLog

NOW = time.time()


def stamp(at: float) -> str:
    """An RFC 3339 stamp (rsyslog's file format) of unix seconds ``at``."""
    return datetime.fromtimestamp(at).astimezone().isoformat(timespec="microseconds")


def message_id_line(at: float, queue_id: str, message_id: str) -> str:
    return (f"{stamp(at)} mx postfix/cleanup[4242]: {queue_id}: "
            f"message-id={message_id}\n")


def active_line(at: float, queue_id: str) -> str:
    return (f"{stamp(at)} mx postfix/qmgr[4240]: {queue_id}: from=<app@example.com>, "
            "size=288, nrcpt=1 (queue active)\n")


def reject_line(at: float, queue_id: str) -> str:
    return (f"{stamp(at)} mx postfix/cleanup[4242]: {queue_id}: reject: header X-Test-Refuse: "
            "yes from localhost[127.0.0.1]; from=<app@example.com> to=<user@example.net> "
            "proto=ESMTP helo=<app.test>: 5.7.1 refused by the test smarthost\n")


def noise_line(at: float, number: int) -> str:
    return (f"{stamp(at)} mx postfix/smtpd[4241]: disconnect from localhost[127.0.0.1] "
            f"ehlo=1 mail=1 rcpt=1 data=1 quit=1 commands=5 n={number}\n")


def accepted(at: float, queue_id: str, message_id: str) -> str:
    """The lines of one message Postfix took at ``at``."""
    return message_id_line(at, queue_id, message_id) + active_line(at + 0.01, queue_id)


def append(path: Path, text: str) -> None:
    with path.open("a") as log:
        log.write(text)


async def verdicts(source: PostfixLog | EximLog, *message_ids: str,
                   since: float = 0.0) -> list[Verdict]:
    queries = [Query(m, since) for m in message_ids]
    found = await source.look(queries)
    return [found[q].verdict for q in queries]


A, B, C, D = (f"<{name}@app.test>" for name in "abcd")


async def test_a_rename_rotation_then_compression_loses_and_repeats_nothing(
        tmp_path: Path) -> None:
    path = tmp_path / "mail.log"
    path.write_text(accepted(NOW - 50, "AAAA0001", A))
    source = PostfixLog("mx", path)
    assert await verdicts(source, A, B) == [Verdict.ACCEPTED, Verdict.UNKNOWN]
    append(path, accepted(NOW - 40, "BBBB0002", B))  # written just before the rotation
    path.rename(tmp_path / "mail.log.1")
    path.write_text(accepted(NOW - 30, "CCCC0003", C))
    assert await verdicts(source, A, B, C) == [Verdict.ACCEPTED] * 3
    # logrotate's compression of the previous file, then more mail
    with (tmp_path / "mail.log.1").open("rb") as plain, \
            gzip.open(tmp_path / "mail.log.1.gz", "wb") as packed:
        shutil.copyfileobj(plain, packed)
    (tmp_path / "mail.log.1").unlink()
    append(path, accepted(NOW - 20, "DDDD0004", D))
    assert await verdicts(source, A, B, C, D) == [Verdict.ACCEPTED] * 4
    written = (gzip.decompress((tmp_path / "mail.log.1.gz").read_bytes()), path.read_bytes())
    assert source.bytes_read == sum(len(data) for data in written)  # each byte read once
    await source.close()


async def test_a_rotation_compressed_before_the_next_look_is_finished_from_the_held_file(
        tmp_path: Path) -> None:
    path = tmp_path / "mail.log"
    path.write_text(message_id_line(NOW - 50, "AAAA0001", A))
    source = PostfixLog("mx", path)
    assert await verdicts(source, A) == [Verdict.UNKNOWN]
    append(path, active_line(NOW - 49, "AAAA0001") + accepted(NOW - 40, "BBBB0002", B))
    path.rename(tmp_path / "mail.log.1")
    with (tmp_path / "mail.log.1").open("rb") as plain, \
            gzip.open(tmp_path / "mail.log.1.gz", "wb") as packed:
        shutil.copyfileobj(plain, packed)
    (tmp_path / "mail.log.1").unlink()
    path.write_text(accepted(NOW - 30, "CCCC0003", C))
    assert await verdicts(source, A, B, C) == [Verdict.ACCEPTED] * 3
    await source.close()


@pytest.mark.parametrize("compressed", [False, True])
async def test_a_copy_and_truncate_rotation_is_finished_from_the_copy(
        tmp_path: Path, compressed: bool) -> None:
    path = tmp_path / "mail.log"
    path.write_text(accepted(NOW - 50, "AAAA0001", A))
    source = PostfixLog("mx", path)
    assert await verdicts(source, A) == [Verdict.ACCEPTED]
    append(path, accepted(NOW - 40, "BBBB0002", B))
    if compressed:  # logrotate's copytruncate without delaycompress
        (tmp_path / "mail.log.1.gz").write_bytes(gzip.compress(path.read_bytes()))
    else:  # logrotate's copytruncate
        shutil.copy(path, tmp_path / "mail.log.1")
    with path.open("r+") as log:
        log.truncate(0)
    append(path, accepted(NOW - 30, "CCCC0003", C))
    assert await verdicts(source, A, B, C) == [Verdict.ACCEPTED] * 3
    await source.close()


@pytest.mark.parametrize("history", ["mail.log.1", "mail.log.1.gz"])
async def test_the_first_look_reads_the_rotated_history_then_the_current_file(
        tmp_path: Path, history: str) -> None:
    """The Message-ID was logged before the rotation, the acceptance after it."""
    before = message_id_line(NOW - 60, "AAAA0001", A).encode()
    rotated = tmp_path / history
    rotated.write_bytes(gzip.compress(before) if history.endswith(".gz") else before)
    path = tmp_path / "mail.log"
    path.write_text(active_line(NOW - 59, "AAAA0001"))
    source = PostfixLog("mx", path)
    assert await verdicts(source, A) == [Verdict.ACCEPTED]
    assert await verdicts(source, A) == [Verdict.ACCEPTED]
    assert source.bytes_read == len(before) + path.stat().st_size  # the history read once
    await source.close()


async def test_a_line_written_in_two_pieces_counts_once_its_end_arrives(tmp_path: Path) -> None:
    path = tmp_path / "mail.log"
    whole = active_line(NOW - 10, "AAAA0001")
    path.write_text(message_id_line(NOW - 10, "AAAA0001", A) + whole[:40])
    source = PostfixLog("mx", path)
    assert await verdicts(source, A) == [Verdict.UNKNOWN]
    append(path, whole[40:])
    query = Query(A, 0.0)
    evidence = (await source.look([query]))[query]
    assert evidence.verdict is Verdict.ACCEPTED
    assert whole.strip() in evidence.detail  # the line whole, not its second piece
    await source.close()


async def test_an_exim_reject_log_entry_read_in_two_looks(tmp_path: Path) -> None:
    main, reject = tmp_path / "mainlog", tmp_path / "rejectlog"
    main.write_text("")
    source = EximLog("exim", main)  # the reject log does not exist yet: Exim makes it later
    assert await verdicts(source, A) == [Verdict.UNKNOWN]
    when = datetime.fromtimestamp(NOW - 5).strftime("%Y-%m-%d %H:%M:%S")
    reject.write_text(
        f"{when} 1xafzH-0006GW-2n H=(app.test) [127.0.0.1] F=<app@example.com> rejected "
        "after DATA: refused by the test smarthost\nEnvelope-from: <app@example.com>\n"
        "  X-Test-Refuse: yes\nI Message-ID:\n")
    assert await verdicts(source, A) == [Verdict.UNKNOWN]
    append(reject, f" {A}\n  Subject: four\n")
    assert await verdicts(source, A) == [Verdict.REFUSED]
    await source.close()


async def test_one_message_id_over_two_attempts_is_answered_per_attempt(tmp_path: Path) -> None:
    """The first attempt was refused, the second (a minute later) accepted: the refusal
    does not answer for the second attempt, and the acceptance not for the first."""
    path = tmp_path / "mail.log"
    first_at, second_at = NOW - 120, NOW - 60
    path.write_text(message_id_line(first_at + 0.1, "AAAA0001", A)
                    + reject_line(first_at + 0.1, "AAAA0001"))
    source = PostfixLog("mx", path)
    first, second = Query(A, first_at), Query(A, second_at)
    found = await source.look([first, second])
    assert found[first].verdict is Verdict.REFUSED
    assert found[second].verdict is Verdict.UNKNOWN
    append(path, accepted(second_at + 0.2, "BBBB0002", A))
    found = await source.look([first, second])
    assert found[first].verdict is Verdict.REFUSED  # the earliest after the first attempt
    assert found[second].verdict is Verdict.ACCEPTED
    assert found[second].logged_at == pytest.approx(second_at + 0.21, abs=1e-5)
    await source.close()


async def test_the_clock_skew_allowance(tmp_path: Path) -> None:
    """An acceptance stamped 1.5 s before the attempt (the smarthost's clock behind) is about
    it under the default 2 s allowance; one 3 s before is not."""
    path = tmp_path / "mail.log"
    path.write_text(accepted(NOW - 101.5, "AAAA0001", A) + accepted(NOW - 103, "BBBB0002", B))
    source = PostfixLog("mx", path)
    found = await source.look([Query(A, NOW - 100), Query(B, NOW - 100)])
    assert [e.verdict for e in found.values()] == [Verdict.ACCEPTED, Verdict.UNKNOWN]
    await source.close()


async def test_verdicts_older_than_the_bound_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "mail.log"
    path.write_text(accepted(NOW - 3600, "AAAA0001", A) + accepted(NOW - 60, "BBBB0002", B))
    source = PostfixLog("mx", path, keep_s=600)
    assert await verdicts(source, A, B) == [Verdict.UNKNOWN, Verdict.ACCEPTED]
    assert len(source.index) == 1
    await source.close()


async def test_a_log_that_cannot_be_read_raises(tmp_path: Path) -> None:
    source = PostfixLog("mx", tmp_path / "missing.log")
    with pytest.raises(OSError):
        await source.look([Query(A, 0.0)])
    await source.close()


async def test_a_look_reads_only_what_was_appended(tmp_path: Path) -> None:
    """A log that grows by 100,000 lines between two looks: the second reads exactly those
    bytes, and finds the message at their end."""
    path = tmp_path / "mail.log"
    path.write_text("".join(noise_line(NOW - 600, n) for n in range(1000)))
    source = PostfixLog("mx", path)
    assert await verdicts(source, A) == [Verdict.UNKNOWN]
    first_read = source.bytes_read
    assert first_read == path.stat().st_size
    grown = "".join(accepted(NOW - 300 + n / 1000, f"Q{n:09d}", f"<m{n}@app.test>")
                    if n % 10 == 0 else noise_line(NOW - 300, n) for n in range(90_907))
    grown += accepted(NOW - 1, "AAAA0001", A)
    append(path, grown)
    assert grown.count("\n") == 100_000
    assert await verdicts(source, A, "<m90900@app.test>") == [Verdict.ACCEPTED] * 2
    assert source.bytes_read - first_read == len(grown.encode())
    assert await verdicts(source, A) == [Verdict.ACCEPTED]
    assert source.bytes_read - first_read == len(grown.encode())  # nothing new, nothing read
    await source.close()


async def test_lines_read_before_an_error_are_kept_for_the_next_look(tmp_path: Path) -> None:
    """The history was read, then the current file could not be opened (a directory here:
    root reads any file): the look raises, and the history's verdicts still count later."""
    (tmp_path / "mail.log.1").write_text(accepted(NOW - 60, "AAAA0001", A))
    path = tmp_path / "mail.log"
    path.mkdir()
    source = PostfixLog("mx", path)
    with pytest.raises(OSError):
        await source.look([Query(A, 0.0)])
    path.rmdir()
    path.write_text(accepted(NOW - 30, "BBBB0002", B))
    assert await verdicts(source, A, B) == [Verdict.ACCEPTED] * 2
    await source.close()


async def test_past_its_bound_the_index_drops_the_oldest_verdicts(tmp_path: Path) -> None:
    path = tmp_path / "mail.log"
    path.write_text("".join(accepted(NOW - 600 + n, f"Q{n:09d}", f"<m{n}@app.test>")
                            for n in range(300)))
    source = PostfixLog("mx", path, max_verdicts=100)
    newest, oldest = "<m299@app.test>", "<m0@app.test>"
    assert await verdicts(source, newest, oldest) == [Verdict.ACCEPTED, Verdict.UNKNOWN]
    assert 100 <= len(source.index) <= 110
    await source.close()
