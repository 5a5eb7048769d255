"""The Redis store reads replies with hiredis (a dependency: redis-py picks it up), and the
whole store contract holds with redis-py's pure-Python parser too (a host where hiredis is
missing or broken)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis.asyncio
from redis._parsers import _AsyncHiredisParser

from relay.store.redis.clients import open_client
from relay.store.redis.store import RedisStore

REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ROOT = Path(__file__).resolve().parents[2]


async def test_the_store_reads_with_hiredis() -> None:
    """A connection of the store's client parses with hiredis."""
    store = RedisStore.from_url(REDIS_URL)
    try:
        await store.ping()
        client = store._client
        assert isinstance(client, redis.asyncio.Redis)
        conn = await client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            assert isinstance(conn._parser, _AsyncHiredisParser), conn._parser
        finally:
            await client.connection_pool.release(conn)
    finally:
        await store.close()


def test_the_store_contract_holds_with_the_pure_python_parser() -> None:
    """tests/store/test_store_contract.py on the single server, RELAY_TEST_REDIS_PARSER=python
    (its fixture then builds the client with ``_AsyncRESP3Parser``, redis-py 8 speaking RESP3)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/store/test_store_contract.py", "-k", "redis and not cluster and not sentinel",
         "-W", "error"],
        cwd=ROOT, env={**os.environ, "RELAY_TEST_REDIS_PARSER": "python"},
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def test_one_server_has_no_socket_read_timeout_unless_the_url_sets_one() -> None:
    """The store's op timeout bounds every call; redis-py's own 5 s read timeout would cost a
    task (asyncio.wait_for) per write. A ``socket_timeout`` in the URL still applies."""
    for url, expected in ((REDIS_URL, None), (REDIS_URL + "?socket_timeout=3", 3.0)):
        client, _ = open_client(url, op_timeout_s=2.0)
        assert isinstance(client, redis.asyncio.Redis)
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == expected
        assert kwargs["socket_connect_timeout"] == 2.0
