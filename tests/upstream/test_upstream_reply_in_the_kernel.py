"""A reply to the final dot that reached the host before the deadline is read, even when the
relay's event loop was held up past the deadline and had not read it yet.

A worker starved of CPU (or busy with other work) meets the deadline of its wait for the final
reply and the reply's arrival in one wake-up. uvloop runs the expired timer before it polls the
sockets, so a relay that judges by its timer alone declares the outcome unknown (the client is
answered ``451 ... in doubt``) for a message the upstream answered ``250`` in time. The peer
here runs on a thread of its own, so holding the relay's loop does not hold it: it takes the
message, has the relay's loop held for longer than the relay's 1 s wait, and answers ``250``
while it is.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from relay.core.interfaces import DeliveryProgress, OutboundMessage, RcptStatus
from relay.upstream.smtp import SmtpUpstream, SmtpUpstreamConfig
from tests.support.peers import ScriptedPeer, serve_peer

pytestmark = pytest.mark.both_loops  # asyncio's loop and uvloop's (tests/conftest.py)

FINAL_TIMEOUT_S = 1.0
ARMED_S = 0.3  # after the dot, before the hold: the relay's wait for the reply has begun
HOLD_S = 2.5  # the relay's loop held this long: past the 1 s wait's deadline
REPLY_AFTER_S = 0.3  # into the hold, the peer answers


@dataclass(kw_only=True)
class AnsweringDuringHold(ScriptedPeer):
    """A peer that takes the message, calls ``hold`` (which holds the relay's loop) ARMED_S
    later, and answers ``250`` REPLY_AFTER_S after that; ``answered_at`` is when
    (``time.monotonic``)."""

    hold: Callable[[], None]
    answered_at: float = 0.0

    async def on_data(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"354 go ahead\r\n")
        await writer.drain()
        if not await self.read_to_dot(reader):
            return False
        await asyncio.sleep(ARMED_S)
        self.hold()
        await asyncio.sleep(REPLY_AFTER_S)
        writer.write(b"250 2.0.0 queued\r\n")
        await writer.drain()
        self.answered_at = time.monotonic()
        return True


@contextmanager
def peer_on_a_thread(hold: Callable[[], None]) -> Iterator[AnsweringDuringHold]:
    """Serve an AnsweringDuringHold on 127.0.0.1 from a thread with its own event loop."""
    peer = AnsweringDuringHold(hold=hold)
    ready = threading.Event()
    stopping: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def serve() -> None:
        stop = asyncio.Event()
        stopping.append((asyncio.get_running_loop(), stop))
        async with serve_peer(peer):
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the peer did not start"
    try:
        yield peer
    finally:
        for loop, stop in stopping:
            loop.call_soon_threadsafe(stop.set)
        thread.join(30)


async def test_a_reply_that_arrived_while_the_loop_was_held_is_read() -> None:
    """The loop held 2.5 s from before the reply's arrival to past the 1 s deadline: the
    delivery returns the 250 (accepted, dot written), not an unknown outcome."""
    loop = asyncio.get_running_loop()
    wake, poke = socket.socketpair()
    held: list[float] = []

    def hold_the_loop() -> None:  # an I/O callback of the relay's loop: it polled, then held
        wake.recv(1)
        held.append(time.monotonic())
        time.sleep(HOLD_S)

    loop.add_reader(wake.fileno(), hold_the_loop)
    try:
        with peer_on_a_thread(lambda: poke.sendall(b"x")) as peer:
            upstream = SmtpUpstream(config=SmtpUpstreamConfig(
                host="127.0.0.1", port=peer.port, local_hostname="relay.test", pool_size=0,
                command_timeout_s=10.0, final_timeout_s=FINAL_TIMEOUT_S))

            async def before_dot(_accepted: Sequence[str]) -> bool:
                return True

            progress = DeliveryProgress(before_dot=before_dot)
            try:
                result = await asyncio.wait_for(upstream.deliver(OutboundMessage(
                    mail_from="a@example.com", rcpt_tos=["b@example.net"],
                    content=b"Subject: held\r\n\r\nbody\r\n"), progress), 60)
            finally:
                await upstream.close()
    finally:
        loop.remove_reader(wake.fileno())
        wake.close()
        poke.close()
    assert held and peer.answered_at, "the loop was never held, or the peer never answered"
    assert held[0] < peer.answered_at < held[0] + HOLD_S  # the reply came during the hold
    [outcome] = result.recipients.values()
    assert outcome.status is RcptStatus.ACCEPTED, outcome
    assert progress.dot_written
