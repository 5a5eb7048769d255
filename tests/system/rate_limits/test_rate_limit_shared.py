"""Rate limits shared through Redis (design.md §4.7): two relay processes on one Redis prefix
with a ``[[rate_limit]]`` of N per window deliver at most N in that window between them.
Relay B runs under libfaketime with its wall clock an hour ahead: the window is the Redis
server's, not a relay's."""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from pathlib import Path

import pytest

from bench.faultbench.lib import _libfaketime
from tests.support.clients import message, send
from tests.support.relays import REDIS_URL, delete_prefix, start_serve
from tests.support.sink import Sink

pytestmark = pytest.mark.skipif(shutil.which("faketime") is None,
                                reason="needs faketime (Debian package faketime)")

LIMIT, WINDOW_S = 5, 10


@pytest.mark.timeout(60)
async def test_two_relays_on_one_redis_deliver_at_most_the_limit_between_them(
        tmp_path: Path, sink: Sink) -> None:
    prefix = f"test:rl-shared:{time.monotonic_ns()}:"
    config = tmp_path / "relay.toml"
    config.write_text(
        f'upstream = "127.0.0.1:{sink.port}"\nstore = "{REDIS_URL}"\n'
        f'store_prefix = "{prefix}"\nmetrics_listen = "127.0.0.1:0"\n'
        f'[[rate_limit]]\nscope = "upstream"\nmessages = {LIMIT}\nper = {WINDOW_S}\n'
        'name = "smarthost-quota"\n')
    skewed = {"LD_PRELOAD": _libfaketime(), "FAKETIME": "+3600s",
              "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}
    relays = await asyncio.gather(
        start_serve(tmp_path, "--config", str(config), workers=2),
        start_serve(tmp_path, "--config", str(config), workers=1, env=skewed))
    try:
        started = time.monotonic()
        replies = []
        for n in range(4 * LIMIT):  # in turn to each relay (and each worker of the first)
            replies.append(await send(relays[n % 2].port, [f"user{n}@example.net"],
                                      message(key=f"RL-{n}")))
        elapsed = time.monotonic() - started
        assert elapsed < WINDOW_S  # every message was sent within one window
        accepted = [r for r in replies if r.code == 250]
        refused = [r for r in replies if r.code != 250]
        assert len(accepted) == LIMIT, [(r.code, r.text) for r in replies]
        assert len(sink.handler.delivered) == LIMIT
        for reply in refused:
            assert reply.code == 451
            assert re.match(r"4\.7\.0 rate limit smarthost-quota reached: try again in \d+ s",
                            reply.text), reply.text
        # both relays refused some: the count is shared, not per process
        assert {n % 2 for n, r in enumerate(replies) if r.code == 451} == {0, 1}
    finally:
        await asyncio.gather(*(asyncio.to_thread(relay.stop) for relay in relays))
        delete_prefix(REDIS_URL, prefix)
