"""A shutdown cut that a reply swallowed still stops the transaction before its final dot.

aiosmtplib reads every reply through ``asyncio.wait_for``; on Python 3.11 that returns the
reply, and drops the cancellation, when both arrive in the same loop turn. The delivery then
went on as if never cut: DATA, the message and the final dot went out, and the core, which had
read "no dot yet" and settled the cut as a release, got nothing but an upstream that took the
message (or, with the dot counted, a record in doubt for a message that was delivered).

The upstream is the aiosmtpd sink on loopback. The cut is given at the moment the reply to a
chosen command reaches the client's protocol (its ``data_received``, wrapped): the one moment
a real shutdown cannot be made to hit on demand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiosmtplib.protocol
import pytest

from relay.core.cancellation import reply_past_cut
from relay.core.interfaces import DeliveryProgress, DeliveryResult, OutboundMessage
from relay.upstream.smtp import SmtpUpstream, SmtpUpstreamConfig
from tests.support.sink import Sink

pytestmark = pytest.mark.both_loops  # asyncio's loop and uvloop's (tests/conftest.py)


@pytest.mark.parametrize(("reply", "nth"), [(b"354", 1), (b"250 ", 2), (b"250 ", 3)],
                         ids=["DATA's 354", "MAIL's 250", "RCPT's 250"])
async def test_a_cut_arriving_with_a_reply_sends_no_dot(
        sink: Sink, monkeypatch: pytest.MonkeyPatch, reply: bytes, nth: int) -> None:
    """The delivery is cancelled as the ``nth`` reply starting with ``reply`` arrives (the
    EHLO's last line is the first ``250 ``): it ends cancelled, with no dot written and
    nothing delivered."""
    upstream = SmtpUpstream(config=SmtpUpstreamConfig(
        host="127.0.0.1", port=sink.port, local_hostname="relay.test", pool_size=0))
    seen: list[bytes] = []
    delivery: asyncio.Task[DeliveryResult] | None = None
    original = aiosmtplib.protocol.SMTPProtocol.data_received

    def data_received(self: aiosmtplib.protocol.SMTPProtocol, data: bytes) -> None:
        original(self, data)
        seen.extend(line for line in data.split(b"\r\n") if line.startswith(reply))
        if len(seen) == nth and delivery is not None and not delivery.done():
            delivery.cancel()  # the reply's wait_for wakes in the same turn

    monkeypatch.setattr(aiosmtplib.protocol.SMTPProtocol, "data_received", data_received)

    async def before_dot(_accepted: Sequence[str]) -> bool:
        return True

    progress = DeliveryProgress(before_dot=before_dot)
    delivery = asyncio.ensure_future(upstream.deliver(OutboundMessage(
        mail_from="a@example.com", rcpt_tos=["b@example.net"],
        content=b"Subject: cut\r\n\r\nbody\r\n"), progress))
    try:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(delivery), 30)
    finally:
        await upstream.close()
    assert len(seen) >= nth, seen
    assert not progress.dot_written
    await asyncio.sleep(0.2)  # a dot that left would reach the sink by now
    assert sink.handler.delivered == []


async def test_work_that_ends_with_a_result_after_the_cut_gives_that_result() -> None:
    """``reply_past_cut``: work that, cut before its dot, still ends with a result (it held
    the upstream's verdict when the cut came) gives that result, not "cut"."""
    started = asyncio.Event()

    async def work() -> str:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "250 taken"  # the verdict already read, as SmtpUpstream keeps it
        return "never"

    async def caller() -> str | None:
        return await reply_past_cut(asyncio.ensure_future(work()), lambda: False)

    cutting = asyncio.ensure_future(caller())
    await asyncio.wait_for(started.wait(), 30)
    cutting.cancel()
    assert await asyncio.wait_for(cutting, 30) == "250 taken"


async def test_work_that_stops_at_the_cut_gives_none() -> None:
    """``reply_past_cut``: work cut before its dot that stops gives None (settled as cut)."""
    started = asyncio.Event()

    async def work() -> str:
        started.set()
        await asyncio.sleep(30)
        return "never"

    async def caller() -> Any:
        return await reply_past_cut(asyncio.ensure_future(work()), lambda: False)

    cutting = asyncio.ensure_future(caller())
    await asyncio.wait_for(started.wait(), 30)
    cutting.cancel()
    assert await asyncio.wait_for(cutting, 30) is None
