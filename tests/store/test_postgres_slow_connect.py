"""A database whose connection set-up (TCP, TLS, SCRAM, the session's settings) takes longer than
the share of a call's bound the wait for a pooled connection may use is still reached: the
set-up is not cancelled and started over by each call, so a far database (about six round
trips of 130 ms) is not answered ``451 4.3.0`` forever while it answers.

The slow set-up is a TCP proxy in front of the shared server that waits before it connects a
new client through (the latency of a far database's handshake); calls on an open connection
are not slowed.
"""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from relay.core.errors import StoreError
from relay.store.postgres.store import PostgresStore
from tests.support.pg_proxy import PgProxy
from tests.support.postgres import private_schema

CONNECT_DELAY_S = 0.55
"""How long the proxy holds a new connection before it passes bytes on (seconds)."""
OP_TIMEOUT_S = 1.0
"""The store's bound of a call: a set-up (0.55 s) plus a statement fits in it."""


@pytest.fixture
def url() -> Iterator[str]:
    """A private schema with the store's tables."""
    with private_schema() as url:
        yield url


async def test_a_store_whose_connection_set_up_takes_half_the_bound_is_reached(
        url: str) -> None:
    """Connection set-up 0.55 s, store bound 1 s: of three calls in a row, at least the
    last must answer (the first may too, in about 0.6 s)."""
    parts = urlsplit(url)
    proxy = PgProxy(parts.hostname or "127.0.0.1", parts.port or 5432,
                    connect_delay_s=CONNECT_DELAY_S)
    await proxy.start()
    slow = proxy.url(url)
    store = await PostgresStore.open(slow, op_timeout_s=OP_TIMEOUT_S, check_schema=False,
                                     cleanup_interval_s=None)
    errors: list[str] = []
    try:
        for _ in range(3):
            try:
                await store.ping()
            except StoreError as exc:
                errors.append(str(exc))
                continue
            break
        assert len(errors) < 3, f"the store was never reached: {errors}"
    finally:
        await store.close()
        await proxy.close()
