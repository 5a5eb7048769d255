"""A shutdown cut in the middle of an upstream transaction (the relay's stop past its grace
cancels it) keeps what the wire says.

The upstream is the aiosmtpd sink on loopback and the transaction has a SENDING hook (as under
the dedup core). Two moments a real shutdown cannot be made to hit on demand are made here:

- **after the reply to the final dot was read**: a watcher cancels the delivery at the first
  point it waits once ``SmtpUpstream._data`` holds the outcome. The delivery must return that
  250: raising the cancellation instead makes the core settle the key UNKNOWN and answer the
  client as in doubt, for a message the upstream took;
- **with a reply**: aiosmtplib reads every reply through ``asyncio.wait_for``, which on Python
  3.11 returns the reply and drops the cancellation when both arrive in the same loop turn.
  The delivery then went on as if never cut: DATA, the message and the final dot went out
  after the core had read "no dot yet". The cut is given as the reply to a chosen command
  reaches the client's protocol (its ``data_received``, wrapped): no dot may follow.

``reply_past_cut`` (relay.core.cancellation), which the core wraps the delivery in, is tested
for its two endings: work that stops at the cut, work that ends with a verdict anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aiosmtplib.protocol
import pytest

from relay.core.cancellation import reply_past_cut
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    OutboundMessage,
    RcptStatus,
)
from relay.upstream.smtp import SmtpUpstream, SmtpUpstreamConfig
from tests.support.sink import Sink

pytestmark = pytest.mark.both_loops  # asyncio's loop and uvloop's (tests/conftest.py)


def _delivery(sink: Sink) -> tuple[SmtpUpstream, DeliveryProgress,
                                   asyncio.Task[DeliveryResult]]:
    """One message to the sink with a SENDING hook that says yes, started as a task."""
    upstream = SmtpUpstream(config=SmtpUpstreamConfig(
        host="127.0.0.1", port=sink.port, local_hostname="relay.test", pool_size=0))

    async def before_dot(_accepted: Sequence[str]) -> bool:
        return True

    progress = DeliveryProgress(before_dot=before_dot)
    delivery = asyncio.ensure_future(upstream.deliver(OutboundMessage(
        mail_from="a@example.com", rcpt_tos=["b@example.net"],
        content=b"Subject: cut\r\n\r\nbody\r\n"), progress))
    return upstream, progress, delivery


def _outcome_held(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` waits inside ``SmtpUpstream._data`` after its outcome is known (its
    chain of awaited coroutines walked: ``Task.get_stack`` gives the outermost frame only)."""
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is not None and frame.f_code.co_name == "_data" and "outcome" in frame.f_locals:
            return True
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return False


async def test_a_cut_after_the_final_reply_was_read_keeps_the_reply(sink: Sink) -> None:
    """Cancelled once the 250 is read: the delivery returns the 250, never the cancellation."""
    upstream, progress, delivery = _delivery(sink)
    cut = False
    while not delivery.done():
        if _outcome_held(delivery):
            cut = delivery.cancel()
            break
        await asyncio.sleep(0)
    try:
        result = await asyncio.wait_for(delivery, 30)
    except asyncio.CancelledError:
        pytest.fail(f"the 250 was read, then thrown away by a cut (cancelled: {cut})")
    finally:
        await upstream.close()
    [outcome] = result.recipients.values()
    assert outcome.status is RcptStatus.ACCEPTED, outcome
    assert progress.dot_written
    assert len(sink.handler.delivered) == 1


@pytest.mark.parametrize(("reply", "nth"), [(b"354", 1), (b"250 ", 2), (b"250 ", 3)],
                         ids=["DATA's 354", "MAIL's 250", "RCPT's 250"])
async def test_a_cut_arriving_with_a_reply_sends_no_dot(
        sink: Sink, monkeypatch: pytest.MonkeyPatch, reply: bytes, nth: int) -> None:
    """The delivery is cancelled as the ``nth`` reply starting with ``reply`` arrives (the
    EHLO's last line is the first ``250 ``): it ends cancelled, with no dot written and
    nothing delivered."""
    seen: list[bytes] = []
    watched: list[asyncio.Task[DeliveryResult]] = []
    original = aiosmtplib.protocol.SMTPProtocol.data_received

    def data_received(self: aiosmtplib.protocol.SMTPProtocol, data: bytes) -> None:
        original(self, data)
        seen.extend(line for line in data.split(b"\r\n") if line.startswith(reply))
        if len(seen) == nth and watched and not watched[0].done():
            watched[0].cancel()  # the reply's wait_for wakes in the same turn

    monkeypatch.setattr(aiosmtplib.protocol.SMTPProtocol, "data_received", data_received)
    upstream, progress, delivery = _delivery(sink)
    watched.append(delivery)
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
