"""Dedup behaviour end to end: which copies reach upstream, and what the store holds.

Header normalization (folding, repeated and odd-case fields, blanks), recipient normalization,
many recipients, upstream failures and partial refusals, and the in-doubt timeout after the
final dot (design.md §2, §4), each against a real relay, real Redis and a real aiosmtpd sink.
Helpers come from tests/support/wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiosmtpd.smtp import SMTP, Envelope, Session

from relay.app import Relay
from relay.core import replies
from relay.core.interfaces import State
from tests.support.clients import RawClient, send
from tests.support.net import free_port
from tests.support.relays import MakeRelay
from tests.support.sink import Sink, SinkHandler
from tests.support.wire import (
    RCPT,
    assert_relayed_unchanged,
    codes,
    ehlo,
    msg,
    state_of,
    stored_keys,
    transaction,
)

# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


@dataclass
class PeerSinkHandler(SinkHandler):
    """A SinkHandler that also records the relay's source (host, port) of every MAIL."""

    mail_peers: list[Any] = field(default_factory=list)

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, options: list[str]) -> str:
        self.mail_peers.append(session.peer)
        return await super().handle_MAIL(server, session, envelope, address, options)


ServeSink = Callable[..., Awaitable[Sink]]


@pytest.fixture
async def serve_sink() -> AsyncIterator[ServeSink]:
    """Factory: ``await serve_sink(handler, port=0)`` serves ``handler`` like conftest's sink."""
    servers: list[asyncio.base_events.Server] = []

    async def serve(handler: SinkHandler, port: int = 0) -> Sink:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: SMTP(handler, hostname="sink.test", decode_data=False, enable_SMTPUTF8=True,
                         data_size_limit=50 * 1024 * 1024),
            host="127.0.0.1", port=port)
        servers.append(server)
        return Sink(handler=handler, port=server.sockets[0].getsockname()[1], server=server)

    yield serve
    for server in servers:
        server.close()


async def send_all(relay: Relay, messages: list[bytes], rcpt: str = RCPT) -> list[str]:
    """Send each message in its own transaction on one session; the final replies."""
    client, _ = await ehlo(relay.port)
    finals = []
    for data in messages:
        got = await transaction(client, [rcpt], data)
        assert codes(got) == [250, 250, 354, int(got[-1][:3])]
        finals.append(got[-1])
    await client.close()
    return finals


def relayed(reply: str) -> bool:
    """True for the 250 of a message that went upstream."""
    return reply.startswith("250 2.0.0 ") and "relayed 1" in reply


def suppressed(reply: str) -> bool:
    """True for the 250 of a message whose every recipient was a duplicate."""
    return reply.startswith("250 2.0.0 ") and "suppressed" in reply and "relayed" not in reply


# ------------------------------------------------------------------------------------------
# folded header values (RFC 5322 section 2.2.3)
# ------------------------------------------------------------------------------------------

ORD = "ORD-2024-000123-customer-00042-region-eu-west-channel-webshop-retry-0"


async def test_folded_key_matches_unfolded_key(relay: Relay, sink: Sink) -> None:
    """A key folded onto a continuation line hashes like its one-line twin: B is suppressed."""
    a = msg("X-Template: order-confirmation", "X-Dedupe-Key:", f" {ORD}")
    b = msg("X-Template: order-confirmation", f"X-Dedupe-Key: {ORD}")
    finals = await send_all(relay, [a, b], rcpt="buyer@example.net")
    assert relayed(finals[0]) and suppressed(finals[1])
    [delivered] = sink.handler.delivered
    assert_relayed_unchanged(delivered, a)
    assert await state_of(relay, "buyer@example.net", "order-confirmation", ORD) is State.SENT


async def test_tab_folded_value_matches_single_line(relay: Relay, sink: Sink) -> None:
    """C folded with a TAB and D on one line share a fingerprint; C goes upstream byte-exact."""
    c = msg("X-Template: order confirmation", "X-Dedupe-Key: order 123 for", "\tcustomer 42")
    d = msg("X-Template: order confirmation", "X-Dedupe-Key: order 123 for customer 42")
    finals = await send_all(relay, [c, d], rcpt="buyer@example.net")
    assert relayed(finals[0]) and suppressed(finals[1])
    [delivered] = sink.handler.delivered
    assert_relayed_unchanged(delivered, c)
    assert b"X-Dedupe-Key: order 123 for\r\n\tcustomer 42\r\n" in delivered.content
    assert await state_of(relay, "buyer@example.net", "order confirmation",
                          "order 123 for customer 42") is State.SENT


# ------------------------------------------------------------------------------------------
# two X-Dedupe-Key fields: a set of values (design.md §2)
# ------------------------------------------------------------------------------------------


async def test_every_occurrence_forms_the_key_set(relay: Relay, sink: Sink) -> None:
    """Sent B, A, C, D: B and A relayed, C (same set as A) and D (same as B) suppressed."""
    a = msg("X-Template: digest", "X-Dedupe-Key: K-1", "X-Dedupe-Key: K-2")
    b = msg("X-Template: digest", "X-Dedupe-Key: K-1")
    c = msg("X-Template: digest", "X-Dedupe-Key: K-2", "X-Dedupe-Key: K-1")
    d = msg("X-Template: digest", "X-Dedupe-Key: K-1", "X-Dedupe-Key: K-1")
    finals = await send_all(relay, [b, a, c, d])
    assert [relayed(f) for f in finals] == [True, True, False, False]
    assert suppressed(finals[2]) and suppressed(finals[3])
    assert len(sink.handler.delivered) == 2
    assert_relayed_unchanged(sink.handler.delivered[1], a)
    assert await state_of(relay, RCPT, "digest", "K-1") is State.SENT
    assert await state_of(relay, RCPT, "digest", "K-1\x1fK-2") is State.SENT
    assert await state_of(relay, RCPT, "digest", "K-2") is State.ABSENT


# ------------------------------------------------------------------------------------------
# header field names in odd case (RFC 5322 section 1.2.2)
# ------------------------------------------------------------------------------------------


async def test_header_names_match_in_any_case(relay: Relay, sink: Sink) -> None:
    """X-Dedupe-Key, x-dedupe-key and X-Dedupe-KEY name one field: B and C are suppressed."""
    a = msg("X-Template: t-1", "X-Dedupe-Key: k-1")
    b = msg("x-template: t-1", "x-dedupe-key: k-1")
    c = msg("X-TEMPLATE: t-1", "X-Dedupe-KEY: k-1")
    finals = await send_all(relay, [a, b, c])
    assert relayed(finals[0]) and suppressed(finals[1]) and suppressed(finals[2])
    assert len(sink.handler.delivered) == 1
    assert await state_of(relay, RCPT, "t-1", "k-1") is State.SENT


async def test_field_name_spelling_reaches_upstream_unchanged(
    relay: Relay, sink: Sink
) -> None:
    """A message with lower-case field names is relayed with their spelling kept."""
    b = msg("x-template: t-1", "x-dedupe-key: k-1")
    finals = await send_all(relay, [b])
    assert relayed(finals[0])
    assert_relayed_unchanged(sink.handler.delivered[0], b)
    assert b"\r\nx-dedupe-key: k-1\r\n" in sink.handler.delivered[0].content
    assert await state_of(relay, RCPT, "t-1", "k-1") is State.SENT


async def test_underscore_name_is_not_the_key_field(relay: Relay, sink: Sink) -> None:
    """X-Dedupe_Key is another field: the message has no key and is relayed every time."""
    d = msg("X-Template: t-1", "X-Dedupe_Key: k-1")
    finals = await send_all(relay, [d, d])
    assert all(f.startswith("250 2.0.0 ") and "relayed 1" in f for f in finals)
    assert len(sink.handler.delivered) == 2
    assert await stored_keys(relay) == []


async def test_case_variants_in_one_message_are_two_occurrences(
    relay: Relay, sink: Sink
) -> None:
    """X-Dedupe-Key: k-1 plus x-dedupe-key: k-2 is the set {k-1, k-2} (design.md §2)."""
    e = msg("X-Template: t-1", "X-Dedupe-Key: k-1", "x-dedupe-key: k-2")
    f = msg("X-Template: t-1", "X-DEDUPE-KEY: k-2", "X-Dedupe-Key: k-1")
    finals = await send_all(relay, [e, f])
    assert relayed(finals[0]) and suppressed(finals[1])
    assert len(sink.handler.delivered) == 1
    assert await state_of(relay, RCPT, "t-1", "k-1\x1fk-2") is State.SENT
    assert await state_of(relay, RCPT, "t-1", "k-1") is State.ABSENT


# ------------------------------------------------------------------------------------------
# blanks around header values (design.md §2)
# ------------------------------------------------------------------------------------------


async def test_blank_variants_share_a_fingerprint(relay: Relay, sink: Sink) -> None:
    """K-77 with trailing blanks, no blank or tabs around it is one key: B, C, D suppressed."""
    variants = [b"X-Dedupe-Key: K-77", b"X-Dedupe-Key: K-77   ", b"X-Dedupe-Key:K-77",
                b"X-Dedupe-Key:\tK-77\t"]
    finals = await send_all(relay, [msg("X-Template: statement", v) for v in variants])
    assert relayed(finals[0])
    assert all(suppressed(f) for f in finals[1:])
    assert len(sink.handler.delivered) == 1
    assert await state_of(relay, RCPT, "statement", "K-77") is State.SENT


async def test_relayed_header_keeps_its_blanks(relay: Relay, sink: Sink) -> None:
    """A relayed key header keeps its tabs and trailing blanks byte for byte."""
    d = msg("X-Template: statement", b"X-Dedupe-Key:\tK-77\t", b"X-Note: x   ")
    finals = await send_all(relay, [d])
    assert relayed(finals[0])
    assert_relayed_unchanged(sink.handler.delivered[0], d)
    assert b"\r\nX-Dedupe-Key:\tK-77\t\r\nX-Note: x   \r\n" in sink.handler.delivered[0].content
    assert await state_of(relay, RCPT, "statement", "K-77") is State.SENT


async def test_inner_blank_runs_collapse(relay: Relay, sink: Sink) -> None:
    """K<SP>77 and K<SP><SP>77 share a fingerprint that differs from K-77's."""
    finals = await send_all(relay, [msg("X-Template: statement", "X-Dedupe-Key: K-77"),
                                    msg("X-Template: statement", "X-Dedupe-Key: K 77"),
                                    msg("X-Template: statement", "X-Dedupe-Key: K  77")])
    assert relayed(finals[0]) and relayed(finals[1]) and suppressed(finals[2])
    assert len(sink.handler.delivered) == 2
    assert await state_of(relay, RCPT, "statement", "K 77") is State.SENT


async def test_blank_only_key_is_not_deduplicated(relay: Relay, sink: Sink) -> None:
    """X-Dedupe-Key holding only blanks counts as no key: relayed every time, nothing stored."""
    e = msg("X-Template: statement", b"X-Dedupe-Key:  ")
    finals = await send_all(relay, [e, e])
    assert all(f.startswith("250 2.0.0 ") and "relayed 1" in f for f in finals)
    assert len(sink.handler.delivered) == 2
    assert_relayed_unchanged(sink.handler.delivered[1], e)
    assert await stored_keys(relay) == []


# ------------------------------------------------------------------------------------------
# upper-case letters in the recipient (RFC 5321 section 2.4, design.md §2)
# ------------------------------------------------------------------------------------------

ALERT = msg("X-Template: alert", "X-Dedupe-Key: A-1")
JOHNS = ["John.Doe@Example.COM", "john.doe@example.com", "JOHN.DOE@EXAMPLE.COM"]


async def test_recipient_case_variants_are_one_recipient_by_default(
    relay: Relay, sink: Sink
) -> None:
    """T1 goes upstream spelt as sent; T2 and T3 are its duplicates under the default policy."""
    results = [await send(relay.port, [rcpt], ALERT) for rcpt in JOHNS]
    assert [r.code for r in results] == [250, 250, 250]
    assert relayed(f"{results[0].code} {results[0].text}")
    assert all(suppressed(f"{r.code} {r.text}") for r in results[1:])
    assert sink.handler.rcpt_commands == ["John.Doe@Example.COM"]
    assert await state_of(relay, "john.doe@example.com", "alert", "A-1") is State.SENT


async def test_case_sensitive_policy_relays_each_spelling(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """With local_part_case_sensitive, three spellings of the local part are three recipients."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", local_part_case_sensitive=True)
    results = [await send(relay.port, [rcpt], ALERT) for rcpt in JOHNS]
    assert all(relayed(f"{r.code} {r.text}") for r in results)
    assert sink.handler.rcpt_commands == JOHNS
    for rcpt in JOHNS:
        assert await state_of(relay, rcpt, "alert", "A-1") is State.SENT


@pytest.mark.parametrize("case_sensitive", [False, True])
async def test_postmaster_is_case_insensitive_in_every_policy(
    make_relay: MakeRelay, sink: Sink, case_sensitive: bool
) -> None:
    """RCPT TO:<Postmaster> is accepted and relayed; <postmaster> then is its duplicate."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}",
                             local_part_case_sensitive=case_sensitive)
    client, _ = await ehlo(relay.port)
    first = await transaction(client, ["Postmaster"], ALERT)
    second = await transaction(client, ["postmaster"], ALERT)
    await client.close()
    assert first[1] == str(replies.RECIPIENT_OK)
    assert relayed(first[-1]) and suppressed(second[-1])
    assert sink.handler.rcpt_commands == ["Postmaster"]
    assert await state_of(relay, "POSTMASTER", "alert", "A-1") is State.SENT


async def test_postmaster_without_brackets_is_501(relay: Relay, sink: Sink) -> None:
    """RCPT TO:Postmaster (no angle brackets) gets 501 5.5.4 and adds no recipient."""
    client, _ = await ehlo(relay.port)
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250 ")
    assert await client.cmd("RCPT TO:Postmaster") == str(replies.PATH_NEEDS_BRACKETS)
    assert (await client.cmd("DATA")).startswith("503 5.5.1 ")
    await client.close()
    assert sink.handler.transactions == 0


# ------------------------------------------------------------------------------------------
# 100 and more recipients (RFC 5321 section 4.5.3.1.8)
# ------------------------------------------------------------------------------------------

MW = ("X-Template: maintenance-window", "X-Dedupe-Key: MW-2024-10")


def users(first: int, last: int) -> list[str]:
    """user001@example.net ... for the inclusive range."""
    return [f"user{n:03d}@example.net" for n in range(first, last + 1)]


def folded_to(rcpts: list[str]) -> bytes:
    """A To: header listing ``rcpts``, folded one address per line."""
    return b"To: " + b",\r\n ".join(r.encode() for r in rcpts)


async def test_excess_recipients_get_452_and_known_ones_are_left_out(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """150 RCPTs at limit 100: 452 4.5.3 past 100; upstream gets user031-100; resend all 50."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", max_recipients=100)
    seed = await send(relay.port, users(1, 30), msg(*MW))
    assert seed.code == 250 and "relayed 30" in seed.text
    sink.handler.delivered.clear()
    data = msg(folded_to(users(1, 150)), *MW, body=b"body")
    result = await send(relay.port, users(1, 150), data)
    assert result.code == 250
    assert "relayed 70" in result.text and "suppressed 30" in result.text
    assert sorted(result.rcpt_refused) == users(101, 150)
    for code, text in result.rcpt_refused.values():
        assert (code, text) == (replies.TOO_MANY_RECIPIENTS.code, replies.TOO_MANY_RECIPIENTS.text)
    [delivered] = sink.handler.delivered
    assert delivered.rcpt_tos == users(31, 100)
    assert_relayed_unchanged(delivered, data)
    for rcpt in ("user031@example.net", "user100@example.net"):
        assert await state_of(relay, rcpt, "maintenance-window", "MW-2024-10") is State.SENT
    assert await state_of(relay, "user101@example.net", "maintenance-window",
                          "MW-2024-10") is State.ABSENT
    rest = await send(relay.port, users(101, 150), data)
    assert rest.code == 250 and "relayed 50" in rest.text
    assert sink.handler.delivered[1].rcpt_tos == users(101, 150)


async def test_all_duplicates_open_no_upstream_transaction(
    relay: Relay, sink: Sink
) -> None:
    """When every accepted recipient is a duplicate, no upstream transaction, and still 250."""
    assert (await send(relay.port, users(1, 100), msg(*MW))).code == 250
    before = sink.handler.transactions
    again = await send(relay.port, users(1, 100), msg(*MW))
    assert again.code == 250 and "suppressed for 100" in again.text
    assert sink.handler.transactions == before == 1


async def test_upstream_452_for_part_of_the_list(relay: Relay, sink: Sink) -> None:
    """Upstream 452 for user051-100: the rest is sent later or the client gets a 4yz to retry."""
    for rcpt in users(51, 100):
        sink.handler.rcpt_plan[rcpt] = deque(["452 4.5.3 Too many recipients"])
    first = await send(relay.port, users(1, 100), msg(*MW))
    if first.code == 250:  # the relay sent the refused part in a further upstream transaction
        assert sorted(r for d in sink.handler.delivered for r in d.rcpt_tos) == users(1, 100)
    else:
        # design.md §4.2 passes the upstream's 4yz through (452) rather than a 451 of its own
        assert first.code in (451, 452) and first.text.startswith("4.")
        assert [d.rcpt_tos for d in sink.handler.delivered] == [users(1, 50)]
        assert await state_of(relay, "user051@example.net", "maintenance-window",
                              "MW-2024-10") is State.ABSENT
        retry = await send(relay.port, users(1, 100), msg(*MW))
        assert retry.code == 250 and "relayed 50" in retry.text
        assert sink.handler.delivered[1].rcpt_tos == users(51, 100)
    for rcpt in ("user001@example.net", "user100@example.net"):
        assert await state_of(relay, rcpt, "maintenance-window", "MW-2024-10") is State.SENT


# ------------------------------------------------------------------------------------------
# upstream 4yz/5yz and network errors (design.md §4.2)
# ------------------------------------------------------------------------------------------

REMINDER = msg("X-Template: reminder", "X-Dedupe-Key: E-5")


async def test_unreachable_upstream_is_451_and_retry_goes_upstream(
    make_relay: MakeRelay, serve_sink: ServeSink
) -> None:
    """Connection refused gives 451 4.4.1, no key; once upstream is back the retry is relayed."""
    port = free_port()
    relay = await make_relay(upstream=f"127.0.0.1:{port}")
    first = await send(relay.port, [RCPT], REMINDER)
    assert (first.code, first.text) == (451, replies.UPSTREAM_UNREACHABLE.text)
    assert await stored_keys(relay) == []
    sink = await serve_sink(SinkHandler(), port=port)
    retry = await send(relay.port, [RCPT], REMINDER)
    assert retry.code == 250 and "relayed 1" in retry.text
    assert len(sink.handler.delivered) == 1
    assert await state_of(relay, RCPT, "reminder", "E-5") is State.SENT


@pytest.mark.parametrize(("upstream_reply", "code"), [
    ("451 4.3.0 Try again later", 451),
    ("550 5.7.1 Message rejected", 550),
], ids=["451-after-the-dot", "550-after-the-dot"])
async def test_refusal_after_dot_keeps_class_and_retry_is_relayed(
    relay: Relay, sink: Sink, upstream_reply: str, code: int
) -> None:
    """An upstream 451/550 after the dot reaches the client in its class; no key; retry relayed."""
    sink.handler.data_plan.append(upstream_reply)
    first = await send(relay.port, [RCPT], REMINDER)
    assert first.code == code
    assert first.text.startswith(upstream_reply[4:10])
    assert sink.handler.delivered == []
    assert await state_of(relay, RCPT, "reminder", "E-5") is State.ABSENT
    retry = await send(relay.port, [RCPT], REMINDER)
    assert retry.code == 250 and "relayed 1" in retry.text
    assert len(sink.handler.delivered) == 1
    assert sink.handler.transactions == 2
    assert await state_of(relay, RCPT, "reminder", "E-5") is State.SENT


async def test_upstream_421_at_mail_is_451_and_that_connection_is_not_reused(
    make_relay: MakeRelay, serve_sink: ServeSink
) -> None:
    """Upstream 421 to MAIL gives the client 451; the retry runs on a new upstream connection."""
    handler = PeerSinkHandler(mail_plan=deque(["421 4.7.0 Closing connection"]))
    sink = await serve_sink(handler)
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    first = await send(relay.port, [RCPT], REMINDER)
    assert first.code == 451 and first.text.startswith("4.7.0")
    assert await state_of(relay, RCPT, "reminder", "E-5") is State.ABSENT
    retry = await send(relay.port, [RCPT], REMINDER)
    assert retry.code == 250 and "relayed 1" in retry.text
    assert len(handler.delivered) == 1
    assert len(handler.mail_peers) == 2 and handler.mail_peers[0] != handler.mail_peers[1]


# ------------------------------------------------------------------------------------------
# upstream refuses some recipients (design.md §4.5)
# ------------------------------------------------------------------------------------------

INVITE = msg("X-Template: invite", "X-Dedupe-Key: P-1", body=b"body")
ABC = ["a@example.net", "b@example.net", "c@example.net"]


async def test_partial_refusal_is_4yz_then_retry_sends_only_the_rest(
    relay: Relay, sink: Sink
) -> None:
    """a 250, b 550, c 450: 4yz and a key for a only; the retry sends b and c, c is committed."""
    sink.handler.rcpt_plan["b@example.net"] = deque(["550 5.1.1 User unknown"] * 2)
    sink.handler.rcpt_plan["c@example.net"] = deque(["450 4.2.1 Mailbox busy"])
    first = await send(relay.port, ABC, INVITE)
    assert 400 <= first.code < 500 and first.text.startswith("4.2.1")
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["a@example.net"]]
    states = [await state_of(relay, r, "invite", "P-1") for r in ABC]
    assert states == [State.SENT, State.ABSENT, State.ABSENT]
    sink.handler.rcpt_commands.clear()
    retry = await send(relay.port, ABC, INVITE)
    assert retry.code == 250
    assert "relayed 1" in retry.text and "suppressed 1" in retry.text
    assert "refused permanently 1" in retry.text
    rcpts = [r for r in sink.handler.rcpt_commands if r != "app@example.com"]  # DSN's RCPT
    assert rcpts == ["b@example.net", "c@example.net"]
    relayed = [d.rcpt_tos for d in sink.handler.delivered if d.mail_from != "<>"]  # not the DSN
    assert relayed == [["a@example.net"], ["c@example.net"]]
    assert sink.handler.copies_to("a@example.net") == 1
    states = [await state_of(relay, r, "invite", "P-1") for r in ABC]
    assert states == [State.SENT, State.ABSENT, State.SENT]


async def test_every_remaining_recipient_refused_permanently_is_5xx(
    relay: Relay, sink: Sink
) -> None:
    """When every non-duplicate recipient is refused permanently, the client gets that 5yz."""
    sink.handler.rcpt_plan["b@example.net"] = deque(["550 5.1.1 User unknown"])
    assert (await send(relay.port, ["a@example.net"], INVITE)).code == 250
    result = await send(relay.port, ["a@example.net", "b@example.net"], INVITE)
    assert result.code == 550 and result.text.startswith("5.1.1")
    assert sink.handler.copies_to("a@example.net") == 1
    assert sink.handler.copies_to("b@example.net") == 0
    assert await state_of(relay, "b@example.net", "invite", "P-1") is State.ABSENT


# ------------------------------------------------------------------------------------------
# upstream slow after the final dot: in doubt (RFC 1047, design.md §4.4)
# ------------------------------------------------------------------------------------------

CONTRACT = msg("X-Template: contract", "X-Dedupe-Key: T-3", body=b"terms")


async def test_no_reply_after_dot_is_451_in_doubt_and_retry_follows_policy(
    make_relay: MakeRelay, serve_sink: ServeSink
) -> None:
    """No reply to the dot: 451 4.4.2, UNKNOWN (not SENT), retry suppressed, no conn reuse."""
    handler = PeerSinkHandler(hang_after_dot_s=1.5)
    sink = await serve_sink(handler)
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_timeout=0.5)
    first = await send(relay.port, [RCPT], CONTRACT)
    assert (first.code, first.text) == (451, replies.OUTCOME_UNKNOWN.text)
    assert await state_of(relay, RCPT, "contract", "T-3") is State.UNKNOWN
    handler.hang_after_dot_s = 0.0
    # design.md §4.4 makes `unknown_policy = suppress` the default (at most once; §7 says why
    # `send`, at least once, is only an option), so the retry is answered 250 unsent.
    retry = await send(relay.port, [RCPT], CONTRACT)
    assert retry.code == 250 and "suppressed" in retry.text
    assert handler.transactions == 1
    assert await state_of(relay, RCPT, "contract", "T-3") is State.UNKNOWN
    other = await send(relay.port, [RCPT], msg("X-Template: contract", "X-Dedupe-Key: T-4"))
    assert other.code == 250 and "relayed 1" in other.text
    assert len(handler.mail_peers) == 2 and handler.mail_peers[0] != handler.mail_peers[1]


async def test_hold_policy_answers_4yz_while_in_doubt(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """With unknown_policy=hold the retry of an in-doubt message gets 451 4.4.2, not relayed."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_timeout=0.5,
                             unknown_policy="hold")
    sink.handler.hang_after_dot_s = 1.5
    first = await send(relay.port, [RCPT], CONTRACT)
    sink.handler.hang_after_dot_s = 0.0
    retry = await send(relay.port, [RCPT], CONTRACT)
    assert (first.code, first.text) == (451, replies.OUTCOME_UNKNOWN.text)
    assert (retry.code, retry.text) == (451, replies.HELD_UNKNOWN.text)
    assert sink.handler.transactions == 1
    assert await state_of(relay, RCPT, "contract", "T-3") is State.UNKNOWN


async def test_send_policy_relays_the_retry_and_counts_a_possible_duplicate(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """With unknown_policy=send (at least once) the retry is relayed and counted.

    The second delivery settles the fingerprint SENT, so a third attempt is a true duplicate.
    """
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", upstream_timeout=0.5,
                             unknown_policy="send")
    sink.handler.hang_after_dot_s = 1.5
    first = await send(relay.port, [RCPT], CONTRACT)
    assert (first.code, first.text) == (451, replies.OUTCOME_UNKNOWN.text)
    assert await state_of(relay, RCPT, "contract", "T-3") is State.UNKNOWN
    sink.handler.hang_after_dot_s = 0.0
    retry = await send(relay.port, [RCPT], CONTRACT)
    assert retry.code == 250 and "relayed 1" in retry.text
    assert sink.handler.copies_to(RCPT) == 2  # the hung one was delivered too: at least once
    assert relay.registry.get_sample_value("relay_unknown_resent_total") == 1.0
    assert await state_of(relay, RCPT, "contract", "T-3") is State.SENT
    third = await send(relay.port, [RCPT], CONTRACT)
    assert third.code == 250 and "suppressed" in third.text and "in doubt" not in third.text
    assert sink.handler.copies_to(RCPT) == 2
    assert relay.registry.get_sample_value("relay_unknown_resent_total") == 1.0


async def test_silent_upstream_fails_within_the_connect_timeout(
    make_relay: MakeRelay,
) -> None:
    """An upstream that accepts TCP but never greets gives 451 4.4.2 within the connect timeout."""
    received = bytearray()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(1024):
                received.extend(chunk)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        relay = await make_relay(upstream=f"127.0.0.1:{port}", upstream_connect_timeout=0.5)
        started = time.monotonic()
        result = await send(relay.port, [RCPT], CONTRACT)
        elapsed = time.monotonic() - started
        assert (result.code, result.text) == (451, replies.UPSTREAM_TIMEOUT.text)
        assert elapsed < 2.0
        assert bytes(received) == b""
        assert await state_of(relay, RCPT, "contract", "T-3") is State.ABSENT
    finally:
        server.close()


async def test_client_waiting_for_a_slow_upstream_is_not_timed_out(
    make_relay: MakeRelay, sink: Sink
) -> None:
    """The idle timer does not cut off a client waiting for a slow upstream final reply."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", client_timeout=1.0)
    sink.handler.delay_s = 1.5
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO legacy.example.com")
    got = await transaction(client, [RCPT], CONTRACT)
    await client.close()
    assert codes(got) == [250, 250, 354, 250]
    assert len(sink.handler.delivered) == 1
    assert await state_of(relay, RCPT, "contract", "T-3") is State.SENT
