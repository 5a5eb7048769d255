"""The console in a real browser (Debian's chromium, driven through its chromedriver by
Selenium; nothing downloaded), served by the supervisor of a `serve` process with two workers
on SQLite, with the audit ledger in a private PostgreSQL schema and a real aiosmtpd sink as
the smarthost.

A viewer signs in, finds the history of a receipt the relay sent and then suppressed, sees
an in-doubt message (the sink took it and never answered its final dot), and fails to
resolve it; an operator marks it sent with a reason and sees the ``marked_sent`` row; the
export of the period downloads as CSV with those rows.

With ``DEDUP_RELAY_SCREENSHOTS=DIR`` the pages are saved there as PNG (docs/console-*.png are
made so).
"""

from __future__ import annotations

import asyncio
import csv
import os
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.wait import WebDriverWait

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
from tests.support.relays import start_serve
from tests.support.sink import Sink

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CUSTOMER = "jane.roe@example.net"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[WebDriver]:
    """Headless chromium downloading into ``tmp_path / "downloads"``."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    assert not missing, f"install Debian's chromium and chromium-driver: {missing} missing"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1200,1000", "--disable-gpu"):
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


class Console:
    """The console as a person uses it in ``driver``."""

    def __init__(self, driver: WebDriver, base: str) -> None:
        self.driver = driver
        self.base = base
        self.shots = os.environ.get("DEDUP_RELAY_SCREENSHOTS")

    def open(self, path: str) -> None:
        self.driver.get(self.base + path)

    def text(self, css: str) -> str:
        return self.driver.find_element(By.CSS_SELECTOR, css).text

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

    def shot(self, name: str) -> None:
        if self.shots:
            Path(self.shots).mkdir(parents=True, exist_ok=True)
            self.driver.save_screenshot(str(Path(self.shots) / f"console-{name}.png"))

    def history_outcomes(self) -> list[str]:
        return [cell.text for cell in self.driver.find_elements(
            By.CSS_SELECTOR, "#history-rows tbody td:nth-child(2)")]


def browse(console: Console, downloads: Path, in_doubt_key: str) -> list[dict[str, str]]:
    """The viewer's and the operator's walk through the console; the exported rows."""
    console.open("/history")  # anonymous: sent to the sign-in page
    console.sign_in(VIEWER, VIEWER_PASSWORD)
    assert console.text("#signed-in") == f"{VIEWER} (viewer)"
    console.fill("#rcpt", CUSTOMER)
    console.fill("#template", "receipt")
    console.fill("#key", "order-1001")
    console.click("#look-up", then="#state-value")
    assert console.history_outcomes() == ["relayed", "suppressed"]
    assert console.text("#state-value") == "sent"
    assert CUSTOMER not in console.text("main h2")  # masked, as the ledger holds it
    console.shot("history")

    console.open("/in-doubt")
    row = console.driver.find_element(By.CSS_SELECTOR,
                                      f'tr[data-store-key="{in_doubt_key}"]')
    assert "<pay-2@app.example>" in row.text
    console.shot("in-doubt")
    row.find_element(By.CSS_SELECTOR, ".reason").send_keys("smarthost log: delivered")
    console.click(".mark-sent", then="#message", within=row)
    assert "Only an operator" in console.text("#message")
    console.open("/in-doubt")
    assert console.driver.find_elements(By.CSS_SELECTOR,
                                        f'tr[data-store-key="{in_doubt_key}"]')
    console.sign_out()

    console.open("/in-doubt")
    console.sign_in(OPERATOR, OPERATOR_PASSWORD)
    row = console.driver.find_element(By.CSS_SELECTOR,
                                      f'tr[data-store-key="{in_doubt_key}"]')
    row.find_element(By.CSS_SELECTOR, ".reason").send_keys("smarthost log: delivered")
    console.click(".mark-sent", then="#done", within=row)
    assert console.text("#done") == "The record was marked sent."
    assert console.history_outcomes() == ["unknown", "marked_sent"]
    assert console.text("#state-value") == "sent"
    console.shot("resolved")

    console.open("/stats")
    assert console.text("#unresolved") == "0"
    console.shot("stats")
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


async def test_support_and_on_call_in_a_real_browser(
        tmp_path: Path, sink: Sink, ledger_url: str, chromium: WebDriver) -> None:
    """See the module's docstring."""
    console_port = free_port()
    served = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--store", "sqlite:///dedup.db",
        "--ledger", ledger_url, "--upstream-timeout", "0.8", "--metrics-listen", "off",
        "--console-listen", f"127.0.0.1:{console_port}",
        "--console-auth-file", str(users_file(tmp_path)), workers=2)
    try:
        receipt = message(key="order-1001", template="receipt",
                          extra="Message-ID: <pay-1@app.example>\r\n")
        for _ in range(2):  # sent, then the retry suppressed
            assert (await send(served.port, [CUSTOMER], receipt)).code == 250
        sink.handler.hang_after_dot_s = 2.0  # taken, and the reply never comes in time
        doubt = await send(served.port, [CUSTOMER], message(
            key="order-1002", template="receipt", extra="Message-ID: <pay-2@app.example>\r\n"))
        assert doubt.code == 451, doubt
        sink.handler.hang_after_dot_s = 0.0
        rows = await wait_ledger_rows(ledger_url, 3)
        [in_doubt_key] = [r["store_key"] for r in rows if r["outcome"] == "unknown"]
        console = Console(chromium, f"http://127.0.0.1:{console_port}")
        exported = await asyncio.to_thread(browse, console, tmp_path / "downloads",
                                           in_doubt_key)
    finally:
        code = served.stop()
    assert code == 0, served.lines()[-5:]
    assert [r["outcome"] for r in exported] == ["relayed", "suppressed", "unknown",
                                                "marked_sent"]
    assert {r["recipient"] for r in exported[:3]} == {"j***@example.net"}
    assert exported[3]["reply"].endswith(f"({OPERATOR} (operator, console))")
    starts = [e for e in served.lines() if "console http://" in str(e.get("message", ""))]
    assert len(starts) == 1, starts  # one console, the supervisor's
