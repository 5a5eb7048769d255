"""The event loop `serve` runs on (relay.supervision.loop.run_loop): uvloop when it imports,
asyncio's when it does not (or relay.supervision.loop.USE_UVLOOP is off)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from relay.core.errors import StartupError
from relay.settings import Settings
from relay.supervision.loop import USE_UVLOOP, loop_factory, run_loop, run_loop_for
from tests.support.net import free_port


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


def _settings(event_loop: str) -> Settings:
    return Settings.model_validate({"upstream": "127.0.0.1:25", "event_loop": event_loop})


def test_event_loop_setting_picks_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """event_loop = asyncio runs on asyncio's loop although uvloop imports; auto and uvloop
    run on uvloop."""
    pytest.importorskip("uvloop")
    assert run_loop_for(_settings("asyncio"), _loop_module()).startswith("asyncio")
    assert run_loop_for(_settings("auto"), _loop_module()).startswith("uvloop")
    assert run_loop_for(_settings("uvloop"), _loop_module()).startswith("uvloop")


def test_event_loop_uvloop_without_uvloop_refuses_to_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """event_loop = uvloop where uvloop does not import: a start error (exit 69), not a silent
    fallback; auto falls back to asyncio's loop."""
    monkeypatch.setitem(sys.modules, "uvloop", None)
    coro = _loop_module()
    with pytest.raises(StartupError, match="uvloop does not import"):
        run_loop_for(_settings("uvloop"), coro)
    assert run_loop_for(_settings("auto"), _loop_module()).startswith("asyncio")


def test_serve_flag_event_loop_asyncio_serves_on_asyncio(tmp_path: Path) -> None:
    """`serve --event-loop asyncio --workers 1` serves a message with asyncio's loop: uvloop's
    module is never loaded into the process."""
    pytest.importorskip("uvloop")
    code = (
        "import sys, runpy, threading, os, time\n"
        "from relay.cli.group import main\n"
        "import socket\n"
        "port = int(sys.argv[2])\n"
        "def check():\n"  # once the listener answers, the loop runs
        "    deadline = time.monotonic() + 20\n"
        "    while time.monotonic() < deadline:\n"
        "        try:\n"
        "            socket.create_connection(('127.0.0.1', port), 1).close()\n"
        "            break\n"
        "        except OSError:\n"
        "            time.sleep(0.05)\n"
        "    print('UVLOOP' if 'uvloop.loop' in sys.modules else 'ASYNCIO', flush=True)\n"
        "    os._exit(0)\n"
        "threading.Thread(target=check, daemon=True).start()\n"
        "sys.argv = ['dedup-relay', 'serve', '--listen', f'127.0.0.1:{port}',\n"
        "            '--upstream',\n"
        "            'maildir:" + str(tmp_path / "md") + "', '--metrics-listen', 'off',\n"
        "            '--store', 'sqlite:///" + str(tmp_path / "d.db") + "', '--workers', '1',\n"
        "            '--settle-journal', '', '--event-loop', sys.argv[1]]\n"
        "main()\n")
    for loop, want in (("asyncio", "ASYNCIO"), ("uvloop", "UVLOOP")):
        out = subprocess.run([sys.executable, "-c", code, loop, str(free_port())],
                             capture_output=True,
                             text=True, timeout=30, cwd=tmp_path)
        assert want in out.stdout, (loop, out.stdout, out.stderr[-2000:])
