"""The moment the final dot is handed over (relay.upstream.transfer.Transfer's ``on_dot``):
as the dot goes to the transport, before the transport flushed it, so that a shutdown cut in
between waits for the upstream's reply instead of settling a leaving dot as one that never
went (the transaction was then marked in doubt although the smarthost took the message).

The transport here is a stand-in that holds every write until the test drains it: the window
between handing the dot over and the loop flushing it (uvloop flushes at the end of its loop
turn; asyncio when the socket is writable) is a scheduling moment that no real peer opens on
demand.
"""

from __future__ import annotations

import asyncio
from typing import Any

from relay.upstream.transfer import DOT, Outcome, Transfer


class HeldTransport:
    """A transport that keeps what is written until :meth:`drain` (``flushed`` gets it)."""

    def __init__(self) -> None:
        self.held = bytearray()
        self.flushed = bytearray()
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.held += data

    def get_write_buffer_size(self) -> int:
        return len(self.held)

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket: the kernel's queues cannot be asked

    def drain(self) -> None:
        self.flushed += self.held
        self.held.clear()


async def test_the_dot_counts_as_handed_over_before_the_transport_flushed_it() -> None:
    """``on_dot`` runs once, as the dot is written while the transport still holds it; the
    transfer is sent only once it is flushed."""
    transport, handed, handing = HeldTransport(), [], asyncio.Event()

    def on_dot() -> None:
        handed.append(transport.get_write_buffer_size())
        handing.set()

    payload = b"Subject: x\r\n\r\nbody\r\n" + DOT
    transfer = Transfer(transport, payload, stall_timeout_s=30.0, on_dot=on_dot)
    reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    running = asyncio.ensure_future(transfer.run(reply))
    await asyncio.wait_for(handing.wait(), 30)
    assert handed == [len(payload)]  # handed over, none of it flushed yet
    assert not transfer.complete and not running.done()
    transport.drain()
    assert await asyncio.wait_for(running, 30) is Outcome.SENT
    assert handed == [len(payload)] and bytes(transport.flushed) == payload


async def test_a_dot_held_back_by_its_gate_is_never_handed_over() -> None:
    """A gate (the SENDING mark) that says no ends the transfer withheld: ``on_dot`` never
    runs and the dot is not written."""
    transport, handed = HeldTransport(), []
    payload = b"Subject: x\r\n\r\nbody\r\n" + DOT
    transfer = Transfer(transport, payload, stall_timeout_s=30.0,
                        on_dot=lambda: handed.append(True))
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[None] = loop.create_future()
    gate: asyncio.Future[bool] = loop.create_future()
    running = asyncio.ensure_future(transfer.run(reply, lambda: gate))
    await asyncio.sleep(0.05)
    transport.drain()
    gate.set_result(False)
    assert await asyncio.wait_for(running, 30) is Outcome.WITHHELD
    assert handed == [] and not bytes(transport.flushed).endswith(DOT)
