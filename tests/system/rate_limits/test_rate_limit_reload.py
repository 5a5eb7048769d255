"""``[[rate_limit]]`` is reloaded on SIGHUP: a `serve` process with two workers,
started without limits, gets one from its rewritten config file; every worker applies it to
the next message, and the reload line names ``rate_limit`` as applied, not as needing a
restart."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.clients import message, send
from tests.support.relays import REDIS_URL, delete_prefix, start_serve
from tests.support.sink import Sink
from tests.support.waiting import until


@pytest.mark.timeout(60)
async def test_a_sighup_applies_new_rate_limits_in_every_worker(tmp_path: Path,
                                                               sink: Sink) -> None:
    prefix = f"test:rl-reload:{time.monotonic_ns()}:"
    config = tmp_path / "relay.toml"
    base = (f'upstream = "127.0.0.1:{sink.port}"\nstore = "{REDIS_URL}"\n'
            f'store_prefix = "{prefix}"\nmetrics_listen = "127.0.0.1:0"\n')
    config.write_text(base)
    relay = await start_serve(tmp_path, "--config", str(config), workers=2)
    try:
        for n in range(4):
            assert (await send(relay.port, ["u@example.net"], message(key=f"B-{n}"))).code == 250
        config.write_text(base + '[[rate_limit]]\nscope = "upstream"\nmessages = 2\nper = 30\n'
                                 'name = "reloaded"\n')
        os.kill(relay.proc.pid, signal.SIGHUP)

        def reload_lines() -> list[str]:
            return [str(e["message"]) for e in relay.lines()
                    if str(e.get("message", "")).startswith("configuration reload")
                    and "worker" not in e]

        await until(lambda: bool(reload_lines()), 15, "the reload line")
        [line] = reload_lines()
        assert line.startswith("configuration reloaded: applied rate_limit"), line
        assert "needs a restart: none" in line
        replies = [await send(relay.port, ["u@example.net"], message(key=f"A-{n}"))
                   for n in range(6)]  # several connections: both workers take some
        assert [r.code for r in replies].count(250) == 2, replies
        assert all("rate limit reloaded reached" in r.text for r in replies if r.code != 250)
        assert len(sink.handler.delivered) == 6
    finally:
        await asyncio.to_thread(relay.stop)
        delete_prefix(REDIS_URL, prefix)
