"""The event loop `serve` runs on (relay.supervisor.run_loop): asyncio's when uvloop is not
importable or not wanted; uvloop only on request (relay.supervisor.USE_UVLOOP says why)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from relay.supervisor import USE_UVLOOP, loop_factory, run_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_without_uvloop_the_loop_is_asyncios(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop not importable: the factory is asyncio's default, and a coroutine runs on it."""
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert loop_factory(uvloop_wanted=True) is None
    assert run_loop(_loop_module(), uvloop_wanted=True).startswith("asyncio")


def test_uvloop_runs_the_loop_when_wanted() -> None:
    """uvloop importable and wanted: the loop is uvloop's."""
    pytest.importorskip("uvloop")
    assert run_loop(_loop_module(), uvloop_wanted=True).startswith("uvloop")


def test_serve_runs_on_asyncio_until_the_transports_are_loop_neutral() -> None:
    """The default stays asyncio's: on uvloop every upstream DATA fails (its transports are not
    asyncio.WriteTransport, which relay.upstream.smtp checks)."""
    assert USE_UVLOOP is False
    assert run_loop(_loop_module()).startswith("asyncio")
