"""Rate limits (design.md §4.7) on the PostgreSQL store, as real `serve` processes: two relays on
one database (one with two workers, one under libfaketime with its wall clock an hour ahead)
with a ``[[rate_limit]]`` of N per window deliver at most N in that window between them, and both
refuse some: the count is the database's, shared, on the database's clock.

The server is ``RELAY_TEST_POSTGRES_URL``'s, in a private schema (tests/support/postgres.py).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from pathlib import Path

import pytest

from bench.faultbench.lib import _libfaketime
from tests.support.clients import message, send
from tests.support.postgres import private_schema
from tests.support.relays import start_serve
from tests.support.sink import Sink

pytestmark = pytest.mark.skipif(shutil.which("faketime") is None,
                                reason="needs faketime (Debian package faketime)")

LIMIT, WINDOW_S = 5, 20


@pytest.mark.timeout(60)
async def test_two_relays_on_one_postgres_deliver_at_most_the_limit_between_them(
        tmp_path: Path, sink: Sink) -> None:
    with private_schema() as url:
        config = tmp_path / "relay.toml"
        config.write_text(
            f'upstream = "127.0.0.1:{sink.port}"\nstore = "{url}"\n'
            'store_prefix = "rl-pg:"\nmetrics_listen = "127.0.0.1:0"\n'
            f'[[rate_limit]]\nscope = "upstream"\nmessages = {LIMIT}\nper = {WINDOW_S}\n'
            'name = "smarthost-quota"\n')
        skewed = {"LD_PRELOAD": _libfaketime(), "FAKETIME": "+3600s",
                  "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_NO_CACHE": "1"}
        relays = await asyncio.gather(
            start_serve(tmp_path, "--config", str(config), workers=2),
            start_serve(tmp_path, "--config", str(config), workers=1, env=skewed))
        try:
            started = time.monotonic()
            replies = [await send(relays[n % 2].port, [f"user{n}@example.net"],
                                  message(key=f"RL-PG-{n}")) for n in range(3 * LIMIT)]
            assert time.monotonic() - started < WINDOW_S  # all within one window
        finally:
            await asyncio.gather(*(asyncio.to_thread(relay.stop) for relay in relays))
    assert [r.code for r in replies].count(250) == LIMIT, [(r.code, r.text) for r in replies]
    assert len(sink.handler.delivered) == LIMIT
    for reply in (r for r in replies if r.code != 250):
        assert reply.code == 451, reply
        assert re.match(r"4\.7\.0 rate limit smarthost-quota reached: try again in \d+ s",
                        reply.text), reply.text
    # both relays refused some: the count is shared, not per process
    assert {n % 2 for n, r in enumerate(replies) if r.code == 451} == {0, 1}
