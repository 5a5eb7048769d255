"""Each log source against a real private smarthost (tests/support/smarthosts.py): a message
the smarthost accepted is found accepted, one it refused at end of data (Postfix's
header_checks REJECT, Exim's acl_smtp_data deny) refused, and a Message-ID never sent
unknown; the source is looked at while the smarthost runs, as the reconciler does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from relay.reconcile.evidence import Evidence, Query, Verdict
from relay.reconcile.exim import EximLog
from relay.reconcile.log_index import LogSource
from relay.reconcile.postfix import PostfixLog
from tests.support import exim, postfix, smarthosts
from tests.support.net import free_port

pytestmark = pytest.mark.timeout(180)


def message(message_id: str, *, refused: bool = False) -> bytes:
    refuse = f"{smarthosts.REFUSE_HEADER}: yes\r\n" if refused else ""
    return (f"Message-ID: {message_id}\r\nFrom: app@example.com\r\nTo: user@example.net\r\n"
            f"Subject: reconciliation\r\n{refuse}\r\nbody\r\n").encode()


async def settled(source: LogSource, query: Query) -> Evidence:
    """The source's answer once it is not UNKNOWN (the smarthost logs a moment after it
    replied), or UNKNOWN after 30 s."""
    deadline = time.monotonic() + 30.0
    while True:
        evidence = (await source.look([query]))[query]
        if evidence.verdict is not Verdict.UNKNOWN or time.monotonic() > deadline:
            return evidence
        await asyncio.sleep(0.1)


SmartHost = tuple[int, LogSource]


@pytest.fixture(params=["postfix", "exim"])
async def smarthost(request: pytest.FixtureRequest) -> AsyncIterator[SmartHost]:
    """(its SMTP port, a source reading its logs)."""
    with smarthosts.reachable_folder("reconcile-smarthost-") as folder:
        port = free_port()
        if request.param == "postfix":
            if not postfix.available():
                pytest.skip("needs root and Debian's postfix")
            with smarthosts.postfix_smarthost(folder, port) as maillog:
                source: LogSource = PostfixLog("postfix", maillog)
                yield port, source
                await source.close()
        else:
            with exim.private_exim(folder / "exim", port) as instance:
                source = EximLog("exim", instance.main_log)
                yield port, source
                await source.close()


async def test_accepted_refused_and_never_sent(smarthost: SmartHost) -> None:
    port, source = smarthost
    tag = f"{time.time_ns()}"
    ok, no, never = (f"<{kind}-{tag}@app.test>" for kind in ("ok", "no", "never"))
    assert (await source.look([Query(ok, 0.0)]))[Query(ok, 0.0)].verdict is Verdict.UNKNOWN
    sent_at = time.time()
    code, _ = await asyncio.to_thread(smarthosts.send, port, message(ok))
    assert code == 250
    accepted = await settled(source, Query(ok, sent_at))
    assert accepted.verdict is Verdict.ACCEPTED, accepted
    assert ok.strip("<>") in accepted.detail
    assert accepted.logged_at is not None and accepted.logged_at >= sent_at - 2.0

    refused_at = time.time()
    code, _ = await asyncio.to_thread(smarthosts.send, port, message(no, refused=True))
    assert code == 550
    refused = await settled(source, Query(no, refused_at))
    assert refused.verdict is Verdict.REFUSED, refused
    assert "refused by the test smarthost" in refused.detail

    never_sent, later = Query(never, sent_at), Query(ok, time.time() + 60)
    found = await source.look([never_sent, later])
    assert found[never_sent].verdict is Verdict.UNKNOWN
    # the acceptance was before this (later) attempt of the same Message-ID: not about it
    assert found[later].verdict is Verdict.UNKNOWN


async def test_postfix_rotating_its_own_log_mid_run() -> None:
    """``postfix logrotate`` (rename with a date suffix, gzip, new file) between two
    messages: the running source finds both; a source started afterwards (a restarted relay)
    finds both too, the first in the compressed history."""
    if not postfix.available():
        pytest.skip("needs root and Debian's postfix")
    tag = f"{time.time_ns()}"
    before, after = f"<before-{tag}@app.test>", f"<after-{tag}@app.test>"
    with smarthosts.reachable_folder("reconcile-rotation-") as folder:
        port = free_port()
        with smarthosts.postfix_smarthost(folder, port) as maillog:
            source = PostfixLog("postfix", maillog)
            start = time.time()
            assert (await asyncio.to_thread(smarthosts.send, port, message(before)))[0] == 250
            assert (await settled(source, Query(before, start))).verdict is Verdict.ACCEPTED
            await asyncio.to_thread(smarthosts.postfix_logrotate, maillog)
            assert (await asyncio.to_thread(smarthosts.send, port, message(after)))[0] == 250
            assert (await settled(source, Query(after, start))).verdict is Verdict.ACCEPTED
            assert list(maillog.parent.glob("maillog.*.gz"))  # it did rotate and compress
            restarted = PostfixLog("postfix", maillog)
            found = await restarted.look([Query(before, start), Query(after, start)])
            assert [e.verdict for e in found.values()] == [Verdict.ACCEPTED] * 2
            await source.close()
            await restarted.close()
