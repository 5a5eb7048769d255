"""The command evidence source runs a program per query (relay/reconcile/command.py): with
the example script of contrib/reconcile/ over a real Postfix log (tests/reconcile/logs/) it
gives each of the three answers; a program that hangs, floods its output, fails or answers
nonsense gives "unknown" with the reason; one that cannot be started raises OSError."""

from __future__ import annotations

import gc
import logging
import time
import warnings
from pathlib import Path

import pytest

from relay.reconcile.command import Command
from relay.reconcile.evidence import Evidence, Query, Verdict
from tests.support.waiting import until

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "contrib" / "reconcile" / "smarthost-log-lookup.sh"
LOG = Path(__file__).parent / "logs" / "postfix-rfc3339.log"


def lookup(log: Path = LOG) -> Command:
    return Command("lookup", ["/usr/bin/env", f"SMARTHOST_LOG={log}", str(SCRIPT)])


def script(tmp_path: Path, body: str) -> list[str]:
    """A shell script of ``body`` in ``tmp_path``, as an argv."""
    path = tmp_path / "answer.sh"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return [str(path)]


@pytest.mark.parametrize(("message_id", "verdict", "quoted"), [
    ("<first@app.test>", Verdict.ACCEPTED, "86C5B20E135: from=<app@example.com>"),
    ("<refused-below@app.test>", Verdict.REFUSED, "reject: header X-Test-Refuse: yes"),
    ("<never-sent@app.test>", Verdict.UNKNOWN, ""),
])
async def test_the_example_script_gives_each_answer(message_id: str, verdict: Verdict,
                                                    quoted: str) -> None:
    source = lookup()
    query = Query(message_id, 0.0)
    evidence = (await source.look([query]))[query]
    assert evidence.verdict is verdict
    assert evidence.source == "lookup"
    assert quoted in evidence.detail
    await source.close()


async def test_the_example_script_ignores_what_was_logged_before_the_attempt() -> None:
    source = lookup()
    later = Query("<first@app.test>", time.time() + 400 * 86400)
    assert (await source.look([later]))[later].verdict is Verdict.UNKNOWN
    await source.close()


async def test_the_program_gets_the_message_id_and_the_attempt_seconds(tmp_path: Path) -> None:
    source = Command("echo", script(tmp_path, 'echo "accepted saw $1 at $2"'))
    query = Query("<a b@app.test>", 1796677481.9)
    evidence = (await source.look([query]))[query]
    assert evidence == Evidence(Verdict.ACCEPTED, "echo", "saw <a b@app.test> at 1796677481")
    await source.close()


async def test_many_queries_run_a_few_at_a_time(tmp_path: Path) -> None:
    """Eight queries, at most two programs at once (each records its start and end)."""
    trace = tmp_path / "trace"
    source = Command("busy", script(tmp_path, f"""
echo "start $1" >> {trace}
sleep 0.2
echo "end $1" >> {trace}
echo refused"""), concurrency=2)
    queries = [Query(f"<m{n}@app.test>", 0.0) for n in range(8)]
    found = await source.look(queries)
    assert {e.verdict for e in found.values()} == {Verdict.REFUSED}
    running = most = 0
    for line in trace.read_text().splitlines():
        running += 1 if line.startswith("start") else -1
        most = max(most, running)
    assert most == 2
    await source.close()


@pytest.mark.parametrize(("body", "why"), [
    ("sleep 60", "no answer within 1 s"),
    # 1 MB, then the program lingers: it is killed, its pipes read to their end
    ("head -c 1048576 /dev/zero | tr '\\0' x; sleep 30", "more than 4096 bytes of output"),
    ("echo 'nothing to see' >&2; exit 3", "exit status 3: nothing to see"),
    ("echo maybe", "not an answer: 'maybe'"),
    ("echo accepted; echo refused", "2 lines of output, not one"),
    ("true", "0 lines of output, not one"),
])
async def test_no_usable_answer_is_unknown_with_the_reason(
        tmp_path: Path, body: str, why: str, caplog: pytest.LogCaptureFixture) -> None:
    source = Command("flaky", script(tmp_path, body), timeout_s=1.0)
    query = Query("<m@app.test>", 0.0)
    with caplog.at_level(logging.WARNING, logger="relay.reconcile"):
        evidence = (await source.look([query]))[query]
    assert evidence.verdict is Verdict.UNKNOWN
    assert why in evidence.detail
    assert len(evidence.detail.encode()) <= 1024
    assert any(why in record.getMessage() for record in caplog.records)
    await source.close()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        gc.collect()  # no pipe of a killed program left open (seen on a run, not on each)
    assert not [w for w in warned if issubclass(w.category, ResourceWarning)]


async def test_a_timeout_kills_the_programs_whole_process_group(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    source = Command("hang", script(tmp_path, f"sleep 60 & echo $! > {pids}; wait"),
                     timeout_s=1.0)
    query = Query("<m@app.test>", 0.0)
    assert (await source.look([query]))[query].verdict is Verdict.UNKNOWN
    child = Path(f"/proc/{int(pids.read_text())}")
    await until(lambda: not child.exists(), within_s=10.0, what="the group's sleep killed")
    await source.close()


async def test_a_program_that_cannot_be_started_raises(tmp_path: Path) -> None:
    missing = Command("gone", [str(tmp_path / "no-such-program")])
    with pytest.raises(FileNotFoundError):
        await missing.look([Query("<m@app.test>", 0.0)])
    not_executable = tmp_path / "plain.txt"
    not_executable.write_text("echo accepted\n")
    with pytest.raises(PermissionError):  # no execute bit: not even root may run it
        await Command("plain", [str(not_executable)]).look([Query("<m@app.test>", 0.0)])
