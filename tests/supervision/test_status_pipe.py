"""A worker's status pipe (relay.supervision.status): what the worker writes, the supervisor's
slot reads."""

from __future__ import annotations

import asyncio
import functools
import os

from relay.supervision.slots import WorkerSlot
from relay.supervision.status import StatusWriter, follow_status


def _counted(slot: WorkerSlot, reloads: int) -> bool:
    return slot.reloads == reloads


async def test_the_slot_follows_what_its_worker_says() -> None:
    """``serving`` marks the slot serving; each reload confirmation is counted with whether it
    was applied; the reader ends when the worker's end closes."""
    read_end, write_end = os.pipe()
    slot, confirmed = WorkerSlot(2), asyncio.Condition()
    reader = asyncio.create_task(follow_status(slot, read_end, confirmed))
    writer = StatusWriter(write_end)
    try:
        writer.serving()
        await asyncio.wait_for(slot.served.wait(), 5)
        assert slot.serving
        for applied in (False, True):
            before = slot.reloads
            writer.confirm(applied)
            async with confirmed:
                await asyncio.wait_for(confirmed.wait_for(
                    functools.partial(_counted, slot, before + 1)), 5)
            assert slot.reload_ok is applied
    finally:
        writer.close()
    await asyncio.wait_for(reader, 5)


def test_a_worker_whose_supervisor_is_gone_loses_its_line_silently() -> None:
    """The pipe's reading end closed: saying ``serving`` raises nothing."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    writer = StatusWriter(write_end)
    writer.serving()
    writer.close()
