"""An operator's mark-sent and a relay's retry of the same in-doubt message at once, on Redis,
SQLite and PostgreSQL: the operator reads the record (UNKNOWN), a real relay with
``unknown_policy = send`` takes the key over and is waiting for the smarthost's reply to its
final dot (SENDING), then the operator's write comes. It must be refused (compare-and-set),
leaving the retry's record to settle as SENT with the smarthost's own reply.

The operator runs :func:`relay.admin.mark_sent` (what the console and ``dedup-relay
mark-sent`` run) on a store connection of its own, paused between its read and its write
until the retry's SENDING record is in the store.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from relay.admin import FingerprintInput, key_for, mark_sent
from relay.app import Relay
from relay.core.interfaces import FingerprintStore, Record, Settle, SettleOp, State
from tests.support.clients import message, send
from tests.support.postgres import private_schema
from tests.support.relays import REDIS_URL, MakeRelay
from tests.support.sink import Sink

RCPT = "user@example.net"


@pytest.fixture(params=["redis", "sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Each store in turn: the shared Redis (the relay's own prefix), a SQLite file, a
    private PostgreSQL schema."""
    if request.param == "postgres":
        with private_schema() as url:
            yield url
        return
    yield REDIS_URL if request.param == "redis" else f"sqlite:///{tmp_path / 'store.db'}"


class LooksThenWaits:
    """The operator's store: its ``inspect`` answers, then holds the answer until ``go`` is
    set (the operator read the record, and acts only after the retry took the key)."""

    def __init__(self, store: FingerprintStore) -> None:
        self._store = store
        self.looked = asyncio.Event()
        self.go = asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def inspect(self, key: str) -> Record:
        record = await self._store.inspect(key)
        self.looked.set()
        await self.go.wait()
        return record


async def _until_sending(store: FingerprintStore, key: str, within_s: float) -> Record:
    """The record under ``key`` once it is SENDING (polled up to ``within_s`` seconds)."""
    deadline = time.monotonic() + within_s
    while True:
        record = await store.inspect(key)
        if record.state is State.SENDING or time.monotonic() > deadline:
            return record
        await asyncio.sleep(0.02)


async def test_an_operators_mark_sent_leaves_a_live_retrys_record_alone(
        make_relay: MakeRelay, sink: Sink, store_url: str) -> None:
    """The mark-sent answers "not marked"; the client's retry is relayed once and its record
    ends SENT with the smarthost's reply, not the operator's."""
    relay: Relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=store_url,
                                    unknown_policy="send")
    settings = relay.settings
    _, key = key_for(settings, FingerprintInput(rcpt=RCPT, templates=["welcome"],
                                                keys=["ORDER-1"]))
    store = await settings.open_store(window_s=settings.dedup_window)
    try:
        crashed = uuid.uuid4().hex  # an earlier attempt whose smarthost never answered
        await store.reserve([key], token=crashed, lease_s=30)
        assert await store.settle([SettleOp(key, Settle.UNKNOWN)], token=crashed,
                                  window_s=3600) == [True]
        operator = LooksThenWaits(store)
        marking = asyncio.ensure_future(mark_sent(
            cast(FingerprintStore, operator), key, reason="smarthost log shows it delivered",
            lease_s=settings.lease, window_s=settings.dedup_window, operator="ops"))
        await asyncio.wait_for(operator.looked.wait(), 10)
        sink.handler.hang_after_dot_s = 1.5  # the retry waits for its final reply
        retry = asyncio.ensure_future(send(relay.port, [RCPT], message(key="ORDER-1")))
        sending = await _until_sending(store, key, within_s=10)
        assert sending.state is State.SENDING, sending
        operator.go.set()
        done = await asyncio.wait_for(marking, 10)
        result = await asyncio.wait_for(retry, 20)
        after = await store.inspect(key)
    finally:
        await store.close()
    assert result.code == 250 and "relayed 1" in result.text, result
    assert sink.handler.copies_to(RCPT) == 1
    assert after.state is State.SENT, after
    assert not (after.reply or "").startswith("marked sent by an operator"), after
    before, marked = done
    assert before.state is State.UNKNOWN and not marked
