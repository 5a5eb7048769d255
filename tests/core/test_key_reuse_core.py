"""A key reused for other content through the core (design.md §4.9), on a real Redis: each
``key_reuse`` value, what is counted, logged and handed to the ledger, a copy that differs only
in its volatile parts (no reuse), shadow mode, the per-template setting, and a message with a
fresh and a reused recipient."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

import pytest
from prometheus_client import CollectorRegistry

from relay.core import replies
from relay.core.dedup import Decision, DedupCore, InboundMessage, Policy, TemplateRule
from relay.core.interfaces import LedgerEntry
from relay.core.observers import RecordDecisions
from relay.core.rules import KeyReuse
from relay.ops.metrics import PrometheusMetrics
from relay.store.redis.store import RedisStore
from tests.support.clients import message
from tests.support.metrics import sample
from tests.support.relays import REDIS_URL
from tests.support.scripted_upstream import OTHER, USER, ScriptedUpstream

RECEIPT = "Thanks for order 1042, shipped 2024-01-08 09:00 UTC."
RECEIPT_LATER = "Thanks for order 1042, shipped 2024-01-08 09:05 UTC."  # a retry's timestamp
REFUND = "Your refund for order 1042 is on its way."


class Rows:
    """An audit ledger that keeps the rows it is handed."""

    def __init__(self) -> None:
        self.rows: list[LedgerEntry] = []

    def record(self, entries: Sequence[LedgerEntry], *, admitted: bool = True) -> None:
        self.rows.extend(entries)

    def admits(self) -> bool:
        return True


@pytest.fixture
async def store() -> AsyncIterator[RedisStore]:
    opened = RedisStore.from_url(REDIS_URL)
    yield opened
    await opened.close()


class Core:
    """A core over ``store`` and a scripted upstream, its counters and ledger rows."""

    def __init__(self, store: RedisStore, policy: Policy) -> None:
        self.registry = CollectorRegistry()
        self.upstream = ScriptedUpstream()
        self.ledger = Rows()
        self.policy = policy
        self.core = DedupCore(store=store, upstream=self.upstream, policy=policy,
                              metrics=PrometheusMetrics(registry=self.registry),
                              observers=[RecordDecisions(self.ledger)])

    async def send(self, body: str, rcpts: Sequence[str] = (USER,),
                   template: str = "receipt") -> Decision:
        return await self.core.process(InboundMessage(
            mail_from="shop@shop.example", rcpt_tos=list(rcpts), queue_id="q",
            content=message(key="order-1042", template=template, body=body)))

    def reused(self, template: str = "receipt") -> float:
        return sample(self.registry, "relay_key_reuse_total", template=template)


@pytest.fixture
async def core(store: RedisStore, prefix: str) -> Core:
    return Core(store, Policy(key_prefix=prefix))


@pytest.mark.parametrize(("key_reuse", "code", "outcome", "copies"), [
    pytest.param("suppress", 250, "suppressed", 1, id="suppress"),
    pytest.param("reject", 550, "refused_perm", 1, id="reject"),
    pytest.param("relay", 250, "relayed", 2, id="relay"),
])
async def test_a_key_reused_for_other_content_follows_key_reuse(
        store: RedisStore, prefix: str, caplog: pytest.LogCaptureFixture, key_reuse: KeyReuse,
        code: int, outcome: str, copies: int) -> None:
    one = Core(store, Policy(key_prefix=prefix, key_reuse=key_reuse))
    assert (await one.send(RECEIPT)).outcomes == {USER: "relayed"}
    with caplog.at_level(logging.WARNING, logger="relay.core.dedup"):
        decision = await one.send(REFUND)
    assert decision.reply.code == code and decision.outcomes == {USER: outcome}
    if key_reuse == "reject":
        assert decision.reply == replies.KEY_REUSED
    assert decision.reused == {USER}
    assert one.upstream.copies_to(USER) == copies
    assert one.reused() == 1
    assert [r.key_reused for r in one.ledger.rows] == [False, True]
    warned = [r for r in caplog.records if "reused for other content" in r.getMessage()]
    assert len(warned) == 1 and f"key_reuse={key_reuse}" in warned[0].getMessage()
    # what the record holds now: the refund's content only once it was relayed
    again = await one.send(REFUND)
    reused_again = key_reuse != "relay"
    assert again.reused == ({USER} if reused_again else frozenset())


async def test_a_retry_differing_in_a_timestamp_is_no_reuse(core: Core) -> None:
    await core.send(RECEIPT)
    decision = await core.send(RECEIPT_LATER)
    assert decision.outcomes == {USER: "suppressed"}
    assert decision.reused == frozenset()
    assert core.reused() == 0


async def test_shadow_mode_relays_what_reject_would_refuse(store: RedisStore,
                                                            prefix: str) -> None:
    shadow = Core(store, Policy(key_prefix=prefix, key_reuse="reject", mode="shadow"))
    await shadow.send(RECEIPT)
    decision = await shadow.send(REFUND)
    assert decision.reply.code == 250
    assert decision.outcomes == {USER: "would_suppress"}
    assert shadow.reused() == 1 and shadow.upstream.copies_to(USER) == 2


async def test_key_reuse_is_a_per_template_policy(store: RedisStore, prefix: str) -> None:
    """``receipt`` relays a reused key, every other template refuses it."""
    policy = Policy(key_prefix=prefix, key_reuse="reject",
                    templates=(TemplateRule(match="receipt", key_reuse="relay"),))
    one = Core(store, policy)
    for template in ("receipt", "invoice"):
        await one.send(RECEIPT, template=template)
    relayed = await one.send(REFUND, template="receipt")
    refused = await one.send(REFUND, template="invoice")
    assert relayed.outcomes == {USER: "relayed"}
    assert refused.reply == replies.KEY_REUSED
    assert (one.reused("receipt"), one.reused("invoice")) == (1, 1)


async def test_a_reused_recipient_refused_beside_a_fresh_one_is_owed_a_notice(
        store: RedisStore, prefix: str) -> None:
    """key_reuse = reject: the fresh recipient is relayed, the message answered 250 with the
    refused one counted, and its refusal (the 550) is what the sender's notice says."""
    reject = Core(store, Policy(key_prefix=prefix, key_reuse="reject"))
    await reject.send(RECEIPT)
    decision = await reject.send(REFUND, rcpts=[USER, OTHER])
    assert decision.reply.code == 250
    assert decision.outcomes == {USER: "refused_perm", OTHER: "relayed"}
    assert decision.refusals[USER].reply == replies.KEY_REUSED
    assert "relayed 1" in decision.reply.text and "refused permanently 1" in decision.reply.text
