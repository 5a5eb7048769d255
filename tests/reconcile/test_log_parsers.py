"""The Postfix and Exim parsers on real log lines (tests/reconcile/logs/, written by
tools/reconcile_log_samples.py from a private Postfix and a private Exim): what each message
the smarthost accepted or refused at end of data is found as, in each timestamp form."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from relay.reconcile.command import Command
from relay.reconcile.evidence import EvidenceSource, Query, Verdict
from relay.reconcile.exim import EximLog
from relay.reconcile.postfix import PostfixLog
from relay.reconcile.stamps import SyslogClock, exim_stamp

LOGS = Path(__file__).parent / "logs"
FOREVER = 100 * 365 * 86400.0  # the samples are old: keep every verdict
POSTFIX_FORMS = ["postfix-maillog.log", "postfix-syslog.log", "postfix-rfc3339.log"]

# (Message-ID, what Postfix's log says, what Exim's logs say)
ROWS = [
    ("<first@app.test>", Verdict.ACCEPTED, Verdict.ACCEPTED),
    ("<after@app.test>", Verdict.ACCEPTED, Verdict.ACCEPTED),
    ("<folded@app.test>", Verdict.ACCEPTED, Verdict.ACCEPTED),
    ("<refused-below@app.test>", Verdict.REFUSED, Verdict.REFUSED),
    # cleanup rejected the header above the Message-ID before it logged message-id=: no join
    ("<refused-above@app.test>", Verdict.UNKNOWN, Verdict.REFUSED),
    ("<refused-folded@app.test>", Verdict.UNKNOWN, Verdict.REFUSED),
    ("<never-sent@app.test>", Verdict.UNKNOWN, Verdict.UNKNOWN),
]


def sample(tmp_path: Path, *names: str) -> list[Path]:
    """Copies of the named samples in ``tmp_path`` (a source reads its folder's rotations)."""
    copies = []
    for name in names:
        copy = tmp_path / name
        shutil.copy(LOGS / name, copy)
        copies.append(copy)
    return copies


def line_with(path: Path, *texts: str) -> str:
    return next(line for line in path.read_text().splitlines()
                if all(text in line for text in texts))


def syslog_stamp(line: str) -> float:
    parsed = SyslogClock().parse(line)
    assert parsed is not None
    return parsed[0]


@pytest.mark.parametrize("form", POSTFIX_FORMS)
@pytest.mark.parametrize(("message_id", "postfix_says", "exim_says"), ROWS)
async def test_postfix_log_rows(tmp_path: Path, form: str, message_id: str,
                                postfix_says: Verdict, exim_says: Verdict) -> None:
    (path,) = sample(tmp_path, form)
    source = PostfixLog("smarthost", path, keep_s=FOREVER)
    query = Query(message_id, 0.0)
    evidence = (await source.look([query]))[query]
    await source.close()
    assert evidence.verdict is postfix_says
    assert evidence.source == "smarthost"
    if postfix_says is Verdict.ACCEPTED:
        assert f"message-id={message_id}" in evidence.detail
        assert "(queue active)" in evidence.detail
    elif postfix_says is Verdict.REFUSED:
        assert "reject: header X-Test-Refuse" in evidence.detail
        assert evidence.logged_at == syslog_stamp(line_with(path, "reject: header"))
    else:
        assert evidence.detail == "" and evidence.logged_at is None


@pytest.mark.parametrize(("message_id", "postfix_says", "exim_says"), ROWS)
async def test_exim_log_rows(tmp_path: Path, message_id: str, postfix_says: Verdict,
                             exim_says: Verdict) -> None:
    main, reject = sample(tmp_path, "exim-mainlog.log", "exim-rejectlog.log")
    source = EximLog("exim", main, reject, keep_s=FOREVER)
    query = Query(message_id, 0.0)
    evidence = (await source.look([query]))[query]
    await source.close()
    assert evidence.verdict is exim_says
    bare = message_id.strip("<>")
    if exim_says is Verdict.ACCEPTED:
        assert " <= app@example.com " in evidence.detail and f"id={bare}" in evidence.detail
    elif exim_says is Verdict.REFUSED:
        assert "rejected after DATA: refused by the test smarthost" in evidence.detail
        assert bare in evidence.detail
        entry = evidence.detail.splitlines()[0]
        assert evidence.logged_at == exim_stamp(entry)[0]  # type: ignore[index]


async def test_the_three_postfix_forms_give_the_same_answers(tmp_path: Path) -> None:
    queries = [Query(row[0], 0.0) for row in ROWS] + [Query("<reused@app.test>", 0.0)]
    answers = []
    for form in POSTFIX_FORMS:
        source = PostfixLog(form, sample(tmp_path, form)[0], keep_s=FOREVER)
        found = await source.look(queries)
        answers.append([(found[q].verdict, found[q].logged_at) for q in queries])
        await source.close()
    assert answers[0] == answers[1] == answers[2]
    assert all(at is not None for verdict, at in answers[0] if verdict is not Verdict.UNKNOWN)


@pytest.mark.parametrize("kind", ["postfix", "exim"])
async def test_a_reused_message_id_is_answered_by_the_acceptance_after_the_attempt(
        tmp_path: Path, kind: str) -> None:
    if kind == "postfix":
        (path,) = sample(tmp_path, "postfix-maillog.log")
        source: PostfixLog | EximLog = PostfixLog(kind, path, keep_s=FOREVER, skew_s=0.5)
        lines = [line for line in path.read_text().splitlines() if "(queue active)" in line]
        first, second = (syslog_stamp(line) for line in lines[-2:])
    else:
        main, reject = sample(tmp_path, "exim-mainlog.log", "exim-rejectlog.log")
        source = EximLog(kind, main, reject, keep_s=FOREVER, skew_s=0.5)
        lines = [line for line in main.read_text().splitlines() if "id=reused@" in line]
        first, second = (exim_stamp(line)[0] for line in lines)  # type: ignore[index]
    assert second > first
    earlier, later, after = (Query("<reused@app.test>", at)
                             for at in (first - 0.2, second - 0.2, second + 5))
    found = await source.look([earlier, later, after])
    await source.close()
    assert found[earlier].logged_at == first
    assert found[later].logged_at == second
    assert found[earlier].verdict is found[later].verdict is Verdict.ACCEPTED
    assert found[after].verdict is Verdict.UNKNOWN


async def test_exim_line_variants_pid_milliseconds_and_offset(tmp_path: Path) -> None:
    """``log_selector = +pid +millisec`` and ``log_timezone = true`` change the line's
    start; the verdicts and stamps follow."""
    real = line_with(LOGS / "exim-mainlog.log", "id=first@app.test")
    stamp, rest = real[:19], real[20:]
    main = tmp_path / "mainlog"
    main.write_text(f"{stamp}.250 +0100 [4242] {rest}\n")
    source = EximLog("exim", main, keep_s=FOREVER)
    query = Query("<first@app.test>", 0.0)
    evidence = (await source.look([query]))[query]
    await source.close()
    utc = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) - time.timezone
    assert evidence.verdict is Verdict.ACCEPTED
    assert evidence.logged_at == pytest.approx(utc - 3600 + 0.25)


def test_a_syslog_stamp_takes_the_year_nearest_to_now_not_ahead_by_more_than_a_day() -> None:
    def year(line: str, now: str) -> int:
        clock = SyslogClock(time.mktime(time.strptime(now, "%Y-%m-%d %H:%M")))
        parsed = clock.parse(line + " host postfix/qmgr[1]: x")
        assert parsed is not None
        return time.localtime(parsed[0]).tm_year

    assert year("Dec 31 23:59:00", "2027-01-01 00:30") == 2026
    assert year("Jan  1 00:10:00", "2026-12-31 23:00") == 2027  # an hour ahead: clocks differ
    assert year("Jul  1 12:00:00", "2026-06-01 12:00") == 2025  # a month ahead: last year's
    assert year("Feb 29 10:00:00", "2025-03-01 12:00") == 2024  # the last Feb 29
    assert year("Dec  7 21:03:04", "2026-12-07 21:05") == 2026


def test_rfc3339_stamps_keep_their_offset() -> None:
    clock = SyslogClock()
    parsed = clock.parse("2026-12-07T21:03:04.123456+01:00 host postfix/qmgr[1]: x")
    assert parsed is not None
    assert parsed[0] == pytest.approx(1796673784.123456)
    zulu = clock.parse("2026-12-07T20:03:04.123456Z host postfix/qmgr[1]: x")
    assert zulu is not None and zulu[0] == pytest.approx(parsed[0])
    assert clock.parse("not a stamp") is None


# Postfix's other end-of-data verdicts, in the forms its smtpd and cleanup log them (no milter
# or content filter runs here: the lines are written after those of the samples)
OTHER_POSTFIX_FORMS = [
    ("milter-reject: END-OF-MESSAGE from localhost[127.0.0.1]: 5.7.1 Spam; from=<a@b.test> "
     "to=<c@d.test> proto=ESMTP helo=<app.test>", Verdict.REFUSED),
    ("proxy-reject: END-OF-MESSAGE: 554 5.7.1 infected; from=<a@b.test> to=<c@d.test> "
     "proto=ESMTP helo=<app.test>", Verdict.REFUSED),
    ("reject: END-OF-MESSAGE from localhost[127.0.0.1]: 554 5.7.1 <END-OF-MESSAGE>: End-of-data "
     "rejected; from=<a@b.test> to=<c@d.test> proto=ESMTP helo=<app.test>", Verdict.REFUSED),
    ("reject: body REFUSE-THIS-BODY from localhost[127.0.0.1]; from=<a@b.test> to=<c@d.test> "
     "proto=ESMTP helo=<app.test>: 5.7.1 body refused", Verdict.REFUSED),
    ("hold: header Subject: check me from localhost[127.0.0.1]; from=<a@b.test> "
     "to=<c@d.test> proto=ESMTP helo=<app.test>", Verdict.ACCEPTED),
    ("milter-discard: END-OF-MESSAGE from localhost[127.0.0.1]: milter triggers DISCARD "
     "action; from=<a@b.test> to=<c@d.test> proto=ESMTP helo=<app.test>", Verdict.ACCEPTED),
    # a recipient refused while others were taken: not a verdict about the message
    ("reject: RCPT from localhost[127.0.0.1]: 550 5.1.1 <x@d.test>: Recipient address "
     "rejected; from=<a@b.test> to=<x@d.test> proto=ESMTP helo=<app.test>", Verdict.UNKNOWN),
    ("to=<c@d.test>, relay=none, delay=0, dsn=2.0.0, status=sent (d.test)", Verdict.UNKNOWN),
]


@pytest.mark.parametrize(("text", "verdict"), OTHER_POSTFIX_FORMS)
async def test_other_postfix_verdict_forms(tmp_path: Path, text: str, verdict: Verdict) -> None:
    path = tmp_path / "mail.log"
    daemon = "cleanup" if text.startswith(("reject: body", "hold:")) else "smtpd"
    path.write_text(
        "2026-12-07T21:10:48.000000+00:00 mx postfix/cleanup[7]: 0A1B2C3D4E: "
        "message-id=<other@app.test>\n"
        f"2026-12-07T21:10:48.100000+00:00 mx postfix/{daemon}[8]: 0A1B2C3D4E: {text}\n")
    source = PostfixLog("mx", path, keep_s=FOREVER)
    query = Query("<other@app.test>", 0.0)
    assert (await source.look([query]))[query].verdict is verdict
    await source.close()


async def test_an_exim_main_log_without_main_in_its_name_has_no_reject_log(
        tmp_path: Path) -> None:
    (main,) = sample(tmp_path, "exim-mainlog.log")
    renamed = main.rename(tmp_path / "exim.log")
    source = EximLog("exim", renamed, keep_s=FOREVER)
    found = await source.look([Query("<first@app.test>", 0.0), Query("<refused-below@app.test>",
                                                                      0.0)])
    assert [e.verdict for e in found.values()] == [Verdict.ACCEPTED, Verdict.UNKNOWN]
    assert source.bytes_read == renamed.stat().st_size
    await source.close()


async def test_each_source_is_an_evidence_source(tmp_path: Path) -> None:
    """The three kinds as the reconciler holds them (mypy checks the Protocol), each answering
    every query it is asked."""
    main, reject = sample(tmp_path, "exim-mainlog.log", "exim-rejectlog.log")
    (maillog,) = sample(tmp_path, "postfix-maillog.log")
    sources: list[EvidenceSource] = [
        PostfixLog("postfix", maillog), EximLog("exim", main, reject),
        Command("command", ["/bin/echo", "unknown"])]
    queries = [Query("<first@app.test>", time.time()), Query("<x@app.test>", time.time())]
    for source in sources:
        found = await source.look(queries)
        assert set(found) == set(queries)
        assert {e.source for e in found.values()} == {source.name}
        await source.close()
