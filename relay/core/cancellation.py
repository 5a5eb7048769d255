"""Cancellation the relay answers for itself (shutdown past its grace; issue 8 item 2).

A shutdown cuts what is left by cancelling its tasks. Some of that work must not stop half way:
a store write whose outcome the client's reply depends on, or an upstream reply already read.
These two helpers are the one place that takes such a cancellation back (``Task.uncancel``),
so that the task goes on to give the client a reply that says what happened.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

log = logging.getLogger("relay.core.cancellation")

_T = TypeVar("_T")


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
