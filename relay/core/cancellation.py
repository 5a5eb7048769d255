"""Cancellation the relay answers for itself (shutdown past its grace; design.md §6.6).

A shutdown cuts what is left by cancelling its tasks. Some of that work must not stop half way:
a store write whose outcome the client's reply depends on, or an upstream reply already read.
These two helpers are the one place that takes such a cancellation back (``Task.uncancel``),
so that the task goes on to give the client a reply that says what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("relay.core.cancellation")

_T = TypeVar("_T")


def stop_if_asked() -> None:
    """Raise ``asyncio.CancelledError`` when the current task was asked to stop and the
    request was swallowed on the way: on Python 3.11 ``asyncio.wait_for`` returns a result that
    arrived in the same loop turn as the cancellation (aiosmtplib reads every reply so), and
    the task would go on as if never asked. Call it before a step that cannot be taken back
    (handing over a final dot). Raises only for a request not taken back
    (:func:`absorb_cancel`)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        raise asyncio.CancelledError


def absorb_cancel() -> None:
    """Take back one cancellation of the current task, which answers for it itself."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


async def run_to_end(work: asyncio.Future[_T]) -> _T:
    """``work``'s result, waited for even when the caller is cancelled meanwhile (shutdown past
    its grace): a store write whose outcome the client's reply depends on is never cut half
    way. The cancellation is absorbed, so the caller goes on to give the client its reply;
    ``work`` itself being cancelled is raised as usual."""
    while True:
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if work.cancelled() or asyncio.current_task() is None:
                raise
            absorb_cancel()
            log.warning("a store write that must complete was asked to stop: finishing it")


AFTER_DOT_WAIT_S = 5.0
"""Seconds a transaction whose final dot is on the wire waits for the upstream's reply once a
shutdown's grace is over (design.md §6.6): a refusal that comes a moment later then releases
the record instead of leaving it in doubt. The supervisor's and the systemd unit's stop bounds
count it."""


async def reply_past_cut(work: asyncio.Future[_T], dot_written: Callable[[], bool], *,
                         wait_s: float | None = None) -> _T | None:
    """``work``'s result (an upstream transaction). When the caller is cancelled meanwhile
    (shutdown past its grace) and ``dot_written()`` says the final dot went out, the
    cancellation is absorbed and ``work`` gets up to ``wait_s`` seconds (default
    :data:`AFTER_DOT_WAIT_S`, read at the call) more to bring the
    upstream's reply; otherwise, or past that, ``work`` is cancelled and None is returned
    (the caller settles the transaction as cut: in doubt when the dot was out), unless
    ``work`` ends with a result all the same (it took the upstream's verdict on the way out):
    that result is returned. An exception of ``work`` is raised."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        absorb_cancel()
    if wait_s is None:
        wait_s = AFTER_DOT_WAIT_S
    if dot_written() and wait_s > 0:
        log.warning("shutdown: waiting up to %g s for the reply to a final dot on the wire",
                    wait_s)
        try:
            done, _ = await asyncio.wait({work}, timeout=wait_s)
        except asyncio.CancelledError:  # cut a second time: no more waiting
            absorb_cancel()
            done = set()
            log.warning("shutdown: the wait for the reply to a final dot was cut again: "
                        "settled as a cut transaction")
        if done:
            return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await work
    return None

