"""add_message_id (relay/smtp/handler.py, ParsedMessage.with_field): a message without a
Message-ID field gets exactly one, ``<QUEUE-ID@hostname>`` (RFC 5322 section 3.6.4, as MTAs
add one), recorded in the ledger; a message with one goes upstream byte for byte as it came;
with the setting off, none is added."""

from __future__ import annotations

import re

import pytest

from relay.core.headers import parse_message
from tests.support.clients import message, send
from tests.support.postgres import wait_ledger_rows
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

RCPT = "user@example.net"


@pytest.mark.parametrize("content", [
    b"From: a@example.com\r\nSubject: x\r\n\r\nbody\r\n",
    b"From a@example.com Mon Jan  1 00:00:00 2026\r\nSubject: x\r\n\r\nbody\r\n",
    b"\r\nbody only\r\n",
    b"Subject: folded\r\n  on two lines\r\n\r\n",
    b"Subject: no line end",
    b"",
])
def test_the_field_added_is_what_a_parse_of_the_new_content_finds(content: bytes) -> None:
    """The added field is the header section's first, CRLF-terminated, and every byte of the
    message follows it unchanged; the fields and header end carried over equal what a fresh
    parse of the new content finds."""
    parsed = parse_message(content)
    added = parsed.with_field("Message-ID", "<q1@relay.test>")
    again = parse_message(added.content)
    assert (added.header_end, added.fields) == (again.header_end, again.fields)
    assert added.message_id == "<q1@relay.test>" and added.fields[0].name == b"message-id"
    line = b"Message-ID: <q1@relay.test>\r\n"
    assert added.content.count(line) == 1
    assert added.content.replace(line, b"", 1) == content
    assert [f.name for f in added.fields[1:]] == [f.name for f in parsed.fields]


def _ids(content: bytes) -> list[bytes]:
    return re.findall(rb"(?im)^message-id:[ \t]*(.*?)\r$", content)


async def test_a_message_without_one_gets_one_recorded_in_the_ledger(
        make_relay: MakeRelay, sink: Sink, ledger_url: str) -> None:
    """No Message-ID: the smarthost gets exactly one, <QUEUE-ID@hostname>, the queue id the
    ledger row names, and the row records it; the message follows it byte for byte."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url)
    got = await send(relay.port, [RCPT], message(key="K-noid"))
    assert got.code == 250, got
    [delivered] = sink.handler.delivered
    [added] = _ids(delivered.content)
    assert delivered.content.endswith(b"Message-ID: " + added + b"\r\n" + message(key="K-noid"))
    [row] = await wait_ledger_rows(ledger_url, 1)
    assert added.decode() == f"<{row['queue_id']}@relay.test>" == row["message_id"]
    assert re.fullmatch(r"<[0-9a-f]{12}@relay\.test>", row["message_id"])


async def test_a_message_with_one_goes_byte_for_byte(make_relay: MakeRelay,
                                                     sink: Sink) -> None:
    """A Message-ID given (even oddly written): nothing added, the content after the relay's
    trace header exactly as sent."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    sent = message(key="K-id", extra="mEsSaGe-Id:   <app-1@app.test>  \r\n")
    assert (await send(relay.port, [RCPT], sent)).code == 250
    [delivered] = sink.handler.delivered
    assert delivered.content.endswith(sent) and len(_ids(delivered.content)) == 1


async def test_off_adds_none(make_relay: MakeRelay, sink: Sink) -> None:
    """add_message_id off: a message without one goes without one."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", add_message_id=False)
    sent = message(key="K-off")
    assert (await send(relay.port, [RCPT], sent)).code == 250
    [delivered] = sink.handler.delivered
    assert _ids(delivered.content) == [] and delivered.content.endswith(sent)
