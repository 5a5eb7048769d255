"""The console's lookups over real HTTP, served by an in-process relay (Redis store, a real
aiosmtpd sink, the audit ledger in a private PostgreSQL schema): a message found by its
recipient alone, its Message-ID, the relay's and the smarthost's queue id, its template and a
period; keyset pages with a next link; a refused lookup that keeps what was typed; the
message's page and its timeline, reached from the decision log line's ``console`` link; the
in-doubt page without operator buttons for a viewer; the record an operator acted on shown by
its recipient afterwards."""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime, timedelta
from html import unescape
from pathlib import Path
from urllib.parse import quote

import asyncpg
import pytest

from relay.app import Relay
from relay.core.interfaces import LedgerEntry
from relay.store.postgres.ledger import LedgerOptions, insert_rows, row_of
from tests.support.clients import message, send
from tests.support.console import (
    OPERATOR,
    OPERATOR_PASSWORD,
    VIEWER,
    VIEWER_PASSWORD,
    Browser,
    console_relay,
    csrf_of,
    opened,
)
from tests.support.postgres import wait_ledger_rows
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.timeout(60)

RCPT = "jane.roe@example.net"
_ROW_QUEUE_IDS = re.compile(r'<tr class="outcome-[a-z_]+" data-queue-id="([^"]*)"')
_NEXT = re.compile(r'<a href="([^"]+)" id="next" rel="next">')


def queue_ids(page: str) -> list[str]:
    """The relay queue ids of the result rows on ``page``, in order."""
    return _ROW_QUEUE_IDS.findall(page)


def next_link(page: str) -> str | None:
    found = _NEXT.search(page)
    return None if found is None else unescape(found.group(1))


async def signed_in(web: list[Browser], relay: Relay, user: str = VIEWER,
                    password: str = VIEWER_PASSWORD) -> Browser:
    b = opened(web, relay)
    status, _, _ = await b.sign_in(user, password)
    assert status == 303
    return b


async def test_a_message_is_found_by_what_support_holds(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A receipt sent, its retry suppressed, and another customer's mail: the receipt's rows
    are found by the recipient alone (any spelling, newest first, the page showing it masked),
    by its Message-ID without brackets, by the relay's queue id and by the smarthost's, by
    template, and by a period; the decision log line's console link opens its page."""
    caplog.set_level(logging.INFO, logger="relay.smtp.handler")
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url,
                                console_url="https://console.example.com/")
    receipt = message(key="pay-9", template="receipt", extra="Message-ID: <p9@app.example>\r\n")
    for _ in range(2):
        assert (await send(relay.port, [RCPT], receipt)).code == 250
    assert (await send(relay.port, ["other@example.org"], message(
        key="w-1", template="welcome"))).code == 250
    rows = await wait_ledger_rows(ledger_url, 3)
    sent, retry = rows[0]["queue_id"], rows[1]["queue_id"]
    b = await signed_in(web, relay)

    for spelling in (RCPT, "Jane.Roe@EXAMPLE.net", f"<{RCPT}>"):
        status, page, _ = await b.get(f"/history?rcpt={quote(spelling)}")
        assert status == 200, page
        assert queue_ids(page) == [retry, sent], spelling
        assert "j***@example.net" in page
        assert RCPT not in re.sub(r'id="rcpt" value="[^"]*"', "", page).lower()
    for query in ("message_id=p9%40app.example", "message_id=%3Cp9%40app.example%3E",
                  f"queue_id={sent}"):
        status, page, _ = await b.get(f"/history?{query}")
        assert status == 200 and sent in queue_ids(page), query
    status, page, _ = await b.get("/history?queue_id=SINK1")
    assert queue_ids(page) == [rows[2]["queue_id"], sent]  # the sink names every one SINK1
    status, page, _ = await b.get("/history?template=welcome")
    assert queue_ids(page) == [rows[2]["queue_id"]]
    now = datetime.now(tz=UTC)
    since, until = quote((now - timedelta(minutes=5)).isoformat()), quote(now.isoformat())
    status, page, _ = await b.get(f"/history?since={since}&until={until}")
    assert status == 200 and queue_ids(page) == [r["queue_id"] for r in reversed(rows)]
    status, page, _ = await b.get("/history?until=2001-01-01")
    assert status == 200 and 'id="no-rows"' in page

    [line] = [r for r in caplog.records if r.name == "relay.smtp.handler"
              and r.msg == "message" and r.queue_id == sent]  # type: ignore[attr-defined]
    link = line.console  # type: ignore[attr-defined]
    assert link == f"https://console.example.com/message/{sent}"
    status, page, _ = await b.get(link.removeprefix("https://console.example.com"))
    assert status == 200
    timeline = page[page.index('id="timeline"'):]
    kinds = re.findall(r'data-kind="([a-z_]+)"', timeline)
    assert kinds == ["received", "sending", "relayed", "suppressed"]
    assert f"/message/{retry}" in timeline and "&lt;p9@app.example&gt;" in page
    assert 'class="store-state">sent<' in page and "SINK1" in page
    status, page, _ = await b.get("/message/000000000000")
    assert status == 404 and "/history?queue_id=000000000000" in page


async def test_rows_come_in_pages_with_a_next_link(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """120 rows of one recipient: pages of 50, 50 and 20 rows, newest first, each row once,
    a next link on all but the last; a damaged page link is refused 400."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url)
    start = datetime.now(tz=UTC) - timedelta(days=2)
    entries = [LedgerEntry(decided_at=(start + timedelta(minutes=i)).timestamp(),
                           outcome="relayed", recipient=RCPT, store_key=f"email:fp:{i}",
                           queue_id=f"{i:012x}", template="receipt") for i in range(120)]
    conn = await asyncpg.connect(ledger_url, timeout=10)
    try:
        await insert_rows(conn, [row_of(e, LedgerOptions()) for e in entries])
    finally:
        await conn.close()
    b = await signed_in(web, relay)
    seen: list[str] = []
    path: str | None = f"/history?rcpt={quote(RCPT)}"
    sizes = []
    while path is not None:
        status, page, _ = await b.get(path)
        assert status == 200
        sizes.append(len(queue_ids(page)))
        seen += queue_ids(page)
        path = next_link(page)
        assert path is None or f"rcpt={quote(RCPT)}" in path.replace("%40", "@").replace(
            "@", "%40")
    assert sizes == [50, 50, 20]
    assert seen == [f"{i:012x}" for i in reversed(range(120))]
    status, page, _ = await b.get(f"/history?rcpt={quote(RCPT)}&after=not-a-position")
    assert status == 400 and "page link is damaged" in page


async def test_a_recipient_is_found_under_the_previous_secrets_digest_during_a_rotation(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """A row written under the old fingerprint secret and one under the new (its key reused
    for other content): a console with the new secret and the old as
    ``fingerprint_secret_previous`` finds both by the recipient alone, newest first, and says
    the key was reused; one with the new secret alone finds the new row only."""
    start = datetime.now(tz=UTC) - timedelta(hours=2)
    old = LedgerEntry(decided_at=start.timestamp(), outcome="relayed", recipient=RCPT,
                      store_key="email:fp:old", queue_id="0000000000a1", template="receipt")
    new = LedgerEntry(decided_at=(start + timedelta(hours=1)).timestamp(), outcome="relayed",
                      recipient=RCPT, store_key="email:fp:new", queue_id="0000000000b2",
                      template="receipt", key_reused=True)
    conn = await asyncpg.connect(ledger_url, timeout=10)
    try:
        await insert_rows(conn, [row_of(old, LedgerOptions(secret=b"old secret")),
                                 row_of(new, LedgerOptions(secret=b"new secret"))])
    finally:
        await conn.close()
    rotating = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url,
                                   fingerprint_secret="new secret",
                                   fingerprint_secret_previous="old secret")
    b = await signed_in(web, rotating)
    status, page, _ = await b.get(f"/history?rcpt={quote(RCPT)}")
    assert status == 200
    assert queue_ids(page) == ["0000000000b2", "0000000000a1"]
    assert page.count("key reused for other content") == 1
    rotated = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url,
                                  fingerprint_secret="new secret")
    b = await signed_in(web, rotated)
    status, page, _ = await b.get(f"/history?rcpt={quote(RCPT)}")
    assert status == 200 and queue_ids(page) == ["0000000000b2"]


async def test_a_refused_lookup_keeps_what_was_typed(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """An address the relay refuses, a time it cannot read, an empty period, a key without a
    recipient: 400, the reason on the page and every field as it was typed."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url)
    b = await signed_in(web, relay)
    for query, typed, reason in (
            ("rcpt=not%20an%20address&template=receipt", 'value="not an address"',
             "no address the relay takes"),
            ("rcpt=a%40example.net&since=yesterday", 'value="yesterday"', "no date"),
            ("since=2026-03-02&until=2026-03-01", 'value="2026-03-01"', "period is empty"),
            ("key=order-1&template=receipt", 'value="order-1"', "Give the recipient"),
            ("key=order-1&rcpt=a%40example.net&message_id=x", 'value="x"', "fingerprint")):
        status, page, _ = await b.get(f"/history?{query}")
        assert status == 400, query
        assert typed in page and reason in page, (query, page[-1500:])


async def test_a_viewer_sees_no_operator_button_and_an_operator_returns_to_the_recipient(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """The in-doubt page lists the message with its Message-ID, upstream and the time its
    final dot went out; a viewer's copy has no form to act with; after an operator marks it
    sent the page it lands on names the record by its recipient and template (masked, as
    the ledger holds it), not by its store key alone."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url)
    sink.handler.hang_after_dot_s = 2.0
    assert (await send(relay.port, [RCPT], message(
        key="pay-7", template="receipt", extra="Message-ID: <p7@app.example>\r\n"))).code == 451
    sink.handler.hang_after_dot_s = 0.0
    [row] = await wait_ledger_rows(ledger_url, 1)
    key = row["store_key"]
    assert row["sending_at"] is not None
    assert row["received_at"] < row["sending_at"] < row["decided_at"]

    viewer = await signed_in(web, relay)
    status, page, _ = await viewer.get("/in-doubt")
    assert status == 200 and key in page and "&lt;p7@app.example&gt;" in page
    assert "mark-sent" not in page and "/in-doubt/resolve" not in page
    assert 'id="viewer-note"' in page and "final dot sent" in page
    assert f'href="/message/{row["queue_id"]}"' in page

    operator = await signed_in(web, relay, OPERATOR, OPERATOR_PASSWORD)
    _, page, _ = await operator.get("/in-doubt")
    assert page.count('class="mark-sent"') == 1 and page.count('class="release"') == 1
    status, _, response = await operator.post("/in-doubt/resolve", {
        "csrf": csrf_of(page), "store_key": key, "action": "mark_sent", "reason": "seen"})
    assert status == 303
    status, page, _ = await operator.get(response.headers["Location"])
    assert status == 200 and "The record was marked sent" in page
    heading = re.search(r'<h2 id="heading">([^<]*)</h2>', page)
    assert heading is not None and heading.group(1) == "j***@example.net · receipt"
