"""Per-template policy and shadow mode (design.md §4.6) on the dedup core over real stores
(Redis with a random key prefix, a SQLite file): a policy swapped while a message is between
reserve and settle, shadow copies and the records they must leave alone, the 550 reply, exempt
templates, windows of their own through settles owed, flushed and journalled, and the recipient
counts. A SENDING record outlives a long transfer or a dot without reply under a short window
(the renewal extends it); a shadow copy of a message in flight gets 450 as in enforce; a
shadow-only message counts no settle round trip; mark-sent --store-key keeps a template's
longer window. An upstream scripted per transaction stands in for the smarthost where a test
must hold or refuse one transaction and not the next."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from relay.core.dedup import DedupCore, InboundMessage, Policy, TemplateRule
from relay.core.errors import StoreError
from relay.core.interfaces import (
    FingerprintStore,
    Settle,
    SettleOp,
    State,
)
from relay.core.keys import recipient_key
from relay.core.rules import iso_utc
from relay.ops.metrics import PrometheusMetrics
from relay.store.journal_file import add_to_journal, read_journal
from relay.store.redis.store import RedisStore
from relay.store.sqlite.store import SqliteStore
from tests.support.clients import message
from tests.support.net import free_port
from tests.support.relays import REDIS_URL
from tests.support.scripted_upstream import OTHER, TEMP, USER, Plan, ScriptedUpstream
from tests.support.waiting import until


def policy_of(**fields: Any) -> Policy:
    """A :class:`Policy` whose copies of a message in flight are answered 450 at once
    (``in_flight_wait_s`` 0; the wait itself is tested in test_in_flight_wait.py)."""
    return Policy(**{"in_flight_wait_s": 0.0, **fields})


def core_over(store: FingerprintStore, upstream: ScriptedUpstream, policy: Policy,
              registry: CollectorRegistry | None = None) -> DedupCore:
    return DedupCore(store=store, upstream=upstream, policy=policy, metrics=PrometheusMetrics(
        registry=registry if registry is not None else CollectorRegistry()))


def msg(rcpts: Sequence[str] = (USER,), *, template: str | None = "welcome",
        key: str | None = "K-1", queue_id: str = "q1") -> InboundMessage:
    return InboundMessage(mail_from="app@example.com", rcpt_tos=list(rcpts),
                          content=message(key=key, template=template), queue_id=queue_id)


def store_key(policy: Policy, rcpt: str = USER, template: str = "welcome",
              key: str = "K-1") -> str:
    return recipient_key(rcpt, template, key, policy).key


async def raw(key: str) -> tuple[bytes | None, int]:
    """What Redis holds under ``key``: the value and its PTTL (ms)."""
    client = aredis.Redis.from_url(REDIS_URL)
    try:
        value = await client.get(key)
        ttl_ms = int(await client.pttl(key))
    finally:
        await client.aclose()
    return (value.encode() if isinstance(value, str) else value), ttl_ms


def counted(registry: CollectorRegistry) -> dict[str, float]:
    """``relay_recipients_total`` by outcome, the zero ones left out."""
    out: dict[str, float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == "relay_recipients_total" and sample.value:
                out[sample.labels["outcome"]] = sample.value
    return out


# --------------------------------------------------------------------------------------------
# defects
# --------------------------------------------------------------------------------------------


async def test_a_shadow_copy_of_a_message_in_flight_is_told_to_wait_as_in_enforce(
        prefix: str) -> None:
    """Shadow mode. M1 holds K at the upstream; its copy M2 arrives: 450 in flight as in
    enforce (relaying it unreserved would leave no record of it once M1 failed, and the switch
    to enforce would then let M1's retry out as a second copy). M1 is refused temporarily at
    DATA and releases K; after the switch, M1's retry is the one copy delivered."""
    store = RedisStore.from_url(REDIS_URL)
    shadow = policy_of(key_prefix=prefix, mode="shadow")
    held = Plan(gate=asyncio.Event(), refuse=TEMP)
    upstream = ScriptedUpstream(held)
    core = core_over(store, upstream, shadow)
    try:
        first = asyncio.create_task(core.process(msg(queue_id="m1")))
        await held.entered.wait()
        copy = await core.process(msg(queue_id="m2"))
        assert copy.outcomes == {USER: "inflight"} and copy.reply.code == 450
        assert upstream.copies_to(USER) == 0
        assert held.gate is not None
        held.gate.set()
        assert (await first).reply.code == 451  # M1 refused before its dot: released
        core.policy = policy_of(key_prefix=prefix)  # the switch to enforce
        retry = await core.process(msg(queue_id="m1-retry"))
        assert retry.outcomes == {USER: "relayed"} and upstream.copies_to(USER) == 1
        again = await core.process(msg(queue_id="m1-again"))
        assert again.outcomes == {USER: "suppressed"} and upstream.copies_to(USER) == 1
    finally:
        await store.close()


async def test_a_shadow_only_message_counts_no_settle_round_trip(prefix: str) -> None:
    store = RedisStore.from_url(REDIS_URL)
    upstream = ScriptedUpstream()
    registry = CollectorRegistry()
    enforce = core_over(store, upstream, policy_of(key_prefix=prefix))
    shadow = core_over(store, upstream, policy_of(key_prefix=prefix, mode="shadow"), registry)
    try:
        assert (await enforce.process(msg())).outcomes == {USER: "relayed"}
        decision = await shadow.process(msg())
        assert decision.outcomes == {USER: "would_suppress"}
        settles = registry.get_sample_value("relay_store_seconds_count", {"op": "settle"})
        assert settles == 0.0, f"{settles} settle round trip(s) counted, none made"
    finally:
        await store.close()


async def open_store(kind: str, tmp_path: Path) -> FingerprintStore:
    if kind == "redis":
        return RedisStore.from_url(REDIS_URL)
    return await SqliteStore.open(str(tmp_path / "fp.db"))


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
async def test_a_template_window_of_one_lease_outlives_its_attempt(
        kind: str, prefix: str, tmp_path: Path) -> None:
    """reset-* has a window of one lease (1 s, accepted at load). M1's final dot is out and its
    upstream holds the reply for longer than that (the lease renewed all along). Its copy must
    be told to wait (in flight), and M1's record must end SENT."""
    store = await open_store(kind, tmp_path)
    policy = policy_of(key_prefix=prefix, lease_s=1.0, templates=(
        TemplateRule(match="reset-*", window_s=1.0),))
    slow = Plan(gate=asyncio.Event(), after_dot=True)
    upstream = ScriptedUpstream(slow)
    core = core_over(store, upstream, policy)
    try:
        first = asyncio.create_task(core.process(msg(template="reset-pw", queue_id="m1")))
        await slow.dot.wait()
        await asyncio.sleep(1.4)  # past the window since the SENDING mark; M1 still waits
        copy = await core.process(msg(template="reset-pw", queue_id="m2"))
        assert slow.gate is not None
        slow.gate.set()
        assert (await first).outcomes == {USER: "relayed"}
        assert copy.outcomes == {USER: "inflight"}, copy.outcomes
        assert upstream.copies_to(USER) == 1
    finally:
        await store.close()


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
async def test_a_message_in_doubt_under_a_window_of_one_lease_stays_in_doubt(
        kind: str, prefix: str, tmp_path: Path) -> None:
    store = await open_store(kind, tmp_path)
    policy = policy_of(key_prefix=prefix, lease_s=1.0, templates=(
        TemplateRule(match="reset-*", window_s=1.0),))
    silent = Plan(gate=asyncio.Event(), after_dot=True, no_reply=True)
    upstream = ScriptedUpstream(silent)
    core = core_over(store, upstream, policy)
    try:
        first = asyncio.create_task(core.process(msg(template="reset-pw", queue_id="m1")))
        await silent.dot.wait()
        await asyncio.sleep(1.4)  # the upstream has held its reply longer than the window
        assert silent.gate is not None
        silent.gate.set()
        assert (await first).outcomes == {USER: "unknown"}
        retry = await core.process(msg(template="reset-pw", queue_id="m1-retry"))
        assert retry.outcomes == {USER: "suppressed_unknown"}, retry.outcomes
        assert upstream.copies_to(USER) == 0
    finally:
        await store.close()


# --------------------------------------------------------------------------------------------
# a policy swapped mid-message, owed settles and read-backs under a template's window
# --------------------------------------------------------------------------------------------


async def test_a_policy_swapped_between_reserve_and_settle_does_not_reach_the_message(
        prefix: str) -> None:
    """M1 (receipt-*: a 7200 s window, 550 for duplicates, enforce) is at the upstream when a
    reload swaps the policy (no entries: the 86400 s window, 250, shadow). M1 settles SENT
    with its own 7200 s window; its copy meets the new policy (shadow: delivered, counted
    would_suppress); the record M1 wrote is left as it was."""
    store = RedisStore.from_url(REDIS_URL)
    before = policy_of(key_prefix=prefix, templates=(
        TemplateRule(match="receipt-*", window_s=7200.0, duplicate_reply="550"),))
    gate = Plan(gate=asyncio.Event())
    upstream = ScriptedUpstream(gate)
    core = core_over(store, upstream, before)
    key = store_key(before, template="receipt-1")
    try:
        first = asyncio.create_task(core.process(msg(template="receipt-1")))
        await gate.entered.wait()
        core.policy = policy_of(key_prefix=prefix, mode="shadow")
        assert gate.gate is not None
        gate.gate.set()
        assert (await first).outcomes == {USER: "relayed"}
        value, ttl_ms = await raw(key)
        assert value is not None and value.startswith(b"S|") and 7_000_000 < ttl_ms <= 7_200_000
        copy = await core.process(msg(template="receipt-1"))
        assert copy.reply.code == 250 and copy.outcomes == {USER: "would_suppress"}
        again, ttl_again = await raw(key)
        assert again == value and ttl_again <= ttl_ms
    finally:
        await store.close()


async def test_a_policy_swapped_while_a_copy_waits_keeps_its_550(prefix: str) -> None:
    """The policy at the copy's start says 550; a swap to 250 while it is being reserved (its
    upstream never called) does not change its reply."""
    store = RedisStore.from_url(REDIS_URL)
    core = core_over(store, ScriptedUpstream(), policy_of(key_prefix=prefix, duplicate_reply="550"))
    try:
        assert (await core.process(msg())).reply.code == 250
        copy = asyncio.create_task(core.process(msg()))
        await asyncio.sleep(0)  # the copy has read its policy and awaits the store
        core.policy = policy_of(key_prefix=prefix)
        decision = await copy
        assert decision.reply.code == 550 and decision.reply.enhanced == "5.7.1"
        assert (await core.process(msg())).reply.code == 250  # the next message: the new one
    finally:
        await store.close()


class SentFailsWhileDown(RedisStore):
    """A real RedisStore whose SENT / UNKNOWN / release settles fail while ``down``."""

    down = False

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        if self.down and any(op.action is not Settle.SENDING for op in ops):
            raise StoreError("settle", "ConnectionError: connection refused")
        return await super().settle(ops, token=token, window_s=window_s)


async def test_an_owed_settle_flushed_under_another_window_keeps_its_own(prefix: str) -> None:
    """M1 (receipt-*, a 7200 s window) is accepted but its SENT mark cannot land; the policy
    is then swapped (a 3600 s window for every template). The copy's reserve first applies the
    owed settle: with M1's 7200 s, dated by itself (S|), so the copy's 250 names M1's send time;
    the journal line for it would carry 7200 too."""
    store = SentFailsWhileDown.from_url(REDIS_URL)
    before = policy_of(key_prefix=prefix, templates=(
        TemplateRule(match="receipt-*", window_s=7200.0),))
    upstream = ScriptedUpstream()
    core = core_over(store, upstream, before)
    key = store_key(before, template="receipt-1")
    try:
        store.down = True
        sent_at = time.time()
        assert (await core.process(msg(template="receipt-1"))).reply.code == 250
        owed = core.owed_settles()
        assert [(op.key, op.action, op.window_s) for _t, op in owed] == [
            (key, Settle.SENT, 7200.0)]
        core.policy = policy_of(key_prefix=prefix, window_s=3600.0, templates=(
            TemplateRule(match="*", window_s=3600.0),))
        store.down = False
        copy = await core.process(msg(template="receipt-1"))
        assert copy.outcomes == {USER: "suppressed"} and upstream.copies_to(USER) == 1
        value, ttl_ms = await raw(key)
        assert value is not None and value.startswith(b"S|") and 7_000_000 < ttl_ms <= 7_200_000
        sent_iso = iso_utc(sent_at)
        assert sent_iso is not None and sent_iso[:15] in copy.reply.text, copy.reply
    finally:
        for task in core.background:
            task.cancel()
        await store.close()


async def test_the_journal_keeps_a_window_and_the_next_run_applies_it(
        prefix: str, tmp_path: Path) -> None:
    """A SENT owed at exit for a receipt-* message (window 7200 s) goes to the journal with its
    window; a new core (a restart) pays it with 7200 s, not its own 86400 s."""
    store = SentFailsWhileDown.from_url(REDIS_URL)
    policy = policy_of(key_prefix=prefix, templates=(
        TemplateRule(match="receipt-*", window_s=7200.0),))
    core = core_over(store, ScriptedUpstream(), policy)
    path = tmp_path / "owed.jsonl"
    key = store_key(policy, template="receipt-1")
    try:
        store.down = True
        assert (await core.process(msg(template="receipt-1"))).reply.code == 250
        for task in core.background:
            task.cancel()
        add_to_journal(path, core.owed_settles(), "s")
        store.down = False
        restarted = core_over(store, ScriptedUpstream(), policy_of(key_prefix=prefix))
        assert await restarted.pay_owed(read_journal(path, "s")) == []
        value, ttl_ms = await raw(key)
        assert value is not None and value.startswith(b"S|") and 7_000_000 < ttl_ms <= 7_200_000
    finally:
        await store.close()


@pytest.mark.parametrize("window_s", [7200.0, 86400.0, 172800.0])
async def test_redis_reads_back_the_send_time_whatever_the_window(
        prefix: str, window_s: float) -> None:
    """A template window shorter, equal to or longer than the store's (86400 s): the copy's
    250 says 'original sent' at the first send, never a time shifted by the difference."""
    store = RedisStore.from_url(REDIS_URL, window_s=86400.0)
    policy = policy_of(key_prefix=prefix, templates=(
        TemplateRule(match="receipt-*", window_s=window_s),))
    core = core_over(store, ScriptedUpstream(), policy)
    try:
        sent_at = time.time()
        assert (await core.process(msg(template="receipt-1"))).reply.code == 250
        copy = await core.process(msg(template="receipt-1"))
        at = iso_utc(sent_at)
        assert copy.outcomes == {USER: "suppressed"} and at is not None
        assert f"original sent {at[:15]}" in copy.reply.text, copy.reply
        _, ttl_ms = await raw(store_key(policy, template="receipt-1"))
        assert window_s * 1000 - 5000 < ttl_ms <= window_s * 1000
    finally:
        await store.close()


async def test_sqlite_reads_back_the_send_time_and_ttl_of_a_template_window(
        tmp_path: Path) -> None:
    store = await SqliteStore.open(str(tmp_path / "fp.db"))
    policy = policy_of(templates=(TemplateRule(match="receipt-*", window_s=7200.0),))
    core = core_over(store, ScriptedUpstream(), policy)
    try:
        sent_at = time.time()
        assert (await core.process(msg(template="receipt-1"))).reply.code == 250
        copy = await core.process(msg(template="receipt-1"))
        at = iso_utc(sent_at)
        assert at is not None and f"original sent {at[:15]}" in copy.reply.text, copy.reply
        record = await store.inspect(store_key(policy, template="receipt-1"))
        assert record.state is State.SENT and record.ttl_s is not None
        assert 7100 < record.ttl_s <= 7200
    finally:
        await store.close()


async def test_shadow_leaves_the_originals_record_and_counts_each_recipient_once(
        prefix: str) -> None:
    """K sent (SENT ``0``); a shadow message to two spellings of its mailbox and a new
    recipient: one copy per fingerprint goes upstream, the SENT record is left as it was (value
    and expiry), the new one is reserved and settled, and each of the three recipients is
    counted exactly once (would_suppress, suppressed for the second spelling, relayed)."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = ScriptedUpstream()
    enforce = core_over(store, upstream, policy_of(key_prefix=prefix))
    registry = CollectorRegistry()
    shadow = core_over(store, upstream, policy_of(key_prefix=prefix, mode="shadow"), registry)
    key = store_key(policy_of(key_prefix=prefix))
    try:
        assert (await enforce.process(msg())).outcomes == {USER: "relayed"}
        before = await raw(key)
        rcpts = [USER, "USER@Example.NET", OTHER]
        decision = await shadow.process(msg(rcpts))
        assert decision.reply.code == 250
        assert decision.outcomes == {USER: "would_suppress", "USER@Example.NET": "suppressed",
                                     OTHER: "relayed"}
        assert counted(registry) == {"would_suppress": 1, "suppressed": 1, "relayed": 1}
        assert upstream.copies_to(USER) == 2 and upstream.copies_to(OTHER) == 1
        after = await raw(key)
        assert after[0] == before[0] and after[1] <= before[1]
        assert before[0] is not None and before[0].startswith(b"0#")  # SENT, its digest
        other = await raw(store_key(policy_of(key_prefix=prefix), OTHER))
        assert other[0] is not None and other[0].startswith(b"0#")
        # nothing left PENDING: enforce answers every copy 250 at once, never 450
        again = await enforce.process(msg(rcpts))
        assert again.reply.code == 250 and set(again.outcomes.values()) == {"suppressed"}
    finally:
        await store.close()


async def test_shadow_relays_a_held_copy_and_leaves_the_record_in_doubt(prefix: str) -> None:
    """unknown_policy = hold, an UNKNOWN record: enforce answers 451; shadow relays the copy
    (would_suppress) and the UNKNOWN record stays exactly as it was, so enforce still holds."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = ScriptedUpstream()
    enforce = core_over(store, upstream, policy_of(key_prefix=prefix, unknown="hold"))
    shadow = core_over(store, upstream, policy_of(key_prefix=prefix, unknown="hold", mode="shadow"))
    key = store_key(policy_of(key_prefix=prefix))
    client = aredis.Redis.from_url(REDIS_URL)
    try:
        await client.set(key, f"U|{int(time.time() * 1000)}", px=3_600_000)
        before = await raw(key)
        assert (await enforce.process(msg())).outcomes == {USER: "held"}
        decision = await shadow.process(msg())
        assert decision.reply.code == 250 and decision.outcomes == {USER: "would_suppress"}
        assert upstream.copies_to(USER) == 1
        after = await raw(key)
        assert after[0] == before[0] and after[1] <= before[1]
        assert (await enforce.process(msg())).outcomes == {USER: "held"}
    finally:
        await client.aclose()
        await store.close()


async def test_shadow_relays_a_copy_enforce_would_suppress_as_in_doubt(prefix: str) -> None:
    """unknown_policy = suppress, an UNKNOWN record: enforce answers 250 without relaying
    (suppressed_unknown); shadow relays the copy (would_suppress) and leaves the record as it
    was."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = ScriptedUpstream()
    enforce = core_over(store, upstream, policy_of(key_prefix=prefix, unknown="suppress"))
    shadow = core_over(store, upstream,
                       policy_of(key_prefix=prefix, unknown="suppress", mode="shadow"))
    key = store_key(policy_of(key_prefix=prefix))
    client = aredis.Redis.from_url(REDIS_URL)
    try:
        await client.set(key, f"U|{int(time.time() * 1000)}", px=3_600_000)
        before = await raw(key)
        assert (await enforce.process(msg())).outcomes == {USER: "suppressed_unknown"}
        assert upstream.copies_to(USER) == 0
        decision = await shadow.process(msg())
        assert decision.reply.code == 250 and decision.outcomes == {USER: "would_suppress"}
        assert upstream.copies_to(USER) == 1
        assert (await raw(key))[0] == before[0]
    finally:
        await client.aclose()
        await store.close()


async def test_shadow_leaves_a_copy_in_flight_waiting_and_the_original_settles(
        prefix: str) -> None:
    """M1 holds K at the upstream; its copy in shadow mode gets 450 and takes nothing from M1's
    record; M1 then settles SENT with its own token; the copy's retry is a shadow copy."""
    store = RedisStore.from_url(REDIS_URL)
    gate = Plan(gate=asyncio.Event())
    upstream = ScriptedUpstream(gate)
    shadow = core_over(store, upstream, policy_of(key_prefix=prefix, mode="shadow"))
    key = store_key(policy_of(key_prefix=prefix))
    try:
        first = asyncio.create_task(shadow.process(msg(queue_id="m1")))
        await gate.entered.wait()
        pending = await raw(key)
        assert pending[0] is not None and pending[0].startswith(b"P|")
        copy = await shadow.process(msg(queue_id="m2"))
        assert copy.outcomes == {USER: "inflight"}
        assert (await raw(key))[0] == pending[0]
        assert gate.gate is not None
        gate.gate.set()
        assert (await first).outcomes == {USER: "relayed"}
        assert ((await raw(key))[0] or b"").startswith(b"0#")  # SENT, its digest
        assert (await shadow.process(msg(queue_id="m2"))).outcomes == {USER: "would_suppress"}
        enforce = core_over(store, upstream, policy_of(key_prefix=prefix))
        assert (await enforce.process(msg())).outcomes == {USER: "suppressed"}
        assert upstream.copies_to(USER) == 2
    finally:
        await store.close()


async def test_550_only_when_nothing_was_relayed_and_nothing_is_in_flight(
        prefix: str) -> None:
    """duplicate_reply = 550: two spellings of a new mailbox (one relayed, one sharing it) are
    250; a duplicate with a recipient in flight is 450; every recipient a duplicate is 550."""
    store = RedisStore.from_url(REDIS_URL)
    gate = Plan(gate=asyncio.Event())
    upstream = ScriptedUpstream()
    policy = policy_of(key_prefix=prefix, duplicate_reply="550")
    core = core_over(store, upstream, policy)
    try:
        spellings = await core.process(msg([USER, "User@EXAMPLE.net"]))
        assert spellings.reply.code == 250 and spellings.outcomes == {
            USER: "relayed", "User@EXAMPLE.net": "suppressed"}
        upstream.plans.append(gate)
        other = asyncio.create_task(core.process(msg([OTHER], queue_id="m-other")))
        await gate.entered.wait()
        mixed = await core.process(msg([USER, OTHER]))
        assert mixed.reply.code == 450, mixed.reply
        assert gate.gate is not None
        gate.gate.set()
        assert (await other).reply.code == 250
        both = await core.process(msg([USER, OTHER, "OTHER@example.net"]))
        assert both.reply.code == 550 and both.reply.enhanced == "5.7.1"
        assert upstream.copies_to(USER) == 1 and upstream.copies_to(OTHER) == 1
    finally:
        await store.close()


async def test_550_is_not_given_to_a_message_whose_shadow_copy_went(prefix: str) -> None:
    """duplicate_reply = 550 with mode = shadow: the copy went upstream, so 250."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = ScriptedUpstream()
    core = core_over(store, upstream, policy_of(key_prefix=prefix, duplicate_reply="550",
                                             mode="shadow"))
    try:
        assert (await core.process(msg())).reply.code == 250
        copy = await core.process(msg())
        assert copy.reply.code == 250 and copy.outcomes == {USER: "would_suppress"}
    finally:
        await store.close()


async def test_an_exempt_template_is_never_refused_for_its_missing_key(prefix: str) -> None:
    """missing_key = reject for the relay; otp-* exempt: no key, relayed (exempt), nothing in
    the store. With a second template that is deduplicated, dedup wins (strictest) and the
    missing key is refused; an exempt message with a key writes nothing either."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = ScriptedUpstream()
    registry = CollectorRegistry()
    policy = policy_of(key_prefix=prefix, missing_key="reject", templates=(
        TemplateRule(match="otp-*", dedup=False),))
    core = core_over(store, upstream, policy, registry)
    try:
        bare = await core.process(msg(template="otp-login", key=None))
        assert bare.reply.code == 250 and bare.outcomes == {USER: "exempt"}
        keyed = await core.process(msg([USER, OTHER], template="otp-login"))
        assert keyed.outcomes == {USER: "exempt", OTHER: "exempt"}
        assert (await raw(store_key(policy, template="otp-login")))[0] is None
        both = InboundMessage(
            mail_from="app@example.com", rcpt_tos=[USER], queue_id="q2",
            content=message(key=None, template="otp-login", extra="X-Template: welcome\r\n"))
        refused = await core.process(both)
        assert refused.reply.code == 554 and refused.outcomes == {}
        assert counted(registry) == {"exempt": 3}
        assert upstream.copies_to(USER) == 2
    finally:
        await store.close()


async def test_strictest_of_several_templates_as_documented(prefix: str) -> None:
    """design.md §4.6: rule by rule the strictest of the entries of every template value:
    here the 550 of receipt-*, the 7200 s window of receipt-*, enforce over shadow (news*).
    A copy of the two-template message is 550 and its record lives 7200 s."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = ScriptedUpstream()
    policy = policy_of(key_prefix=prefix, window_s=3600.0, templates=(
        TemplateRule(match="receipt-*", window_s=7200.0, duplicate_reply="550"),
        TemplateRule(match="news*", mode="shadow", unknown="send")))
    core = core_over(store, upstream, policy)
    content = message(template="news-1", extra="X-Template: receipt-9\r\n")
    two = InboundMessage(mail_from="app@example.com", rcpt_tos=[USER], content=content,
                         queue_id="q")
    try:
        assert (await core.process(two)).reply.code == 250
        copy = await core.process(two)
        assert copy.reply.code == 550 and copy.outcomes == {USER: "suppressed"}
        assert upstream.copies_to(USER) == 1
        template = "news-1\x1freceipt-9"
        _, ttl_ms = await raw(store_key(policy, template=template))
        assert 7_000_000 < ttl_ms <= 7_200_000
    finally:
        await store.close()


async def test_a_copy_waits_for_an_owed_release_of_another_window(prefix: str) -> None:
    """M1 (a 7200 s window) refused temporarily by the upstream, its release cannot land
    (store hiccup); the policy is swapped; the copy's reserve applies the owed release first
    and is relayed, never answered 450 for M1's leftover PENDING."""
    store = SentFailsWhileDown.from_url(REDIS_URL)
    upstream = ScriptedUpstream(Plan(refuse=TEMP))
    policy = policy_of(key_prefix=prefix, templates=(
        TemplateRule(match="receipt-*", window_s=7200.0),))
    core = core_over(store, upstream, policy)
    try:
        store.down = True
        assert (await core.process(msg(template="receipt-1"))).reply.code == 451
        await until(lambda: bool(core.owed_settles()), what="the release owed")
        core.policy = policy_of(key_prefix=prefix, mode="shadow")
        store.down = False
        retry = await core.process(msg(template="receipt-1"))
        assert retry.outcomes == {USER: "relayed"} and upstream.copies_to(USER) == 1
    finally:
        for task in core.background:
            task.cancel()
        await store.close()


async def test_a_shadow_copy_cut_after_its_dot_leaves_the_originals_record(prefix: str) -> None:
    """Shutdown past its grace cuts a shadow transaction after its final dot: the reserved new
    recipient is marked UNKNOWN (its own record), the shadowed copy's SENT record (another
    attempt's) is left exactly as it was; the client is told 451 4.4.2 and each recipient is
    counted once."""
    store = RedisStore.from_url(REDIS_URL)
    plain = policy_of(key_prefix=prefix)
    cut = Plan(gate=asyncio.Event(), after_dot=True)
    upstream = ScriptedUpstream()
    registry = CollectorRegistry()
    shadow = core_over(store, upstream, policy_of(key_prefix=prefix, mode="shadow"), registry)
    try:
        assert (await core_over(store, upstream, plain).process(msg())).reply.code == 250
        before = await raw(store_key(plain))
        upstream.plans.append(cut)
        task = asyncio.create_task(shadow.process(msg([USER, OTHER])))
        await cut.dot.wait()
        task.cancel()
        decision = await task
        assert decision.reply.code == 451 and decision.reply.enhanced == "4.4.2"
        assert decision.outcomes == {USER: "unknown", OTHER: "unknown"}
        assert counted(registry) == {"unknown": 2}
        after = await raw(store_key(plain))
        assert after[0] == before[0] and after[1] <= before[1]
        assert before[0] is not None and before[0].startswith(b"0#")
        other = await raw(store_key(plain, OTHER))
        assert other[0] is not None and other[0].startswith(b"U|")
    finally:
        await store.close()


async def test_an_exempt_template_needs_no_store(prefix: str) -> None:
    """dedup = false writes and reads nothing: with the store down (nothing listens on its
    port) an otp-* message is relayed (exempt), another template's is 451 (store_down)."""
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}", op_timeout_s=0.5)
    upstream = ScriptedUpstream()
    policy = policy_of(key_prefix=prefix, templates=(TemplateRule(match="otp-*", dedup=False),))
    core = core_over(store, upstream, policy)
    try:
        exempt = await core.process(msg(template="otp-login"))
        assert exempt.reply.code == 250 and exempt.outcomes == {USER: "exempt"}
        kept = await core.process(msg(template="welcome"))
        assert kept.reply.code == 451 and kept.outcomes == {USER: "store_down"}
        assert upstream.copies_to(USER) == 1
    finally:
        await store.close()


async def test_a_template_matches_by_its_normalized_value(prefix: str) -> None:
    """The glob sees the value the fingerprint hashes: an RFC 2047 encoded-word, folded and
    padded, is receipt-1 and gets receipt-*'s 7200 s window; a copy spelled plainly is the
    same fingerprint and is suppressed."""
    store = RedisStore.from_url(REDIS_URL)
    upstream = ScriptedUpstream()
    policy = policy_of(key_prefix=prefix, templates=(
        TemplateRule(match="receipt-*", window_s=7200.0),))
    core = core_over(store, upstream, policy)
    encoded = InboundMessage(
        mail_from="app@example.com", rcpt_tos=[USER], queue_id="q",
        content=message(template=None, extra="X-Template:\r\n  =?utf-8?q?receipt-1?=  \r\n"))
    try:
        assert (await core.process(encoded)).outcomes == {USER: "relayed"}
        _, ttl_ms = await raw(store_key(policy, template="receipt-1"))
        assert 7_000_000 < ttl_ms <= 7_200_000
        assert (await core.process(msg(template="receipt-1"))).outcomes == {USER: "suppressed"}
    finally:
        await store.close()
