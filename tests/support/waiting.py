"""Waiting for an event instead of for a fixed time."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable


async def until(check: Callable[[], bool | Awaitable[bool]], within_s: float = 10.0,
                what: str = "the awaited event") -> None:
    """Poll ``check()`` (plain or async) every 10 ms until it is true; fail the test with
    ``what`` if it is still false after ``within_s`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert loop.time() < deadline, f"{what} did not happen within {within_s:g} s"
        await asyncio.sleep(0.01)
