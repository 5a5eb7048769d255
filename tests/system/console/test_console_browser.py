"""The console in a real browser (Debian's chromium, driven through its chromedriver by
Selenium; nothing downloaded), served by the supervisor of a `serve` process with two workers
on SQLite, with the audit ledger in a private PostgreSQL schema and a real aiosmtpd sink as
the smarthost. One browser session walks the whole of it:

- a viewer finds a receipt the relay sent and then suppressed by the recipient alone, its
  Message-ID, the smarthost's queue id, the relay's queue id and a period, opens its page
  and reads its timeline, and follows the ``console`` link of the receipt's real decision
  log line (``--console-url``) to the same page;
- the viewer pages through 250 rows of another recipient (inserted into the ledger) with
  the ``next`` link, each row once;
- at 1024, 1280 and 1920 px wide no page is wider than the window and every button is fully
  in view; on a 390 px phone the in-doubt actions are reachable;
- the viewer's in-doubt page has no operator button; an operator marks the in-doubt message
  (a long, unbroken Message-ID) sent with a reason and lands on its record, named by its
  recipient; the export of the period downloads as CSV with those rows.

With ``DEDUP_RELAY_SCREENSHOTS=DIR`` the pages are saved there as PNG at each width
(docs/console-found.png, console-message.png and console-in-doubt.png are its 1280 px ones).
"""

from __future__ import annotations

import asyncio
import csv
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import asyncpg
import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.wait import WebDriverWait

from relay.core.interfaces import LedgerEntry
from relay.store.postgres.ledger import LedgerOptions, insert_rows, row_of
from tests.support.clients import message, send
from tests.support.console import (
    OPERATOR,
    OPERATOR_PASSWORD,
    VIEWER,
    VIEWER_PASSWORD,
    users_file,
)
from tests.support.net import free_port
from tests.support.postgres import wait_ledger_rows
from tests.support.relays import ServeProcess, start_serve
from tests.support.sink import Sink

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CUSTOMER = "jane.roe@example.net"
BULK = "bulk.buyer@example.org"
BULK_ROWS = 250
IN_DOUBT_MESSAGE_ID = ("<20261205T143000.order-1002.receipt.settlement-batch-7f3a9c2e41d8b6a0"
                       "5e7c9d1f3b8a2c4e6f0d9b7a5c3e1f8d2b4a6c0e9f7d5b3a1@mailer.app.example>")
WIDTHS = (1024, 1280, 1920)
PHONE = 390
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

# the page's width against the window's, and every visible button not fully in view: past
# the window's edges, outside an ancestor that clips (overflow other than visible), or with
# its own text cut
_LAYOUT = """
const inner = window.innerWidth, clipped = [];
for (const b of document.querySelectorAll('button')) {
  const r = b.getBoundingClientRect();
  if (r.width === 0 && r.height === 0) continue;
  let ok = r.left >= -0.5 && r.right <= inner + 0.5 && b.scrollWidth <= b.clientWidth + 1;
  for (let p = b.parentElement; p && ok; p = p.parentElement) {
    const s = getComputedStyle(p);
    if (s.overflowX !== 'visible' || s.overflowY !== 'visible') {
      const q = p.getBoundingClientRect();
      ok = r.left >= q.left - 0.5 && r.right <= q.right + 0.5
           && r.top >= q.top - 0.5 && r.bottom <= q.bottom + 0.5;
    }
  }
  if (!ok) clipped.push(b.textContent.trim() + ' ' + JSON.stringify(r));
}
return {scroll: document.documentElement.scrollWidth, inner: inner, clipped: clipped};
"""


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[WebDriver]:
    """Headless chromium downloading into ``tmp_path / "downloads"``."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    assert not missing, f"install Debian's chromium and chromium-driver: {missing} missing"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1280,1000", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(arg)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options.add_experimental_option("prefs", {
        "download.default_directory": str(downloads), "download.prompt_for_download": False})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


@dataclass(frozen=True)
class Sent:
    """What the set-up sent and wrote: the receipt's relay queue id and its retry's, the
    smarthost's queue id, the in-doubt store key, the period of the sent messages, and the
    console link of the receipt's decision log line."""

    queue_id: str
    retry_queue_id: str
    upstream_queue_id: str
    in_doubt_key: str
    since: datetime
    until: datetime
    console_link: str


class Console:
    """The console as a person uses it in ``driver``."""

    def __init__(self, driver: WebDriver, base: str) -> None:
        self.driver = driver
        self.base = base
        self.shots = os.environ.get("DEDUP_RELAY_SCREENSHOTS")
        self.width = 1280

    def open(self, path: str) -> None:
        self.driver.get(path if path.startswith("http") else self.base + path)

    def text(self, css: str) -> str:
        return self.driver.find_element(By.CSS_SELECTOR, css).text

    def all(self, css: str) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def fill(self, css: str, value: str) -> None:
        field = self.driver.find_element(By.CSS_SELECTOR, css)
        field.clear()
        field.send_keys(value)

    def click(self, css: str, *, then: str, within: WebElement | None = None) -> None:
        """Click ``css`` (in ``within``, else the page) and wait for the page it loads to show
        ``then`` (a click returns before the next page has loaded)."""
        clicked = (within or self.driver).find_element(By.CSS_SELECTOR, css)
        clicked.click()

        def left(_: WebDriver) -> bool:
            """The clicked element's page is gone (chromedriver says so as a stale element,
            or, mid-navigation, as a node that no longer belongs to the document)."""
            try:
                clicked.is_enabled()
            except WebDriverException:  # StaleElementReferenceException is one
                return True
            return False

        WebDriverWait(self.driver, 15).until(left)
        WebDriverWait(self.driver, 15, ignored_exceptions=(WebDriverException,)).until(
            expected_conditions.presence_of_element_located((By.CSS_SELECTOR, then)))

    def sign_in(self, user: str, password: str) -> None:
        """From wherever the browser was sent to /login: fill and send the form."""
        assert "/login" in self.driver.current_url, self.driver.current_url
        self.fill("#user", user)
        self.fill("#password", password)
        self.click("#sign-in", then="#signed-in")

    def sign_out(self) -> None:
        self.click(".signout button", then="#login")

    def resize(self, width: int) -> None:
        """Show pages ``width`` CSS pixels wide (a phone below 500: touch, its viewport)."""
        self.width = width
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": 1000 if width > 500 else 844, "deviceScaleFactor": 1,
            "mobile": width < 500})

    def shot(self, name: str) -> None:
        if self.shots:
            Path(self.shots).mkdir(parents=True, exist_ok=True)
            self.driver.save_screenshot(
                str(Path(self.shots) / f"console-{name}-{self.width}.png"))

    def fits(self, page: str) -> None:
        """The page is no wider than the window, and every button is fully in view."""
        layout: dict[str, Any] = self.driver.execute_script(_LAYOUT)
        assert layout["scroll"] <= layout["inner"], (page, self.width, layout)
        assert not layout["clipped"], (page, self.width, layout)

    def queue_ids(self, table: str = "#results") -> list[str]:
        return [str(row.get_attribute("data-queue-id"))
                for row in self.all(f"{table} tbody tr")]

    def history_outcomes(self) -> list[str]:
        return [cell.text for cell in self.all("#history-rows tbody td:nth-child(2)")]


def find_by_what_support_holds(console: Console, sent: Sent) -> None:
    """Recipient alone (typed into the form), Message-ID, the smarthost's and the relay's queue
    id, a period; the message's page and its timeline, also from its log line's link."""
    console.fill("#rcpt", CUSTOMER)
    console.click("#look-up", then="#results")
    assert set(console.queue_ids()[-2:]) == {sent.retry_queue_id, sent.queue_id}
    assert CUSTOMER not in console.text("#results")  # masked, as the ledger holds it
    console.shot("found")
    for query in (f"message_id={quote('<pay-1@app.example>')}",
                  f"queue_id={sent.upstream_queue_id}", f"queue_id={sent.queue_id}",
                  f"since={quote(sent.since.isoformat())}&until="
                  f"{quote(sent.until.isoformat())}"):
        console.open(f"/history?{query}")
        assert sent.queue_id in console.queue_ids(), query
    assert len(console.queue_ids()) == 3  # the period holds the three messages sent
    row = console.driver.find_element(By.CSS_SELECTOR,
                                      f'#results tr[data-queue-id="{sent.queue_id}"]')
    console.click(".open-message", then="#timeline", within=row)
    assert console.text("#queue-id") == sent.queue_id
    kinds = [e.get_attribute("data-kind") for e in console.all("#timeline li")]
    assert kinds == ["received", "sending", "relayed", "suppressed"], kinds
    assert re.search(r"UTC\s+\((just now|\d+ \w+ ago)\)", console.text("#received"))
    assert console.text(".store-state") == "sent"
    console.shot("message")
    console.open("/history")
    console.open(sent.console_link)  # from the decision log line
    assert console.text("#queue-id") == sent.queue_id
    assert console.all("#timeline li")


def page_through(console: Console) -> None:
    """250 rows of one recipient: five pages of 50 through the next link, each row once."""
    console.open(f"/history?rcpt={quote(BULK)}")
    seen: list[str] = []
    pages = 0
    while True:
        pages += 1
        seen += console.queue_ids()
        if not console.all("#next"):
            break
        console.click("#next", then="#results")
    assert pages == 5 and len(seen) == BULK_ROWS == len(set(seen))
    assert seen == [f"bulk{i:08d}" for i in reversed(range(BULK_ROWS))]
    assert console.all("#last-page")


def layout_at_each_width(console: Console, sent: Sent, role: str) -> None:
    """Every page at 1024, 1280 and 1920 px: nothing wider than the window, every button in
    view; screenshots of each."""
    pages = {"search": f"/history?rcpt={quote(BULK)}", "message": f"/message/{sent.queue_id}",
             "in-doubt": "/in-doubt", "stats": "/stats",
             "fingerprint": f"/history?store_key={sent.in_doubt_key}"}
    for width in WIDTHS:
        console.resize(width)
        for name, path in pages.items():
            console.open(path)
            console.fits(f"{role} {name}")
            if role == "operator":
                console.shot(name)
    console.resize(1280)


def viewer_walk(console: Console, sent: Sent) -> None:
    console.open("/history")  # anonymous: sent to the sign-in page
    console.sign_in(VIEWER, VIEWER_PASSWORD)
    assert console.text("#signed-in") == f"{VIEWER} (viewer)"
    find_by_what_support_holds(console, sent)
    page_through(console)
    console.open("/in-doubt")
    row = console.driver.find_element(By.CSS_SELECTOR,
                                      f'tr[data-store-key="{sent.in_doubt_key}"]')
    assert IN_DOUBT_MESSAGE_ID in row.text
    assert not console.all(".mark-sent") and not console.all(".release")
    assert not console.all("form.resolve") and console.all("#viewer-note")
    layout_at_each_width(console, sent, "viewer")
    console.sign_out()


def operator_walk(console: Console, sent: Sent, downloads: Path) -> list[dict[str, str]]:
    console.open("/in-doubt")
    console.sign_in(OPERATOR, OPERATOR_PASSWORD)
    layout_at_each_width(console, sent, "operator")
    console.resize(PHONE)
    console.open("/in-doubt")
    console.fits("operator in-doubt on a phone")
    console.shot("in-doubt")
    console.resize(1280)
    console.open("/in-doubt")
    row = console.driver.find_element(By.CSS_SELECTOR,
                                      f'tr[data-store-key="{sent.in_doubt_key}"]')
    row.find_element(By.CSS_SELECTOR, ".reason").send_keys("smarthost log: delivered")
    console.click(".mark-sent", then="#done", within=row)
    assert console.text("#done") == "The record was marked sent."
    assert console.text("#heading") == "j***@example.net · receipt"
    assert console.history_outcomes() == ["unknown", "marked_sent"]
    assert console.text("#state-value") == "sent"
    console.shot("resolved")

    console.open("/stats")
    assert console.text("#unresolved") == "0"
    today = datetime.now(tz=UTC).date()
    console.open(f"/export.csv?from={today}&to={today + timedelta(days=1)}")
    deadline = time.monotonic() + 15
    done: list[Path] = []
    while time.monotonic() < deadline and not done:
        done = [p for p in downloads.glob("*.csv")]
        time.sleep(0.1)
    assert done, "the export did not download"
    with done[0].open(newline="", encoding="utf-8") as source:
        return list(csv.DictReader(source))


async def bulk_rows(ledger_url: str) -> None:
    """250 rows of one recipient over the last three days, written straight into the
    ledger (as the relay writes them: recipient masked, its digest kept)."""
    start = datetime.now(tz=UTC) - timedelta(days=3)
    entries = [LedgerEntry(
        decided_at=(start + timedelta(minutes=15 * i)).timestamp(), outcome="relayed",
        recipient=BULK, store_key=f"email:fp:{i:064x}", template="newsletter",
        message_id=f"<{i:04d}.{'7' * 60}@bulk-mailer.app.example>", queue_id=f"bulk{i:08d}",
        upstream="smarthost", upstream_queue_id=f"BULK{i:08d}",
        reply=f"250 2.0.0 Ok: queued as BULK{i:08d}") for i in range(BULK_ROWS)]
    conn = await asyncpg.connect(ledger_url, timeout=10)
    try:
        await insert_rows(conn, [row_of(e, LedgerOptions(instance="relay-a/1"))
                                 for e in entries])
    finally:
        await conn.close()


async def decision_line(served: ServeProcess, queue_id: str) -> dict[str, Any]:
    """The decision log line of the message ``queue_id`` (a worker's line may reach the log
    file after the ledger's row reached the database)."""
    deadline = time.monotonic() + 15
    while True:
        found = [e for e in served.lines()
                 if e.get("message") == "message" and e.get("queue_id") == queue_id]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, found
            return found[0]
        await asyncio.sleep(0.1)


async def test_support_and_on_call_in_a_real_browser(
        tmp_path: Path, sink: Sink, ledger_url: str, chromium: WebDriver) -> None:
    """See the module's docstring."""
    console_port = free_port()
    base = f"http://127.0.0.1:{console_port}"
    await bulk_rows(ledger_url)
    served = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--store", "sqlite:///dedup.db",
        # a reply to the final dot within 3 s: the receipts' come in milliseconds (a loaded
        # machine's stall of a second must not make them in doubt), the lost one's never
        "--ledger", ledger_url, "--upstream-timeout", "3", "--metrics-listen", "off",
        "--console-listen", f"127.0.0.1:{console_port}", "--console-url", base,
        "--console-auth-file", str(users_file(tmp_path)), workers=2)
    try:
        receipt = message(key="order-1001", template="receipt",
                          extra="Message-ID: <pay-1@app.example>\r\n")
        for _ in range(2):  # sent, then the retry suppressed
            assert (await send(served.port, [CUSTOMER], receipt)).code == 250
        sink.handler.hang_after_dot_s = 5.0  # taken, and the reply never comes in time
        doubt = await send(served.port, [CUSTOMER], message(
            key="order-1002", template="receipt",
            extra=f"Message-ID: {IN_DOUBT_MESSAGE_ID}\r\n"))
        assert doubt.code == 451, doubt
        sink.handler.hang_after_dot_s = 0.0
        rows = [r for r in await wait_ledger_rows(ledger_url, BULK_ROWS + 3)
                if not r["queue_id"].startswith("bulk")]  # a relay's queue id is hex
        # by outcome, not by order: two workers' clock offsets (each measured to half a round
        # trip) may order a send and its retry a few milliseconds apart either way
        assert len(rows) == 3, rows
        by_outcome = {r["outcome"]: r for r in rows}
        first, retry, lost = (by_outcome[o] for o in ("relayed", "suppressed", "unknown"))
        line = await decision_line(served, first["queue_id"])
        sent = Sent(first["queue_id"], retry["queue_id"], first["upstream_queue_id"],
                    lost["store_key"], first["decided_at"] - timedelta(seconds=1),
                    lost["decided_at"] + timedelta(seconds=1), str(line["console"]))
        assert sent.console_link == f"{base}/message/{sent.queue_id}"
        console = Console(chromium, base)
        await asyncio.to_thread(viewer_walk, console, sent)
        exported = await asyncio.to_thread(operator_walk, console, sent,
                                           tmp_path / "downloads")
    finally:
        code = served.stop()
    assert code == 0, served.lines()[-5:]
    mine = [r for r in exported if not r["queue_id"].startswith("bulk")]
    outcomes = [r["outcome"] for r in mine]  # the send and its retry in either order (above)
    assert sorted(outcomes[:2]) == ["relayed", "suppressed"]
    assert outcomes[2:] == ["unknown", "marked_sent"]
    assert {r["recipient"] for r in mine[:3]} == {"j***@example.net"}
    assert mine[3]["reply"].endswith(f"({OPERATOR} (operator, console))")
    starts = [e for e in served.lines() if "console http://" in str(e.get("message", ""))]
    assert len(starts) == 1, starts  # one console, the supervisor's
