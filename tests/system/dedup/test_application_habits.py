"""What applications send as they are, through a real relay (the Redis store and a SQLite file)
to a real aiosmtpd smarthost over loopback, with Python's smtplib as the application:

- ``sendmail(from, to, msg.as_bytes())``: the message in LF line ends (smtplib converts line
  ends only for a ``str``), relayed once with CRLF under ``bare_newline = normalize``, its
  retry (in LF or in CRLF) suppressed: the fingerprint reads the header section as CRLF;
- a thousand recipients in one transaction to a smarthost that takes fifty per transaction
  (``452 4.5.3`` past them): every recipient delivered once, in further upstream
  transactions of the same message, and nothing refused to the application;
- recipients past ``max_recipients`` (``452 4.5.3``) are not idle commands: the session goes
  on to DATA.
"""

from __future__ import annotations

import asyncio
import smtplib
from collections.abc import Iterator
from email.message import EmailMessage
from email.policy import SMTP as SMTP_POLICY
from pathlib import Path

import pytest

from relay.app import Relay
from relay.core import replies
from relay.core.interfaces import State
from tests.support.relays import REDIS_URL, MakeRelay
from tests.support.sink import Sink
from tests.support.wire import codes, ehlo, state_of

SENDER = "app@example.com"


@pytest.fixture(params=["redis", "sqlite"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The shared Redis (the relay's own prefix), then a SQLite file."""
    yield REDIS_URL if request.param == "redis" else f"sqlite:///{tmp_path / 'store.db'}"


def application_message(to: str, key: str) -> EmailMessage:
    """An application's notice with its dedupe headers."""
    message = EmailMessage()
    message["From"] = SENDER
    message["To"] = to
    message["Subject"] = "Your invoice"
    message["X-Template"] = "invoice"
    message["X-Dedupe-Key"] = key
    message.set_content("Dear customer,\n\nyour invoice is attached.\n.\n..\nRegards\n")
    return message


def smtplib_sendmail(port: int, rcpts: list[str], data: bytes) -> dict[str, tuple[int, bytes]]:
    """``smtplib.SMTP.sendmail`` as an application calls it (in a thread: it blocks); returns
    the recipients it reports refused. Raises what smtplib raises."""
    with smtplib.SMTP("127.0.0.1", port, local_hostname="app.example.com", timeout=120) as smtp:
        return smtp.sendmail(SENDER, rcpts, data)


async def test_smtplib_bytes_in_lf_are_relayed_once_in_crlf_and_the_retry_suppressed(
        make_relay: MakeRelay, sink: Sink, store_url: str) -> None:
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=store_url)
    message = application_message("customer@example.net", "INV-2024-001")
    lf_bytes = message.as_bytes()
    assert b"\n" in lf_bytes and b"\r\n" not in lf_bytes
    for data in (lf_bytes, lf_bytes, message.as_bytes(policy=SMTP_POLICY)):
        refused = await asyncio.to_thread(
            smtplib_sendmail, relay.port, ["customer@example.net"], data)
        assert refused == {}
    [delivered] = sink.handler.delivered
    content = delivered.content
    assert content.count(b"\n") == content.count(b"\r\n")  # no bare LF upstream
    # smtplib ends data that does not end in CRLF with one: after "\n", an empty line
    assert content.endswith(message.as_bytes(policy=SMTP_POLICY) + b"\r\n")
    assert b"\r\n.\r\n..\r\nRegards\r\n" in content  # the stuffed lines, as the application wrote
    assert await state_of(relay, "customer@example.net", "invoice", "INV-2024-001") is State.SENT


async def test_a_thousand_recipients_reach_a_smarthost_that_takes_fifty_per_transaction(
        make_relay: MakeRelay, sink: Sink, store_url: str) -> None:
    # one reserve of 1,000 keys: on a loaded runner it outlasted the default 2 s store timeout
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=store_url,
                             upstream_timeout=60.0, store_timeout=10.0)
    sink.handler.rcpt_limit = 50
    rcpts = [f"member{n:04d}@example.net" for n in range(1000)]
    data = application_message("undisclosed-recipients:;", "NEWS-2024-10").as_bytes()
    refused = await asyncio.to_thread(smtplib_sendmail, relay.port, rcpts, data)
    assert refused == {}
    assert sink.handler.transactions == 20
    assert all(len(d.rcpt_tos) == 50 for d in sink.handler.delivered)
    assert sorted(r for d in sink.handler.delivered for r in d.rcpt_tos) == rcpts
    assert {await state_of(relay, r, "invoice", "NEWS-2024-10") for r in rcpts} == {State.SENT}
    again = await asyncio.to_thread(smtplib_sendmail, relay.port, rcpts, data)
    assert again == {}
    assert sink.handler.transactions == 20  # the retry is suppressed, recipient by recipient


async def test_recipients_past_the_limit_are_not_idle_commands(
        make_relay: MakeRelay, sink: Sink) -> None:
    """max_recipients 5 and max_idle_commands 3: twenty RCPTs get five 250s and fifteen
    ``452 4.5.3``, and the message still goes, to the five."""
    relay: Relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_recipients=5,
                                    max_idle_commands=3)
    client, _ = await ehlo(relay.port)
    rcpts = [f"r{n}@example.net" for n in range(20)]
    got = [await client.cmd(f"MAIL FROM:<{SENDER}>")]
    got += [await client.cmd(f"RCPT TO:<{r}>") for r in rcpts]
    got.append(await client.cmd("DATA"))
    await client.write(b"X-Template: t\r\nX-Dedupe-Key: K-1\r\n\r\nhello\r\n.\r\n")
    got.append(await client.reply())
    await client.close()
    assert got[6:21] == [str(replies.TOO_MANY_RECIPIENTS)] * 15
    assert codes(got) == [250] * 6 + [452] * 15 + [354, 250]
    assert [d.rcpt_tos for d in sink.handler.delivered] == [rcpts[:5]]
