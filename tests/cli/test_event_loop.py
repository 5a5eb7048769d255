"""The event loop `serve` runs on (relay.supervisor.run_loop): uvloop when it imports,
asyncio's when it does not (or relay.supervisor.USE_UVLOOP is off)."""

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


def test_serve_runs_on_uvloop_when_it_imports() -> None:
    """The default: uvloop, it being importable (a dependency)."""
    pytest.importorskip("uvloop")
    assert USE_UVLOOP is True
    assert run_loop(_loop_module()).startswith("uvloop")
