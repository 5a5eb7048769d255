"""A fingerprint secret rotated (design.md §2.3) through the core, on a real Redis: a core
keyed with the old secret writes the records, one keyed with the new secret and the old as
``previous_secret`` reads them. A record under the previous key counts exactly as one under
the current key: sent, a duplicate; in flight, in flight (and waited for); in doubt, as
``unknown_policy`` says; of other content, as ``key_reuse`` says. A record under the current
key wins; nothing is left under the current key for a copy the previous record answered."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from uuid import uuid4

import pytest
from prometheus_client import CollectorRegistry

from relay.core.dedup import DedupCore, InboundMessage, Policy
from relay.core.errors import StoreError
from relay.core.interfaces import FingerprintStore, Record, Settle, SettleOp, SettleWatch, State
from relay.core.keys import derive_key, recipient_key
from relay.core.rules import UnknownPolicy
from relay.ops.metrics import PrometheusMetrics
from relay.ops.ports import StoreWrapper
from relay.store.redis.store import RedisStore
from tests.support.clients import message
from tests.support.metrics import sample
from tests.support.relays import REDIS_URL
from tests.support.scripted_upstream import USER, ScriptedUpstream

OLD, NEW = b"the secret before", b"the secret now"


@pytest.fixture
async def store() -> AsyncIterator[RedisStore]:
    opened = RedisStore.from_url(REDIS_URL)
    yield opened
    await opened.close()


def inbound(body: str = "Your receipt") -> InboundMessage:
    return InboundMessage(mail_from="shop@shop.example", rcpt_tos=[USER], queue_id="q",
                          content=message(key="order-7", template="receipt", body=body))


class Rotated:
    """A core before the rotation (the old secret) and one after it (the new secret, the old
    as the previous one), on one store and one upstream."""

    def __init__(self, store: FingerprintStore, prefix: str, **after: object) -> None:
        self.store = store
        self.upstream = ScriptedUpstream()
        self.registry = CollectorRegistry()
        self.before_policy = Policy(key_prefix=prefix, secret=OLD)
        self.after_policy = Policy(key_prefix=prefix, secret=NEW, previous_secret=OLD,
                                   **after)  # type: ignore[arg-type]
        self.before = DedupCore(store=store, upstream=self.upstream, policy=self.before_policy,
                                metrics=PrometheusMetrics(registry=CollectorRegistry()))
        self.after = DedupCore(store=store, upstream=self.upstream, policy=self.after_policy,
                               metrics=PrometheusMetrics(registry=self.registry))
        found = recipient_key(USER, "receipt", "order-7", self.after_policy)
        assert found.previous is not None
        self.key, self.previous_key = found.key, found.previous
        assert self.previous_key == recipient_key(USER, "receipt", "order-7",
                                                  self.before_policy).key

    async def held_before(self, action: Settle | None) -> str:
        """Write what an attempt of the old secret left under the previous key: PENDING
        (``action`` None) or settled by ``action``; returns its token."""
        token = uuid4().hex
        msg = inbound()
        digest = derive_key(msg.message, msg.message.dedup_headers(), self.after_policy,
                            mail_from=msg.mail_from, rcpt_tos=msg.rcpt_tos).content_digest()
        await self.store.reserve([self.previous_key], token=token, lease_s=60.0,
                                 content_digest=digest)
        if action is not None:
            await self.store.settle([SettleOp(self.previous_key, action, "250 ok")],
                                    token=token, window_s=3600.0)
        return token

    async def current(self) -> Record:
        return await self.store.inspect(self.key)


async def test_a_send_before_the_rotation_suppresses_its_retry_after_it(
        store: RedisStore, prefix: str) -> None:
    rotated = Rotated(store, prefix)
    assert (await rotated.before.process(inbound())).outcomes == {USER: "relayed"}
    retry = await rotated.after.process(inbound())
    assert retry.outcomes == {USER: "suppressed"} and retry.reply.code == 250
    assert rotated.upstream.copies_to(USER) == 1
    assert (await rotated.current()).state is State.ABSENT  # nothing left behind
    assert retry.keys == {USER: rotated.key}


async def test_a_new_message_after_the_rotation_is_kept_under_the_current_key(
        store: RedisStore, prefix: str) -> None:
    rotated = Rotated(store, prefix)
    assert (await rotated.after.process(inbound())).outcomes == {USER: "relayed"}
    assert (await rotated.current()).state is State.SENT
    assert (await store.inspect(rotated.previous_key)).state is State.ABSENT
    assert (await rotated.after.process(inbound())).outcomes == {USER: "suppressed"}


async def test_a_record_under_the_current_key_wins(store: RedisStore, prefix: str) -> None:
    """In doubt under the previous key, sent under the current one: a duplicate."""
    rotated = Rotated(store, prefix, unknown="hold")
    await rotated.held_before(Settle.UNKNOWN)
    assert (await rotated.after.process(inbound())).outcomes == {USER: "held"}
    token = uuid4().hex
    await store.reserve([rotated.key], token=token, lease_s=60.0)
    await store.settle([SettleOp(rotated.key, Settle.SENT, "250 ok")], token=token,
                       window_s=3600.0)
    assert (await rotated.after.process(inbound())).outcomes == {USER: "suppressed"}


@pytest.mark.parametrize(("unknown", "outcome", "copies"), [
    pytest.param("suppress", "suppressed_unknown", 0, id="suppress"),
    pytest.param("hold", "held", 0, id="hold"),
    pytest.param("send", "relayed", 1, id="send"),
])
async def test_in_doubt_under_the_previous_key_follows_unknown_policy(
        store: RedisStore, prefix: str, unknown: UnknownPolicy, outcome: str,
        copies: int) -> None:
    rotated = Rotated(store, prefix, unknown=unknown)
    await rotated.held_before(Settle.UNKNOWN)
    decision = await rotated.after.process(inbound())
    assert decision.outcomes == {USER: outcome}
    assert rotated.upstream.copies_to(USER) == copies
    assert (await rotated.current()).state is (State.SENT if copies else State.ABSENT)
    assert sample(rotated.registry, "relay_unknown_resent_total") == copies


class Watched(StoreWrapper):
    """``inner``, telling which keys a wait watches once it watches them."""

    def __init__(self, inner: FingerprintStore) -> None:
        super().__init__(inner)
        self.watched: list[list[str]] = []
        self.watching = asyncio.Event()

    @contextlib.asynccontextmanager
    async def _watch(self, keys: Sequence[str]) -> AsyncIterator[SettleWatch]:
        async with self.inner.watch_settles(keys) as watch:
            self.watched.append(list(keys))
            self.watching.set()
            yield watch

    def watch_settles(self, keys: Sequence[str]) -> AbstractAsyncContextManager[SettleWatch]:
        return self._watch(keys)


async def test_in_flight_under_the_previous_key_is_waited_for(
        store: RedisStore, prefix: str) -> None:
    """An attempt of the old secret still at work: the copy waits for its settle on the
    previous key (in_flight_wait), then answers from it: a duplicate once it was sent."""
    watched = Watched(store)
    rotated = Rotated(watched, prefix, in_flight_wait_s=30.0)
    token = await rotated.held_before(None)
    copy = asyncio.ensure_future(rotated.after.process(inbound()))
    await asyncio.wait_for(watched.watching.wait(), 30.0)
    assert watched.watched == [[rotated.previous_key]]
    await store.settle([SettleOp(rotated.previous_key, Settle.SENT, "250 ok")], token=token,
                       window_s=3600.0)
    decision = await asyncio.wait_for(copy, 30.0)
    assert decision.outcomes == {USER: "suppressed"}
    assert rotated.upstream.copies_to(USER) == 0


async def test_in_flight_under_the_previous_key_without_a_wait_is_450(
        store: RedisStore, prefix: str) -> None:
    rotated = Rotated(store, prefix, in_flight_wait_s=0.0)
    await rotated.held_before(None)
    decision = await rotated.after.process(inbound())
    assert decision.outcomes == {USER: "inflight"} and decision.reply.code == 450
    assert (await rotated.current()).state is State.ABSENT


async def test_other_content_under_the_previous_key_follows_key_reuse(
        store: RedisStore, prefix: str) -> None:
    rotated = Rotated(store, prefix, key_reuse="reject")
    assert (await rotated.before.process(inbound("Your receipt"))).outcomes == {
        USER: "relayed"}
    decision = await rotated.after.process(inbound("Your refund"))
    assert decision.outcomes == {USER: "refused_perm"} and decision.reply.code == 550
    assert decision.reused == {USER}


class LookupFails(RedisStore):
    """A real RedisStore whose batch read fails (the previous keys cannot be read)."""

    async def inspect_many(self, keys: object) -> list[Record]:
        raise StoreError("inspect", "ConnectionError: connection refused")


async def test_a_failed_read_of_the_previous_keys_is_the_store_down_and_releases(
        prefix: str) -> None:
    """The reserve landed, the read of the previous keys failed: 451 (store_down =
    fail_closed), and the reservation is released (the retry is not held 450)."""
    failing = LookupFails.from_url(REDIS_URL)
    try:
        rotated = Rotated(failing, prefix)
        decision = await rotated.after.process(inbound())
        assert decision.outcomes == {USER: "store_down"} and decision.reply.code == 451
        assert (await rotated.current()).state is State.ABSENT
    finally:
        await failing.close()
