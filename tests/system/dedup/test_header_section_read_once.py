"""One message through the relay locates its header section exactly once: the listener parses
it at DATA (:func:`relay.core.headers.parse_message`) and the fingerprint's values, header
stripping, the audit ledger's Message-ID and the RFC 3464 notice's quoted headers all read
that one :class:`relay.core.headers.ParsedMessage`. A real relay in this process, a real
aiosmtpd sink upstream that refuses one recipient, a real PostgreSQL ledger."""

from __future__ import annotations

from collections import deque

import pytest

from relay.core import headers
from tests.support.clients import message, send
from tests.support.postgres import wait_ledger_rows
from tests.support.relays import MakeRelay
from tests.support.sink import Sink
from tests.support.waiting import until

A, B = "ann@example.net", "bob@example.net"


async def test_one_message_locates_its_header_section_once(
        make_relay: MakeRelay, sink: Sink, ledger_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A message relayed to one recipient and refused for another (a 250, a notice owed),
    with the dedup fields stripped and a ledger row per recipient, then its duplicate: two
    messages, two scans of a header section; the notice quotes the message's headers."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                             strip_dedupe_headers=True, dsn_on_partial_failure=True)
    scans: list[int] = []
    scan = headers._scan_header_section

    def counted(content: bytes) -> tuple[int, tuple[headers.HeaderField, ...]]:
        scans.append(len(content))
        return scan(content)

    monkeypatch.setattr(headers, "_scan_header_section", counted)
    sink.handler.rcpt_plan[B] = deque(["550 5.1.1 no such user"])
    sent = message(key="order-7", extra="Message-ID: <m7@app.example>\r\n")
    assert (await send(relay.port, [A, B], sent)).code == 250
    await until(lambda: len(sink.handler.delivered) == 2)  # the message, the notice
    assert (await send(relay.port, [A], sent)).code == 250  # the duplicate
    rows = await wait_ledger_rows(ledger_url, 3)
    assert [row["message_id"] for row in rows] == ["<m7@app.example>"] * 3
    relayed, notice = sink.handler.delivered
    assert b"X-Dedupe-Key" not in relayed.content  # stripped
    assert b"Message-ID: <m7@app.example>" in notice.content  # quoted in the notice
    assert len(scans) == 2, scans
