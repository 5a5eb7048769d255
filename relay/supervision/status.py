"""A worker's status pipe: the lines a worker writes to its supervisor (:class:`StatusWriter`)
and the supervisor's reader of them (:func:`follow_status`), one line each:

- ``serving``: the worker serves its inherited sockets;
- ``reloaded`` / ``reload failed``: it applied a configuration reload, or could not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from relay.supervision.slots import WorkerSlot

SERVING = b"serving"
RELOADED = b"reloaded"
RELOAD_FAILED = b"reload failed"


class StatusWriter:
    """The worker's end of its status pipe (file descriptor ``fd``). A supervisor gone (the
    pipe closed) loses the line, silently: the worker dies with it anyway."""

    def __init__(self, fd: int) -> None:
        self._pipe = os.fdopen(fd, "wb", buffering=0)

    def _write(self, status: bytes) -> None:
        with contextlib.suppress(OSError):
            self._pipe.write(status + b"\n")

    def serving(self, _relay: object = None) -> None:
        """Say the worker serves (``_relay``: the relay that does, unused)."""
        self._write(SERVING)

    def confirm(self, applied: bool) -> None:
        """Say whether the worker applied the configuration reload."""
        self._write(RELOADED if applied else RELOAD_FAILED)

    def close(self) -> None:
        """Close the pipe (a worker's ends with its process)."""
        self._pipe.close()


async def follow_status(slot: WorkerSlot, fd: int, confirmed: asyncio.Condition) -> None:
    """Follow ``slot``'s status pipe (the read end ``fd``, closed at the end) until its process
    exits: ``serving`` marks the slot serving; ``reloaded`` / ``reload failed`` count a
    confirmed reload in the slot and notify ``confirmed``'s waiters."""
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
    try:
        while line := await reader.readline():
            status = line.strip()
            if status == SERVING:
                slot.mark_serving()
            elif status in (RELOADED, RELOAD_FAILED):
                async with confirmed:
                    slot.reloads += 1
                    slot.reload_ok = status == RELOADED
                    confirmed.notify_all()
    finally:
        transport.close()
