"""A rate-limit call that shutdown cancels while its script or statement is on its way gives
its units back, as a timed-out one does: its message is answered 4yz and never sent (a private
redis-server behind a proxy that holds its replies, a PostgreSQL bucket lock held elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import pytest

from relay.core.interfaces import LimitCheck
from relay.store.postgres.limits import bucket_name
from relay.store.postgres.migrations import RATE_LOCK_SPACE
from relay.store.postgres.store import PostgresStore
from relay.store.redis.store import RedisStore
from tests.support.net import free_port
from tests.support.pg_proxy import PgProxy
from tests.support.postgres import private_schema
from tests.support.relays import PrivateRedis

PREFIX = "t:"


def one_per_minute(name: str) -> LimitCheck:
    return LimitCheck(label=name, kind="messages", bucket=f"{name}:m:upstream:x", limit=1,
                      per_s=60.0, cost=1)


async def test_a_cancelled_redis_call_gives_its_unit_back() -> None:
    """The call's script runs and takes the unit, but its reply is held on the way (a proxy);
    the call is cancelled meanwhile; the give-back returns the unit: the next call, straight
    to the server, is allowed."""
    server = PrivateRedis(port=free_port())
    server.start()
    proxy = PgProxy("127.0.0.1", server.port)
    await proxy.start()
    through = RedisStore.from_url(f"redis://127.0.0.1:{proxy.port}/0", op_timeout_s=3.0)
    direct = RedisStore.from_url(server.url, op_timeout_s=3.0)
    try:
        cut = one_per_minute("cut")
        # the server learns the script (EVALSHA then goes through at once)
        assert (await through.rate_limiter(PREFIX).acquire([one_per_minute("warm")])).allowed
        proxy.hold_replies()
        call = asyncio.create_task(through.rate_limiter(PREFIX).acquire([cut]))
        await asyncio.sleep(0.3)  # the script ran on the server; its reply waits in the proxy
        call.cancel()
        await asyncio.sleep(0.1)
        proxy.resume()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert (await direct.rate_limiter(PREFIX).acquire([cut])).allowed
    finally:
        await through.close()
        await direct.close()
        await proxy.close()
        server.stop()


async def test_a_cancelled_postgres_call_gives_its_unit_back() -> None:
    """The bucket's lock is held elsewhere; the call waiting for it is cancelled; once the
    lock is free, nothing stays counted: the next call (limit 1) is allowed."""
    with private_schema() as url:
        store = await PostgresStore.open(url, cleanup_interval_s=None, pool_size=2,
                                         op_timeout_s=6.0)
        holder = await asyncpg.connect(url)
        try:
            limiter = store.rate_limiter(PREFIX)
            cut = one_per_minute("cut")
            tx = holder.transaction()
            await tx.start()
            await holder.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))",
                                 RATE_LOCK_SPACE, bucket_name(PREFIX, cut))
            call = asyncio.create_task(limiter.acquire([cut]))
            await asyncio.sleep(0.4)
            call.cancel()
            await asyncio.sleep(0.2)
            await tx.rollback()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.sleep(0.3)
            assert (await limiter.acquire([cut])).allowed
        finally:
            with contextlib.suppress(asyncpg.PostgresError):
                await holder.close()
            await store.close()
