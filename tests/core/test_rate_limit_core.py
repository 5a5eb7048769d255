"""Rate limits through a real relay and a real sink: a message over a limit gets
``451 4.7.0 rate limit ...`` (``452 4.5.3`` for recipients), nothing is reserved or relayed,
and the client's retry once the window has room is relayed once. Every scope, messages
without a key and exempt templates, the store down (store_down), and a reload of the
``[[rate_limit]]`` tables."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry

from relay.app import Relay
from relay.core import replies
from relay.core.dedup import DedupCore, InboundMessage, Policy
from relay.core.fingerprint import fingerprint, store_key
from relay.core.gates import Gates, RateLimits
from relay.core.interfaces import Result, State
from relay.core.limits import LimitSubject, RateRule, checks_for, sender_domain
from relay.core.recipients import normalize_recipient
from relay.ops.metrics import PrometheusMetrics
from relay.reload import apply_changes, compare, file_digests
from relay.settings import RateLimit, TemplatePolicy
from relay.store.redis.store import RedisStore
from tests.support.clients import message, send
from tests.support.dedup_parts import CountingUpstream
from tests.support.net import free_port
from tests.support.relays import REDIS_URL, MakeRelay, PrivateRedis, delete_prefix
from tests.support.sink import Sink

RCPT = "user@example.net"


def limited(relay: Relay, label: str) -> float:
    value = relay.registry.get_sample_value("relay_rate_limited_total", {"limit": label})
    return -1.0 if value is None else value


def wait_of(text: str) -> int:
    found = re.search(r"try again in (\d+) s", text)
    assert found is not None, text
    return int(found.group(1))


async def start(make_relay: MakeRelay, sink: Sink, *limits: dict[str, Any],
                **settings: Any) -> Relay:
    return await make_relay(upstream=f"127.0.0.1:{sink.port}",
                            rate_limit=tuple(RateLimit(**limit) for limit in limits),
                            **settings)


async def test_the_message_over_the_limit_gets_451_and_is_relayed_after_the_window(
        make_relay: MakeRelay, sink: Sink) -> None:
    relay = await start(make_relay, sink, {"scope": "upstream", "messages": 3, "per": 1.5})
    assert limited(relay, "upstream-3-per-1.5s") == 0  # the child exists from the start
    for n in range(3):
        assert (await send(relay.port, [RCPT], message(key=f"K-{n}"))).code == 250
    over = await send(relay.port, [RCPT], message(key="K-over"))
    assert over.code == 451
    assert over.text.startswith("4.7.0 rate limit upstream-3-per-1.5s reached: try again in")
    assert len(sink.handler.delivered) == 3
    assert limited(relay, "upstream-3-per-1.5s") == 1
    # nothing was reserved for it: its record is absent
    key = store_key(relay.settings.store_prefix, fingerprint(
        normalize_recipient(RCPT), "welcome", "K-over"))
    assert relay.store is not None
    assert (await relay.store.inspect(key)).state is State.ABSENT
    await asyncio.sleep(wait_of(over.text))  # the client's retry, as the reply told it
    retry = await send(relay.port, [RCPT], message(key="K-over"))
    assert retry.code == 250
    assert len(sink.handler.delivered) == 4
    again = await send(relay.port, [RCPT], message(key="K-over"))
    assert again.code == 250 and len(sink.handler.delivered) == 4  # suppressed: once only


async def test_a_recipients_limit_answers_452_and_costs_each_recipient(
        make_relay: MakeRelay, sink: Sink) -> None:
    relay = await start(make_relay, sink, {"scope": "upstream", "recipients": 3, "per": 30,
                                           "name": "rcpts"})
    two = ["a@example.net", "b@example.net"]
    assert (await send(relay.port, two, message(key="R-1"))).code == 250
    over = await send(relay.port, two, message(key="R-2"))
    assert over.code == 452
    assert over.text.startswith("4.5.3 rate limit rcpts: too many recipients")
    assert (await send(relay.port, ["c@example.net"], message(key="R-3"))).code == 250
    assert len(sink.handler.delivered) == 2
    assert limited(relay, "rcpts") == 1


async def test_messages_without_a_key_and_exempt_templates_are_limited_too(
        make_relay: MakeRelay, sink: Sink) -> None:
    relay = await start(make_relay, sink, {"scope": "upstream", "messages": 2, "per": 30},
                        template_policy=(TemplatePolicy.model_validate(
                            {"match": "exempt-*", "dedup": False}),))
    assert (await send(relay.port, [RCPT], message(key=None))).code == 250
    assert (await send(relay.port, [RCPT], message(template="exempt-news"))).code == 250
    for msg in (message(key=None), message(template="exempt-news"), message(key="K-9")):
        reply = await send(relay.port, [RCPT], msg)
        assert reply.code == 451 and "rate limit" in reply.text
    assert len(sink.handler.delivered) == 2


async def test_sender_domain_and_template_buckets_with_match(
        make_relay: MakeRelay, sink: Sink) -> None:
    relay = await start(
        make_relay, sink,
        {"scope": "sender_domain", "messages": 1, "per": 30, "match": "example.com"},
        {"scope": "template", "messages": 1, "per": 30, "name": "per-template"})
    assert (await send(relay.port, [RCPT], message(key="S-1", template="t1"),
                       mail_from="a@Example.COM")).code == 250
    # the same domain, spelled otherwise: its bucket is full
    reply = await send(relay.port, [RCPT], message(key="S-2", template="t2"),
                       mail_from="b@EXAMPLE.com")
    assert reply.code == 451 and "rate limit sender_domain-1-per-30s reached" in reply.text
    # another domain: not matched by the entry; the template t2 still had room
    assert (await send(relay.port, [RCPT], message(key="S-3", template="t2"),
                       mail_from="a@example.org")).code == 250
    reply = await send(relay.port, [RCPT], message(key="S-4", template="t2"),
                       mail_from="c@example.org")
    assert reply.code == 451 and "rate limit per-template reached" in reply.text
    assert len(sink.handler.delivered) == 2


def test_scope_values() -> None:
    rules = [RateRule("u", "upstream", 10, messages=1), RateRule("a", "auth_user", 10, 1),
             RateRule("d", "sender_domain", 10, 1), RateRule("t", "template", 10, 1)]
    subject = LimitSubject(upstream="smarthost", auth_user=None, mail_from="",
                           templates=("x", "y"), recipients=2)
    buckets = [c.bucket for c in checks_for(rules, subject)]
    # no AUTH identity: the auth_user entry does not apply; the null sender is "<>"; each
    # template value has its own bucket
    assert buckets == ["u:m:upstream:smarthost", "d:m:sender_domain:<>", "t:m:template:x",
                       "t:m:template:y"]
    assert sender_domain("a@B\u00dcCHER.example") == "xn--bcher-kva.example"
    assert sender_domain("x@[IPv6:2001:DB8:0::1]") == "[ipv6:2001:db8::1]"


async def test_auth_user_buckets_per_identity_and_none_without_auth() -> None:
    prefix = f"test:{uuid.uuid4().hex}:"
    store = RedisStore.from_url(REDIS_URL)
    upstream = CountingUpstream()
    core = DedupCore(store=store, upstream=upstream,
                     metrics=PrometheusMetrics(registry=CollectorRegistry()),
                     policy=Policy(key_prefix=prefix), gates=Gates(rate_limits=RateLimits(
                         store.rate_limiter(prefix),
                         [RateRule("per-user", "auth_user", 30, messages=1)])))

    def msg(n: int, user: str | None) -> InboundMessage:
        return InboundMessage(mail_from="a@example.com", rcpt_tos=[RCPT],
                              content=message(key=f"A-{n}"), auth_user=user)

    try:
        assert (await core.process(msg(1, "alice"))).result is Result.RELAYED
        assert (await core.process(msg(2, "alice"))).reply.code == 451
        assert (await core.process(msg(3, "bob"))).result is Result.RELAYED
        assert (await core.process(msg(4, None))).result is Result.RELAYED
        assert (await core.process(msg(5, None))).result is Result.RELAYED
        assert len(upstream.sent) == 4
    finally:
        await store.close()
        delete_prefix(REDIS_URL, prefix)


async def test_the_upstream_scope_counts_against_the_preferred_upstream() -> None:
    prefix = f"test:{uuid.uuid4().hex}:"
    store = RedisStore.from_url(REDIS_URL)
    preferred = ["first"]
    core = DedupCore(store=store, upstream=CountingUpstream(),
                     metrics=PrometheusMetrics(registry=CollectorRegistry()),
                     policy=Policy(key_prefix=prefix), gates=Gates(rate_limits=RateLimits(
                         store.rate_limiter(prefix), [RateRule("up", "upstream", 30, messages=1)],
                         upstream_name=lambda: preferred[0])))

    def msg(n: int) -> InboundMessage:
        return InboundMessage(mail_from="a@example.com", rcpt_tos=[RCPT],
                              content=message(key=f"U-{n}"))

    try:
        assert (await core.process(msg(1))).result is Result.RELAYED
        assert (await core.process(msg(2))).reply.code == 451
        preferred[0] = "second"  # the first cools down: the second has its own bucket
        assert (await core.process(msg(3))).result is Result.RELAYED
    finally:
        await store.close()
        delete_prefix(REDIS_URL, prefix)


async def test_the_upstream_scope_follows_a_failover_to_the_second_upstream(
        make_relay: MakeRelay, sink: Sink) -> None:
    """Two upstreams, the first refusing connections: the first message is counted against
    the first (its preferred one then) and fails over; once the first cools down the second is
    preferred, and a limit on the second's name counts the next messages."""
    dead, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{sink.port}"
    relay = await make_relay(
        upstream=f"{dead},{second}",
        rate_limit=(RateLimit.model_validate({"scope": "upstream", "match": second,
                                              "messages": 2, "per": 30, "name": "second"}),))
    codes = [(await send(relay.port, [RCPT], message(key=f"F-{n}"))).code for n in range(4)]
    # 1st: counted against the first upstream (not limited), relayed by the second;
    # 2nd and 3rd: counted against the second; 4th: over its limit
    assert codes == [250, 250, 250, 451]
    assert len(sink.handler.delivered) == 3
    assert limited(relay, "second") == 1


async def test_a_shutdown_cutting_the_limit_check_answers_451_and_sends_nothing(
        private_redis: PrivateRedis) -> None:
    """Shutdown past its grace cancels a message waiting on its limit check (here a paused
    Redis): the client is told 451 4.3.2 (nothing was sent), not left without a reply."""
    prefix = f"test:{uuid.uuid4().hex}:"
    store = RedisStore.from_url(private_redis.url, op_timeout_s=5.0)
    upstream = CountingUpstream()
    core = DedupCore(store=store, upstream=upstream,
                     metrics=PrometheusMetrics(registry=CollectorRegistry()),
                     policy=Policy(key_prefix=prefix), gates=Gates(rate_limits=RateLimits(
                         store.rate_limiter(prefix), [RateRule("up", "upstream", 30, messages=5)])))
    admin = redis.Redis.from_url(private_redis.url)
    try:
        await store.ping()
        admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")
        task = asyncio.ensure_future(core.process(InboundMessage(
            mail_from="a@example.com", rcpt_tos=[RCPT], content=message(key="C-1"))))
        await asyncio.sleep(0.2)  # the check is waiting on the paused server
        assert not task.done()
        task.cancel()
        decision = await task
        assert decision.reply == replies.CUT_BY_SHUTDOWN
        assert not upstream.sent
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
        await store.close()


@pytest.mark.parametrize("store_down", ["fail_closed", "fail_open"])
async def test_the_store_down_follows_store_down(make_relay: MakeRelay, sink: Sink,
                                                 store_down: str) -> None:
    relay = await start(make_relay, sink, {"scope": "upstream", "messages": 5, "per": 30},
                        store="redis://127.0.0.1:1/0", store_down=store_down,
                        store_timeout=0.5)
    reply = await send(relay.port, [RCPT], message(key="D-1"))
    if store_down == "fail_closed":
        assert reply.code == 451 and reply.text.startswith("4.3.0")
        assert not sink.handler.delivered
    else:
        assert reply.code == 250 and len(sink.handler.delivered) == 1


async def test_a_reload_swaps_the_limits(make_relay: MakeRelay, sink: Sink) -> None:
    relay = await start(make_relay, sink)
    for n in range(2):
        assert (await send(relay.port, [RCPT], message(key=f"L-{n}"))).code == 250
    running = relay.settings
    new = running.model_copy(update={"rate_limit": (
        RateLimit(scope="upstream", messages=1, per=30, name="after-reload"),)})
    changes = compare(running, new, file_digests(running), file_digests(new))
    assert "rate_limit" in changes.applied and "rate_limit" not in changes.restart
    await apply_changes(relay, changes)
    assert limited(relay, "after-reload") == 0
    assert (await send(relay.port, [RCPT], message(key="L-2"))).code == 250
    reply = await send(relay.port, [RCPT], message(key="L-3"))
    assert reply.code == 451 and "rate limit after-reload reached" in reply.text
    assert limited(relay, "after-reload") == 1


def test_two_entries_with_one_label_are_refused() -> None:
    from pydantic import ValidationError

    from relay.settings import Settings

    with pytest.raises(ValidationError, match="share the label"):
        Settings.model_validate({"rate_limit": [
            {"scope": "upstream", "messages": 1, "per": 1, "match": "a"},
            {"scope": "upstream", "messages": 1, "per": 1, "match": "b"}]})
