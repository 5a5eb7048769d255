"""The main job end to end: real Redis, real aiosmtpd sink upstream, real smtplib clients."""

from __future__ import annotations

import asyncio
from collections import deque

from relay.app import Relay
from relay.core import replies
from relay.core.dedup import Policy
from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import State
from relay.core.recipients import normalize_recipient
from tests.support.clients import message, send
from tests.support.relays import MakeRelay, PrivateRedis
from tests.support.sink import Sink


def key_of(relay: Relay, rcpt: str, template: str = "welcome", key: str = "K-1") -> str:
    """The store key the relay uses for (rcpt, template, key)."""
    norm = normalize_recipient(rcpt)
    return store_key(relay.settings.store_prefix, fingerprint(norm, template, key))


async def test_same_message_twice_is_delivered_once(relay: Relay, sink: Sink) -> None:
    """A retried send with the same X-Dedupe-Key (another body) is answered 250 and reaches
    upstream once; the record is SENT, dated (the upstream's reply is in the log line only)."""
    first = await send(relay.port, ["user@example.net"], message())
    second = await send(relay.port, ["user@example.net"], message(body="other body"))
    assert first.code == 250
    assert second.code == 250
    assert "suppressed" in second.text
    assert "original sent" in second.text
    assert len(sink.handler.delivered) == 1
    assert relay.store is not None
    record = await relay.store.inspect(key_of(relay, "user@example.net"))
    assert record.state is State.SENT
    assert record.at is not None and record.reply is None


async def test_different_key_or_template_is_delivered(relay: Relay, sink: Sink) -> None:
    """A different dedupe key or template is a different message and is relayed."""
    await send(relay.port, ["user@example.net"], message(key="K-1"))
    await send(relay.port, ["user@example.net"], message(key="K-2"))
    await send(relay.port, ["user@example.net"], message(key="K-1", template="receipt"))
    assert len(sink.handler.delivered) == 3


async def test_recipient_case_and_idn_variants_are_one_recipient(relay: Relay, sink: Sink) -> None:
    """Case variants and U-label/A-label spellings of one address get one delivery."""
    variants = ["User@Bücher.example", "user@xn--bcher-kva.example", "USER@BÜCHER.EXAMPLE"]
    results = []
    for rcpt in variants:
        results.append(await send(relay.port, [rcpt], message(), mail_options=["SMTPUTF8"]))
    assert [r.code for r in results] == [250, 250, 250]
    assert len(sink.handler.delivered) == 1
    assert sink.handler.delivered[0].rcpt_tos == ["User@Bücher.example"]


async def test_two_spellings_in_one_message_are_one_copy_and_counted_so(
        relay: Relay, sink: Sink) -> None:
    """alice@ and ALICE@ in one message: one upstream copy, answered and counted as one
    relayed and one suppressed (not two relayed), as the metrics say."""
    result = await send(relay.port, ["alice@example.net", "ALICE@Example.NET"], message())
    assert result.code == 250 and "relayed 1, suppressed 1 duplicate(s)" in result.text
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["alice@example.net"]]
    sample = relay.registry.get_sample_value
    assert sample("relay_recipients_total", {"outcome": "relayed"}) == 1.0
    assert sample("relay_recipients_total", {"outcome": "suppressed"}) == 1.0


async def test_second_message_carries_only_the_new_recipient(relay: Relay, sink: Sink) -> None:
    """A message to a, then to a and b: the second upstream transaction has b only."""
    await send(relay.port, ["a@example.net"], message())
    result = await send(relay.port, ["a@example.net", "b@example.net"], message())
    assert result.code == 250
    assert "relayed 1" in result.text and "suppressed 1" in result.text
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["a@example.net"], ["b@example.net"]]


async def test_message_without_key_is_delivered_every_time(relay: Relay, sink: Sink) -> None:
    """A message with no X-Dedupe-Key is relayed on every send."""
    for _ in range(3):
        assert (await send(relay.port, ["user@example.net"], message(key=None))).code == 250
    assert len(sink.handler.delivered) == 3


async def test_upstream_552_to_rcpt_after_an_accepted_one_is_its_limit(
        relay: Relay, sink: Sink) -> None:
    """A 552 to RCPT (too many recipients) is a 452 (RFC 5321 4.5.3.1.10); after an accepted
    recipient it is the smarthost's limit: the rest goes in a further transaction."""
    sink.handler.rcpt_plan["b@example.net"] = deque(["552 5.5.3 Too many recipients"])
    rcpts = ["a@example.net", "b@example.net"]
    first = await send(relay.port, rcpts, message(template="bulk", key="T-1"))
    assert first.code == 250 and "relayed 2" in first.text
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["a@example.net"], ["b@example.net"]]
    retry = await send(relay.port, rcpts, message(template="bulk", key="T-1"))
    assert retry.code == 250 and "suppressed for 2" in retry.text
    assert len(sink.handler.delivered) == 2


async def test_a_transaction_past_the_limit_that_is_refused_ends_the_run(
        relay: Relay, sink: Sink) -> None:
    """The smarthost takes one recipient per transaction and refuses the first message
    (``451`` to the dot): no further transaction; every recipient is released, and the retry
    goes in two transactions."""
    sink.handler.rcpt_limit = 1
    sink.handler.data_plan.append("451 4.3.0 try again later")
    rcpts = ["a@example.net", "b@example.net"]
    first = await send(relay.port, rcpts, message(template="bulk", key="T-2"))
    assert (first.code, sink.handler.transactions) == (451, 1)
    retry = await send(relay.port, rcpts, message(template="bulk", key="T-2"))
    assert retry.code == 250 and "relayed 2" in retry.text
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["a@example.net"], ["b@example.net"]]


async def test_upstream_552_to_the_first_rcpt_is_temporary_and_the_retry_sends_it(
        relay: Relay, sink: Sink) -> None:
    """A 552 to the transaction's first RCPT is a 452 that is no limit (nothing was accepted
    before it): that recipient is refused temporarily, the others relayed, the retry sends
    it."""
    sink.handler.rcpt_plan["a@example.net"] = deque(["552 5.5.3 Too many recipients"])
    rcpts = ["a@example.net", "b@example.net"]
    first = await send(relay.port, rcpts, message(template="bulk", key="T-1"))
    assert (first.code, first.text) == (452, "4.5.3 upstream: Too many recipients")
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["b@example.net"]]
    retry = await send(relay.port, rcpts, message(template="bulk", key="T-1"))
    assert retry.code == 250 and "relayed 1, suppressed 1" in retry.text
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["b@example.net"], ["a@example.net"]]


async def test_upstream_multiline_refusal_reaches_the_client_as_one_line(
        relay: Relay, sink: Sink) -> None:
    """A multi-line 550 is passed on as one line, its enhanced code given once."""
    sink.handler.rcpt_plan["b@example.net"] = deque(
        ["550-5.1.1 The mailbox does not exist\r\n550 5.1.1 Check the address"])
    result = await send(relay.port, ["b@example.net"], message(template="m", key="M-1"))
    assert (result.code, result.text) == (
        550, "5.1.1 upstream: The mailbox does not exist Check the address")


async def test_twenty_concurrent_clients_one_delivery(relay: Relay, sink: Sink) -> None:
    """20 clients sending the same message at once: one delivery, each told 250 or 450."""
    sink.handler.delay_s = 0.3
    results = await asyncio.gather(
        *(send(relay.port, ["user@example.net"], message()) for _ in range(20)))
    codes = sorted(r.code for r in results)
    assert set(codes) <= {250, 450}
    assert codes.count(250) >= 1
    assert len(sink.handler.delivered) == 1
    assert sink.handler.transactions == 1


async def test_redis_down_fails_closed(
    make_relay: MakeRelay, sink: Sink, private_redis: PrivateRedis
) -> None:
    """With Redis stopped the client gets 451 4.3.0 and nothing is sent upstream."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=private_redis.url,
                             store_timeout=0.5)
    assert (await send(relay.port, ["user@example.net"], message(key="warm"))).code == 250
    private_redis.stop()
    result = await send(relay.port, ["user@example.net"], message())
    assert (result.code, result.text) == (451, replies.STORE_DOWN.text)
    assert len(sink.handler.delivered) == 1
    private_redis.start()
    again = await send(relay.port, ["user@example.net"], message())
    assert again.code == 250 and "relayed 1" in again.text


async def test_redis_down_fail_open_relays(
    make_relay: MakeRelay, sink: Sink, private_redis: PrivateRedis
) -> None:
    """With store_down=fail_open and Redis stopped, the message is relayed without dedup."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=private_redis.url,
                             store_timeout=0.5, store_down="fail_open")
    private_redis.stop()
    result = await send(relay.port, ["user@example.net"], message())
    assert result.code == 250
    assert len(sink.handler.delivered) == 1


async def test_missing_key_reject_policy(make_relay: MakeRelay, sink: Sink) -> None:
    """With missing_key=reject a message without a key is refused and nothing is sent."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", missing_key="reject")
    result = await send(relay.port, ["user@example.net"], message(key=None))
    assert (result.code, result.text) == (554, replies.MISSING_KEY_REJECTED.text)
    assert sink.handler.transactions == 0


async def test_foreign_value_counts_as_sent(relay: Relay, sink: Sink) -> None:
    """A key written as '1' by another application (the Go mailer seed) suppresses the send."""
    import redis.asyncio as aredis

    client = aredis.Redis.from_url(relay.settings.store)
    await client.set(key_of(relay, "user@example.net"), "1", ex=60)
    await client.aclose()
    result = await send(relay.port, ["user@example.net"], message())
    assert result.code == 250 and "suppressed" in result.text
    assert sink.handler.transactions == 0


def test_policy_defaults_match_design() -> None:
    """The default policy is the one design.md §3 names (15 min lease, 24 h window)."""
    p = Policy()
    assert (p.lease_s, p.window_s, p.key_prefix) == (900.0, 86400.0, "email:fp:")
    assert (p.missing_key, p.unknown, p.store_down) == ("relay", "suppress", "fail_closed")


async def test_strip_dedupe_headers_removes_exactly_the_fields_read(
        make_relay: MakeRelay, sink: Sink) -> None:
    """strip_dedupe_headers: key and template fields (any case, folded, alias) leave; the rest,
    and a body line that looks like one, stay byte for byte; dedup works as before."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", strip_dedupe_headers=True)
    data = (b"From: app@example.com\r\nx-dedupe-key: K-1\r\n\tcontinued\r\n"
            b"Subject: hi\r\nX-TEMPLATE: welcome\r\nIdempotency-Key: I-1\r\n"
            b"X-Other: keep\r\n\r\nX-Dedupe-Key: in the body\r\n")
    first = await send(relay.port, ["user@example.net"], data)
    assert first.code == 250
    [delivered] = sink.handler.delivered
    assert delivered.content.endswith(
        b"From: app@example.com\r\nSubject: hi\r\nX-Other: keep\r\n\r\n"
        b"X-Dedupe-Key: in the body\r\n")
    assert b"K-1" not in delivered.content and b"I-1" not in delivered.content
    again = await send(relay.port, ["user@example.net"], data)
    assert again.code == 250 and "suppressed" in again.text
    assert len(sink.handler.delivered) == 1


MIME_WITHOUT_SEPARATOR = (
    b"From: app@example.com\r\nSubject: invoice\r\nX-Template: invoice\r\n"
    b"Content-Type: multipart/mixed; boundary=b1\r\n"
    b"--b1\r\nContent-Type: text/plain\r\nX-Dedupe-Key: part-key\r\n\r\n%s\r\n--b1--\r\n")


async def test_a_key_in_a_mime_part_after_a_missing_separator_suppresses_nothing(
        make_relay: MakeRelay, sink: Sink) -> None:
    """A body starting without the empty line is body: two messages whose first MIME parts
    carry one X-Dedupe-Key are both relayed, and that part reaches upstream even when the
    dedupe headers are stripped."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", strip_dedupe_headers=True)
    first = await send(relay.port, ["user@example.net"], MIME_WITHOUT_SEPARATOR % b"invoice 1")
    second = await send(relay.port, ["user@example.net"], MIME_WITHOUT_SEPARATOR % b"invoice 2")
    assert (first.code, second.code) == (250, 250)
    assert "suppressed" not in second.text
    assert len(sink.handler.delivered) == 2
    for copy in sink.handler.delivered:
        assert b"--b1\r\nContent-Type: text/plain\r\nX-Dedupe-Key: part-key\r\n" in copy.content
        assert b"X-Template: invoice" not in copy.content
