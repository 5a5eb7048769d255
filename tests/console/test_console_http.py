"""The console over real HTTP, served by an in-process relay (Redis store, a real aiosmtpd
sink, the audit ledger in a private PostgreSQL schema): anonymous requests, the sign-in's
CSRF token, wrong passwords and the guess budget, the session cookie, a viewer's and an
operator's resolution of an in-doubt message (the ledger row and the audit line), the CSV
export, and a console without a ledger."""

from __future__ import annotations

import asyncio
import csv
import io
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import aiohttp
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
from tests.support.metrics import sample
from tests.support.pki import make_pki
from tests.support.postgres import ledger_schema, wait_ledger_rows
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.timeout(60)

RCPT = "jane.roe@example.net"


def counted(relay: Relay, name: str, **labels: str) -> float:
    return sample(relay.registry, name, **labels)


async def test_every_page_refuses_an_anonymous_request(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """Without a session each page answers 302 to /login (remembering where it was going),
    the export and every POST 401; only the sign-in page and its style sheet answer. Every
    answer carries the security headers."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url,
                                metrics_listen="127.0.0.1:0")
    b = opened(web, relay)
    for path in ("/", "/history?rcpt=a%40b.example&key=k", "/in-doubt", "/stats"):
        status, _, response = await b.get(path)
        assert status == 302, path
        assert response.headers["Location"].startswith("/login?next=/"), path
        assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"]
        assert response.headers["Cache-Control"] == "no-store"
    status, _, _ = await b.get("/export.csv?from=2026-01-01&to=2026-02-01")
    assert status == 401
    for path in ("/in-doubt/resolve", "/logout"):
        status, _, _ = await b.post(path, {"store_key": "x", "action": "release",
                                           "reason": "r", "csrf": "guess"})
        assert status == 401, path
    status, page, _ = await b.get("/login")
    assert status == 200 and 'name="password"' in page
    status, _, _ = await b.get("/static/console.css")
    assert status == 200
    assert counted(relay, "relay_console_refusals_total", reason="anonymous") == 7


async def test_a_sign_in_without_its_forms_token_is_refused(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser]) -> None:
    """A sign-in posted without the token of the sign-in page's cookie (a form on another
    site) is 403, before the password is looked at; so is one with another page's token."""
    relay = await console_relay(make_relay, sink, tmp_path)
    b = opened(web, relay)
    status, _, _ = await b.post("/login", {"user": VIEWER, "password": VIEWER_PASSWORD})
    assert status == 403
    _, page, _ = await b.get("/login")
    other = opened(web, relay)
    status, _, _ = await other.post("/login", {"csrf": csrf_of(page), "user": VIEWER,
                                               "password": VIEWER_PASSWORD})
    assert status == 403
    assert counted(relay, "relay_console_refusals_total", reason="csrf") == 2
    assert counted(relay, "relay_console_sign_ins_total", result="succeeded") == 0


async def test_wrong_passwords_wait_and_spend_the_addresss_budget(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        caplog: pytest.LogCaptureFixture) -> None:
    """A wrong password is answered 401 no sooner than the failure delay (growing with the
    failures before it), an unknown user the same; once the address's budget is spent even
    the right password is refused 429 unchecked. The password is never logged."""
    relay = await console_relay(make_relay, sink, tmp_path, auth_max_failures=2)
    b = opened(web, relay)
    caplog.set_level(logging.INFO, logger="relay.console")
    started = time.monotonic()
    status, page, _ = await b.sign_in(VIEWER, "wrong-pw")
    first_s = time.monotonic() - started
    assert status == 401 and "Wrong user name or password" in page
    assert first_s >= 0.2
    started = time.monotonic()
    status, _, _ = await b.sign_in("nobody", "wrong-pw")
    assert status == 401 and time.monotonic() - started >= 0.4  # 0.2 x (1 + 1 failure)
    status, page, _ = await b.sign_in(VIEWER, VIEWER_PASSWORD)
    assert status == 429 and "Too many failed sign-ins" in page
    assert [counted(relay, "relay_console_sign_ins_total", result=r)
            for r in ("succeeded", "failed", "refused")] == [0, 2, 1]
    assert "wrong-pw" not in caplog.text and VIEWER_PASSWORD not in caplog.text


async def test_a_session_cookie_is_httponly_and_strict_and_sign_in_stays_on_the_console(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser]) -> None:
    """The session cookie is HttpOnly and SameSite=Strict (not Secure over plain HTTP); a
    sign-in whose next page is another site goes to /history instead (no open redirect); the
    session reads pages until sign-out ends it."""
    relay = await console_relay(make_relay, sink, tmp_path)
    b = opened(web, relay)
    status, _, response = await b.sign_in(VIEWER, VIEWER_PASSWORD, "//evil.example/x")
    assert status == 303 and response.headers["Location"] == "/history"
    cookie = response.cookies["dedup_relay_session"]
    assert cookie["httponly"] and cookie["samesite"] == "Strict" and not cookie["secure"]
    status, page, _ = await b.get("/stats")
    assert status == 200 and f"{VIEWER} (viewer)" in page
    status, _, _ = await b.post("/logout", {"csrf": csrf_of(page)})
    assert status == 303
    status, _, _ = await b.get("/stats")
    assert status == 302
    assert counted(relay, "relay_console_sign_ins_total", result="succeeded") == 1


async def in_doubt_message(relay: Relay, sink: Sink, ledger_url: str) -> str:
    """Send a message the sink takes and never answers (in doubt); its store key, once its
    ``unknown`` row landed."""
    sink.handler.hang_after_dot_s = 2.0
    assert (await send(relay.port, [RCPT], message(key="pay-7", template="receipt"))).code \
        == 451
    sink.handler.hang_after_dot_s = 0.0
    [row] = await wait_ledger_rows(ledger_url, 1)
    assert row["outcome"] == "unknown"
    return str(row["store_key"])


async def test_an_operator_resolves_an_in_doubt_message_a_viewer_cannot(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The in-doubt page lists the message (masked recipient, its store key); a viewer's
    release is 403 and changes nothing; an operator's without the page's CSRF token is 403,
    without a reason 400; with both the record is marked sent, the ledger gets a
    ``marked_sent`` row naming the operator, the role and the reason, the audit log a line
    with them, and the history page shows the row."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url,
                                metrics_listen="127.0.0.1:0")
    key = await in_doubt_message(relay, sink, ledger_url)
    viewer = opened(web, relay)
    await viewer.sign_in(VIEWER, VIEWER_PASSWORD)
    status, page, _ = await viewer.get("/in-doubt")
    assert status == 200 and key in page and "j***@example.net" in page
    assert RCPT not in page
    status, refused, _ = await viewer.post("/in-doubt/resolve", {
        "csrf": csrf_of(page), "store_key": key, "action": "release", "reason": "looked"})
    assert status == 403 and "Only an operator" in refused
    assert (await relay.store.inspect(key)).state.value == "unknown"

    operator = opened(web, relay)
    await operator.sign_in(OPERATOR, OPERATOR_PASSWORD)
    _, stats, _ = await operator.get("/stats")
    assert 'id="unresolved">1<' in stats
    _, page, _ = await operator.get("/in-doubt")
    form = {"store_key": key, "action": "mark_sent", "reason": "smarthost log: delivered"}
    status, _, _ = await operator.post("/in-doubt/resolve", form)
    assert status == 403
    status, _, _ = await operator.post("/in-doubt/resolve", {**form, "csrf": csrf_of(page),
                                                             "reason": "  "})
    assert status == 400
    caplog.set_level(logging.INFO, logger="relay.audit")
    status, _, response = await operator.post("/in-doubt/resolve",
                                              {**form, "csrf": csrf_of(page)})
    assert status == 303
    assert (await relay.store.inspect(key)).state.value == "sent"
    rows = await wait_ledger_rows(ledger_url, 2)
    assert [r["outcome"] for r in rows] == ["unknown", "marked_sent"]
    assert rows[1]["store_key"] == key and rows[1]["action"] == "mark_sent"
    assert rows[1]["reply"] == (f"marked sent by an operator: smarthost log: delivered "
                                f"({OPERATOR} (operator, console))")
    assert rows[1]["instance"] == "relay.test/console"
    [line] = [r for r in caplog.records if r.name == "relay.audit"]
    assert (line.operator, line.role, line.reason) == (  # type: ignore[attr-defined]
        f"console:{OPERATOR}", "operator", "smarthost log: delivered")
    status, history, _ = await operator.get(response.headers["Location"])
    assert status == 200 and "marked_sent" in history and "The record was marked sent" in history
    _, page, _ = await operator.get("/in-doubt")
    assert key not in page and "Nothing is in doubt" in page
    assert counted(relay, "relay_console_actions_total", action="mark_sent") == 1
    assert counted(relay, "relay_console_refusals_total", reason="role") == 1


async def test_history_finds_a_message_by_recipient_template_and_key(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """Sent, then its retry suppressed: the history page by recipient, template and key shows
    both rows oldest first (upstream reply and queue id, Message-ID) and the store's SENT
    record; the recipient is shown masked, as the ledger holds it; a recipient the relay
    refuses is a 400 page naming why."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url)
    sent = message(key="pay-9", template="receipt", extra="Message-ID: <p9@app.example>\r\n")
    for _ in range(2):
        assert (await send(relay.port, [RCPT], sent)).code == 250
    await wait_ledger_rows(ledger_url, 2)
    b = opened(web, relay)
    await b.sign_in(VIEWER, VIEWER_PASSWORD)
    status, page, _ = await b.get(f"/history?rcpt={quote(RCPT)}&template=receipt&key=pay-9")
    assert status == 200
    assert page.index("relayed") < page.index("suppressed")
    assert "SINK1" in page and "&lt;p9@app.example&gt;" in page
    assert 'id="state-value">sent<' in page
    assert "j***@example.net" in page and RCPT not in page.replace(f'value="{RCPT}"', "")
    status, page, _ = await b.get("/history?rcpt=not-an-address&key=pay-9")
    assert status == 400


async def test_history_finds_a_fingerprint_under_the_previous_secrets_key_too(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """Sent by a relay keyed with the old secret, its retry suppressed by one keyed with the
    new secret and the old as ``fingerprint_secret_previous`` (design.md §2.3): the second
    relay's history page by recipient, template and key shows both rows (one under each key)
    and the record found under the previous key."""
    before = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                              fingerprint_secret="old secret")
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url,
                                store_prefix=before.settings.store_prefix,
                                fingerprint_secret="new secret",
                                fingerprint_secret_previous="old secret")
    sent = message(key="pay-7", template="receipt")
    assert (await send(before.port, [RCPT], sent)).code == 250
    retry = await send(relay.port, [RCPT], sent)
    assert retry.code == 250 and "duplicate suppressed" in retry.text
    rows = await wait_ledger_rows(ledger_url, 2)
    assert len({row["store_key"] for row in rows}) == 2
    b = opened(web, relay)
    await b.sign_in(VIEWER, VIEWER_PASSWORD)
    status, page, _ = await b.get(f"/history?rcpt={quote(RCPT)}&template=receipt&key=pay-7")
    assert status == 200
    assert page.index("relayed") < page.index("suppressed")
    assert 'id="state-value">sent<' in page


async def test_export_streams_a_periods_rows_as_csv(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """1,200 rows decided in a period (more than one batch) and two outside it: the export
    is every row of the period oldest first, one header line, addresses as the ledger holds
    them (masked), and a reply that a spreadsheet would run as a formula quoted as text."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url)
    start = datetime(2026, 3, 1, tzinfo=UTC)
    entries = [LedgerEntry(decided_at=(start + timedelta(seconds=i)).timestamp(),
                           outcome="relayed", recipient=f"user{i}@example.net",
                           store_key=f"email:fp:{i}", reply="250 ok") for i in range(1200)]
    entries[5] = LedgerEntry(decided_at=(start + timedelta(seconds=5)).timestamp(),
                             outcome="refused_perm", recipient="x@example.net",
                             reply="=HYPERLINK(\"http://evil.example\")")
    entries += [LedgerEntry(decided_at=(start - timedelta(days=1)).timestamp(),
                            outcome="relayed", recipient="old@example.net"),
                LedgerEntry(decided_at=(start + timedelta(days=2)).timestamp(),
                            outcome="relayed", recipient="late@example.net")]
    conn = await asyncpg.connect(ledger_url, timeout=10)
    try:
        await insert_rows(conn, [row_of(e, LedgerOptions(instance="relay-a/1"))
                                 for e in entries])
    finally:
        await conn.close()
    b = opened(web, relay)
    await b.sign_in(VIEWER, VIEWER_PASSWORD)
    async with b.http.get(f"{b.base}/export.csv?from=2026-03-01&to=2026-03-02") as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/csv; charset=utf-8"
        assert "attachment" in response.headers["Content-Disposition"]
        text = await response.text()
    got = list(csv.DictReader(io.StringIO(text)))
    assert len(got) == 1200
    assert got[0]["recipient"] == "u***@example.net" and got[0]["decided_at"].endswith("Z")
    assert got[5]["reply"] == "'=HYPERLINK(\"http://evil.example\")"
    assert [int(r["store_key"].rsplit(":", 1)[1]) for r in got if r["store_key"]] == [
        i for i in range(1200) if i != 5]
    status, page, _ = await b.get("/export.csv?from=2026-03-02&to=2026-03-01")
    assert status == 400 and "period is empty" in page
    status, page, _ = await b.get("/export.csv?from=yesterday")
    assert status == 400


async def test_without_a_ledger_the_history_is_the_stores_state_alone(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser]) -> None:
    """No ledger configured: the history page shows the store's record and says the ledger
    is missing; a lookup by address alone says it needs one; the in-doubt page says where its
    list comes from; a message's page and the export are 404."""
    relay = await console_relay(make_relay, sink, tmp_path)
    assert (await send(relay.port, [RCPT], message(key="pay-1"))).code == 250
    b = opened(web, relay)
    await b.sign_in(VIEWER, VIEWER_PASSWORD)
    status, page, _ = await b.get(f"/history?rcpt={quote(RCPT)}&template=welcome&key=pay-1")
    assert status == 200 and 'id="no-ledger"' in page and 'id="state-value">sent<' in page
    status, page, _ = await b.get("/in-doubt")
    assert status == 200 and 'id="no-ledger"' in page
    status, page, _ = await b.get(f"/history?rcpt={quote(RCPT)}")
    assert status == 200 and 'id="no-ledger"' in page and "no rows to search" in page
    status, _, _ = await b.get("/message/0123456789ab")
    assert status == 404
    status, _, _ = await b.get("/export.csv")
    assert status == 404


async def test_over_tls_the_cookie_is_secure_and_transport_security_is_asked(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser]) -> None:
    """With the listener's certificate the console serves HTTPS only: the session cookie is
    Secure and answers carry Strict-Transport-Security; plain HTTP gets no page."""
    pki = make_pki(tmp_path)
    relay = await console_relay(make_relay, sink, tmp_path, tls_cert=pki.cert,
                                tls_key=pki.key)
    assert relay.console is not None and relay.console.tls
    b = opened(web, relay, scheme="https",
               connector=aiohttp.TCPConnector(ssl=pki.client_context))
    status, _, response = await b.sign_in(VIEWER, VIEWER_PASSWORD)
    assert status == 303
    assert response.cookies["dedup_relay_session"]["secure"]
    assert "max-age" in response.headers["Strict-Transport-Security"]
    plain = opened(web, relay)
    with pytest.raises(aiohttp.ClientError):
        await asyncio.wait_for(plain.get("/login"), 5)


async def test_a_download_left_half_way_ends_its_ledger_transaction(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """A client that closes the connection after the export's first bytes (of 5,000 rows)
    leaves no transaction open on the ledger's database, and the next export is whole."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url)
    start = datetime(2026, 4, 1, tzinfo=UTC)
    conn = await asyncpg.connect(ledger_url, timeout=10)
    try:
        await insert_rows(conn, [row_of(LedgerEntry(
            decided_at=(start + timedelta(milliseconds=i)).timestamp(), outcome="relayed",
            recipient=f"user{i}@example.net", reply="250 " + "x" * 200),
            LedgerOptions(instance="relay-a/1")) for i in range(5000)])
        b = opened(web, relay)
        await b.sign_in(VIEWER, VIEWER_PASSWORD)
        url = f"{b.base}/export.csv?from=2026-04-01&to=2026-04-02"
        async with b.http.get(url) as response:
            assert response.status == 200
            assert await response.content.read(1000)
            response.close()  # the client leaves
        deadline = time.monotonic() + 60
        while await conn.fetchval(  # the export's statement (its period bound), left open
                "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'"
                " AND query LIKE '%decided_at < $2%' AND pid <> pg_backend_pid()"):
            assert time.monotonic() < deadline, "a transaction stayed open"
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
    async with b.http.get(url) as response:
        text = await response.text()
    assert len(list(csv.DictReader(io.StringIO(text)))) == 5000


async def operators_on_the_in_doubt_page(web: list[Browser], relay: Relay, count: int
                                         ) -> tuple[list[Browser], list[str]]:
    """``count`` operators signed in, each with the in-doubt page open (its HTML)."""
    browsers = [opened(web, relay) for _ in range(count)]
    pages = []
    for b in browsers:
        await b.sign_in(OPERATOR, OPERATOR_PASSWORD)
        pages.append((await b.get("/in-doubt"))[1])
    return browsers, pages


async def test_only_a_record_still_in_doubt_is_resolved(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """Two operators on one in-doubt page: the first marks it sent, the second's release is
    refused 409 and leaves the SENT record (a released duplicate would go out again); a key
    that was sent and never in doubt, or never seen, is refused the same way; the page after
    an action says only what was done."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url)
    assert relay.store is not None
    key = await in_doubt_message(relay, sink, ledger_url)
    assert (await send(relay.port, ["sent@example.net"], message(key="k-sent"))).code == 250
    [sent_key] = [r["store_key"] for r in await wait_ledger_rows(ledger_url, 2)
                  if r["outcome"] == "relayed"]
    (first, second), pages = await operators_on_the_in_doubt_page(web, relay, 2)
    status, _, _ = await first.post("/in-doubt/resolve", {
        "csrf": csrf_of(pages[0]), "store_key": key, "action": "mark_sent", "reason": "seen"})
    assert status == 303
    status, page, _ = await second.post("/in-doubt/resolve", {
        "csrf": csrf_of(pages[1]), "store_key": key, "action": "release", "reason": "late"})
    assert status == 409 and "no longer in doubt" in page
    assert (await relay.store.inspect(key)).state.value == "sent"
    never = relay.settings.store_prefix + "0" * 64
    for other in (sent_key, never):
        for action in ("release", "mark_sent"):
            status, _, _ = await second.post("/in-doubt/resolve", {
                "csrf": csrf_of(pages[1]), "store_key": other, "action": action,
                "reason": "r"})
            assert status == 409, (other, action)
    assert (await relay.store.inspect(sent_key)).state.value == "sent"
    assert (await relay.store.inspect(never)).state.value == "absent"
    assert [r["outcome"] for r in await wait_ledger_rows(ledger_url, 3)].count(
        "marked_sent") == 1
    _, page, _ = await first.get(f"/history?store_key={key}&done=hacked%20by%20me")
    assert "hacked" not in page and 'id="done"' not in page


async def test_parallel_sign_ins_with_the_right_password_all_go_through(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser]) -> None:
    """Eight sign-ins at once from one address (a team behind one proxy) with a budget of
    two: each waits for the checks holding the budget, none is refused."""
    relay = await console_relay(make_relay, sink, tmp_path, auth_max_failures=2)
    browsers = [opened(web, relay) for _ in range(8)]
    results = await asyncio.gather(*(b.sign_in(OPERATOR, OPERATOR_PASSWORD)
                                     for b in browsers))
    assert [status for status, _, _ in results] == [303] * 8
    assert counted(relay, "relay_console_sign_ins_total", result="refused") == 0


async def test_a_reload_gives_the_console_the_live_settings(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """After a reload that lengthens dedup_window (600 s to 7200 s), a mark-sent from the
    console keeps the record for the new window, as `dedup-relay mark-sent` would."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url,
                                dedup_window=600)
    assert relay.store is not None
    key = await in_doubt_message(relay, sink, ledger_url)
    await relay.apply(relay.settings.model_copy(update={"dedup_window": 7200.0}),
                      frozenset({"dedup_window"}))
    b = opened(web, relay)
    await b.sign_in(OPERATOR, OPERATOR_PASSWORD)
    _, page, _ = await b.get("/in-doubt")
    status, _, _ = await b.post("/in-doubt/resolve", {
        "csrf": csrf_of(page), "store_key": key, "action": "mark_sent", "reason": "seen"})
    assert status == 303
    ttl = (await relay.store.inspect(key)).ttl_s
    assert ttl is not None and 7000 < ttl <= 7200, ttl


async def test_a_request_body_that_never_comes_is_closed_with_its_connection(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A POST that announces a body and sends none is closed when the idle time passes
    (0.5 s here), without a session: it does not hold its connection for good."""
    monkeypatch.setattr("relay.console.server.IDLE_TIMEOUT_S", 0.5)
    relay = await console_relay(make_relay, sink, tmp_path)
    assert relay.console is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.console.port)
    writer.write(b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                 b"Content-Type: application/x-www-form-urlencoded\r\n\r\n")
    started = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    assert time.monotonic() - started < 5


async def test_a_release_and_a_mark_sent_at_once_settle_the_record_once(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        ledger_url: str) -> None:
    """Two operators resolve one in-doubt record at the same moment, one releasing, one
    marking sent: one is done, the other refused 409; the ledger has one operator row."""
    relay = await console_relay(make_relay, sink, tmp_path, ledger=ledger_url)
    key = await in_doubt_message(relay, sink, ledger_url)
    (first, second), pages = await operators_on_the_in_doubt_page(web, relay, 2)
    results = await asyncio.gather(
        first.post("/in-doubt/resolve", {"csrf": csrf_of(pages[0]), "store_key": key,
                                         "action": "release", "reason": "not delivered"}),
        second.post("/in-doubt/resolve", {"csrf": csrf_of(pages[1]), "store_key": key,
                                          "action": "mark_sent", "reason": "delivered"}))
    assert sorted(status for status, _, _ in results) == [303, 409]
    await asyncio.sleep(0.3)  # a second row, had one been written, has landed
    rows = await wait_ledger_rows(ledger_url, 2)
    assert len(rows) == 2 and rows[0]["outcome"] == "unknown", rows


@pytest.fixture
def store_and_ledger_url() -> Iterator[str]:
    """A private PostgreSQL schema holding the store's and the ledger's tables (set up before
    the relay, dropped after it stopped)."""
    with ledger_schema(store=True) as url:
        yield url


async def _waiting_for_a_lock(conn: asyncpg.Connection, within_s: float) -> bool:
    """Whether a session waits for a lock the transaction of ``conn`` holds (polled up to
    ``within_s`` seconds; other sessions of the server, other tests', do not count)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if await conn.fetchval("SELECT count(*) FROM pg_stat_activity "
                               "WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))"):
            return True
        await asyncio.sleep(0.02)
    return False


async def test_a_mark_sent_that_a_retry_overtook_is_refused_409(
        store_and_ledger_url: str, make_relay: MakeRelay, sink: Sink, tmp_path: Path,
        web: list[Browser]) -> None:
    """The console's mark-sent reads the record in doubt; a retry's take-over (PENDING of its
    own) holds the row and commits while the mark-sent waits for it: 409 in the release's
    wording, the retry's record kept, no ``marked_sent`` row."""
    url = store_and_ledger_url
    relay = await console_relay(make_relay, sink, tmp_path, ledger=url, store=url)
    assert relay.store is not None
    key = await in_doubt_message(relay, sink, url)
    operator = opened(web, relay)
    await operator.sign_in(OPERATOR, OPERATOR_PASSWORD)
    _, page, _ = await operator.get("/in-doubt")
    retry = await asyncpg.connect(url, timeout=10)
    try:
        tx = retry.transaction()
        await tx.start()
        await retry.execute(
            "UPDATE dedup_relay_fingerprints SET state = 'pending', token = 'Y', at = NULL, "
            "expires_at = now() + interval '30 seconds' WHERE key = $1", key)
        posted = asyncio.ensure_future(operator.post("/in-doubt/resolve", {
            "csrf": csrf_of(page), "store_key": key, "action": "mark_sent",
            "reason": "smarthost log: delivered"}))
        assert await _waiting_for_a_lock(retry, 20.0), "the mark-sent never waited"
        await tx.commit()
        status, refused, _ = await posted
    finally:
        await retry.close()
    record = await relay.store.inspect(key)
    assert (record.state.value, record.token) == ("pending", "Y"), record
    assert status == 409, refused
    assert ("Refused: the record changed while it was being marked sent; nothing was done. "
            "Look again.") in refused
    await asyncio.sleep(0.3)  # a row, had one been written, has landed
    assert [r["outcome"] for r in await wait_ledger_rows(url, 2, timeout_s=0.5)] == ["unknown"]
