"""The event loop a relay process runs on (``event_loop``; design.md §8): uvloop when it is
wanted and imports, else asyncio's own. Used by ``serve`` (one process or the supervisor)
and by every worker."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from relay.core.errors import StartupError
from relay.settings import Settings

# uvloop when it imports (a dependency); the transports are duck-typed (the upstream
# transfer's checks and write backlog hold on both loops). False: asyncio's loop.
USE_UVLOOP = True


def loop_factory(*, uvloop_wanted: bool = USE_UVLOOP, required: bool = False) -> Any:
    """The event loop constructor: ``uvloop.new_event_loop`` when ``uvloop_wanted`` and uvloop
    imports, else None (asyncio's default loop). Raises
    :class:`relay.core.errors.StartupError` when ``required`` and uvloop does not import."""
    if not uvloop_wanted:
        return None
    try:
        import uvloop
    except ImportError as exc:
        if required:
            raise StartupError(f"event_loop = uvloop, but uvloop does not import ({exc})") from exc
        return None
    return uvloop.new_event_loop


def run_loop(main: Coroutine[Any, Any, Any], *, uvloop_wanted: bool = USE_UVLOOP,
             required: bool = False) -> Any:
    """Run ``main`` to its end on a new event loop from :func:`loop_factory`; its result.
    Raises StartupError as :func:`loop_factory` does (``main`` is closed, never run)."""
    try:
        factory = loop_factory(uvloop_wanted=uvloop_wanted, required=required)
    except StartupError:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def run_loop_for(settings: Settings, main: Coroutine[Any, Any, Any]) -> Any:
    """:func:`run_loop` on the loop ``settings.event_loop`` names (auto: uvloop when it
    imports). Raises StartupError for ``uvloop`` without uvloop."""
    return run_loop(main, uvloop_wanted=settings.event_loop != "asyncio",
                    required=settings.event_loop == "uvloop")
