"""A shutdown cut that lands after the upstream's reply to the final dot was read keeps that reply.

The upstream is the aiosmtpd sink on loopback, and the transaction has a SENDING hook (as under
the dedup core). A watcher cancels the delivery (as the relay's shutdown past its grace does) at
the first point the delivery waits once ``SmtpUpstream._data`` holds the outcome, the sink's
250 already read: the delivery must still return that 250. Raising the cancellation instead
makes the core settle the key UNKNOWN and answer the client as in doubt, for a message the
upstream took (a resend under ``unknown_policy = send`` would then be a duplicate).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from relay.core.interfaces import DeliveryProgress, OutboundMessage, RcptStatus
from relay.upstream.smtp import SmtpUpstream, SmtpUpstreamConfig
from tests.support.sink import Sink

pytestmark = pytest.mark.both_loops  # asyncio's loop and uvloop's (tests/conftest.py)


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
    upstream = SmtpUpstream(config=SmtpUpstreamConfig(
        host="127.0.0.1", port=sink.port, local_hostname="relay.test", pool_size=0))

    async def before_dot(_accepted: Sequence[str]) -> bool:
        return True

    progress = DeliveryProgress(before_dot=before_dot)
    delivery = asyncio.ensure_future(upstream.deliver(OutboundMessage(
        mail_from="a@example.com", rcpt_tos=["b@example.net"],
        content=b"Subject: cut\r\n\r\nbody\r\n"), progress))
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
