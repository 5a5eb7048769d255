"""``[[key_rule]]`` on a real relay (design.md §2.1): a real Redis, a real aiosmtpd sink
upstream, smtplib clients sending what Django's ``send_mail`` sends (no key header; a new
Date and Message-ID on every retry). A subject rule and a content rule deduplicate the retry,
a shadow rule counts without suppressing, a miss is relayed and counted; the ledger row and
the decision line say where the key came from; ``explain`` on the saved message gives the
store key the relay used; an invalid rule stops ``check-config`` and ``serve`` with 78."""

from __future__ import annotations

import email.utils
import json
import logging
import subprocess
import sys
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis

from relay.app import Relay
from relay.settings import KeyRuleEntry
from tests.support.clients import send
from tests.support.metrics import sample
from tests.support.postgres import wait_ledger_rows
from tests.support.relays import REDIS_URL, MakeRelay
from tests.support.sink import Sink

JANE = "jane@example.net"
SHOP = "shop@shop.example"


def django_mail(subject: str, body: str, *, cte: str = "7bit") -> bytes:
    """What Django's ``send_mail(subject, body, SHOP, [JANE])`` hands its SMTP backend: a
    text/plain UTF-8 message with a fresh Date and Message-ID, no other header."""
    msg = EmailMessage()
    msg["Subject"] = subject
    msg["From"] = SHOP
    msg["To"] = JANE
    msg["Date"] = email.utils.formatdate(localtime=True)
    msg["Message-ID"] = email.utils.make_msgid(domain="app.example")
    msg.set_content(body, charset="utf-8", cte=cte)
    return msg.as_bytes(policy=msg.policy.clone(linesep="\r\n"))


def rules(*entries: dict[str, Any]) -> tuple[KeyRuleEntry, ...]:
    return tuple(KeyRuleEntry.model_validate(entry) for entry in entries)


ORDERS = {"name": "orders", "match": {"sender": "*@shop.example"},
          "key": r"subject:Order #(\d+)", "template": "receipt"}


def counted(relay: Relay, outcome: str) -> float:
    return sample(relay.registry, "relay_recipients_total", outcome=outcome)


async def test_a_django_send_mail_retried_is_deduplicated_by_a_subject_rule(
        make_relay: MakeRelay, sink: Sink, ledger_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """The retry (new Date, new Message-ID) is suppressed; another order is relayed; the
    ledger rows and the decision lines say ``rule:orders``."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", key_rule=rules(ORDERS),
                             ledger=ledger_url)
    caplog.set_level(logging.INFO, logger="relay.smtp")
    first = django_mail("Your receipt for Order #1042", "Thanks, 2024-01-02 10:00")
    retry = django_mail("Your receipt for Order #1042", "Thanks, 2024-01-02 10:05")
    other = django_mail("Your receipt for Order #1043", "Thanks")
    for content in (first, retry, other):
        assert (await send(relay.port, [JANE], content, mail_from=SHOP)).code == 250
    assert sink.handler.copies_to(JANE) == 2
    assert counted(relay, "suppressed") == 1
    rows = await wait_ledger_rows(ledger_url, 3)
    assert [(r["outcome"], r["key_source"], r["template"]) for r in rows] == [
        ("relayed", "rule:orders", "receipt"), ("suppressed", "rule:orders", "receipt"),
        ("relayed", "rule:orders", "receipt")]
    lines = [r for r in caplog.records if r.getMessage() == "message"]
    assert [getattr(r, "key_source", None) for r in lines] == ["rule:orders"] * 3


async def test_a_content_rule_sees_through_a_timestamp_and_a_tracking_token(
        make_relay: MakeRelay, sink: Sink) -> None:
    """Two sends differing only in a timestamp and a tracking link's token (quoted-printable)
    are one message; a changed text is another."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", key_rule=rules(
        {"name": "reports", "match": {"subject": "^Weekly report"}, "key": "content",
         "template": "subject"}))

    def report(at: str, token: str, total: int) -> bytes:
        return django_mail("Weekly report", f"Generated {at}.\nTotal: {total} €\n"
                           f"Open https://app.example/r?tk={token}\n", cte="quoted-printable")

    sent = [await send(relay.port, [JANE], content, mail_from=SHOP) for content in (
        report("2024-01-08T09:00:00Z", "a8F3kLmN0pQ2rS4tU6vW", 12),
        report("2024-01-08T09:03:41Z", "Zx9Yw8Vu7Ts6Rq5Po4Nm", 12),
        report("2024-01-08T09:04:00Z", "Qq1Ww2Ee3Rr4Tt5Yy6Uu", 13))]
    assert [s.code for s in sent] == [250, 250, 250]
    assert sink.handler.copies_to(JANE) == 2
    assert counted(relay, "suppressed") == 1


async def test_a_shadow_rule_counts_without_suppressing(
        make_relay: MakeRelay, sink: Sink) -> None:
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}",
                             key_rule=rules({**ORDERS, "mode": "shadow"}))
    content = django_mail("Order #7 shipped", "On its way")
    for _ in range(2):
        assert (await send(relay.port, [JANE], content, mail_from=SHOP)).code == 250
    assert sink.handler.copies_to(JANE) == 2
    assert counted(relay, "would_suppress") == 1
    assert counted(relay, "suppressed") == 0


async def test_a_rule_that_derives_nothing_relays_and_counts_a_miss(
        make_relay: MakeRelay, sink: Sink) -> None:
    """The sender matches, the Subject holds no order number: relayed every time without
    dedup (``no_key``), each counted in ``relay_key_rule_misses_total{rule}``; a message the
    rule does not match is no miss."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", key_rule=rules(ORDERS))
    assert sample(relay.registry, "relay_key_rule_misses_total", rule="orders") == 0
    content = django_mail("Your password was changed", "Hello")
    for _ in range(2):
        assert (await send(relay.port, [JANE], content, mail_from=SHOP)).code == 250
    assert (await send(relay.port, [JANE], content, mail_from="x@other.example")).code == 250
    assert sink.handler.copies_to(JANE) == 3
    assert counted(relay, "no_key") == 3
    assert sample(relay.registry, "relay_key_rule_misses_total", rule="orders") == 2


async def test_a_rule_added_by_a_reload_has_its_miss_counter_at_0(
        make_relay: MakeRelay, sink: Sink) -> None:
    """A relay started without rules; a reload adds one: its
    ``relay_key_rule_misses_total{rule}`` is exported at 0 at once (as at start), then counts
    the next message's miss."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}")
    misses = ("relay_key_rule_misses_total", {"rule": "orders"})
    assert relay.registry.get_sample_value(*misses) is None
    await relay.apply(relay.settings.model_copy(update={"key_rule": rules(ORDERS)}),
                      {"key_rule"})
    assert relay.registry.get_sample_value(*misses) == 0
    content = django_mail("Your password was changed", "Hello")
    assert (await send(relay.port, [JANE], content, mail_from=SHOP)).code == 250
    assert sample(relay.registry, "relay_key_rule_misses_total", rule="orders") == 1


async def test_an_explicit_key_header_wins_over_a_rule(
        make_relay: MakeRelay, sink: Sink) -> None:
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", key_rule=rules(ORDERS))
    for key in ("K-1", "K-2"):
        content = django_mail("Order #5", "x").replace(b"Subject:", f"X-Dedupe-Key: {key}\r\n"
                                                       "Subject:".encode(), 1)
        assert (await send(relay.port, [JANE], content, mail_from=SHOP)).code == 250
    assert sink.handler.copies_to(JANE) == 2  # the rule would have made them one


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "relay", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


async def test_explain_on_a_saved_message_gives_the_store_key_the_relay_reserved(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path) -> None:
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", key_rule=rules(ORDERS))
    saved = tmp_path / "receipt.eml"
    saved.write_bytes(django_mail("Your receipt for Order #2001", "Thanks"))
    assert (await send(relay.port, [JANE], saved.read_bytes(), mail_from=SHOP)).code == 250
    config = tmp_path / "relay.toml"
    config.write_text(f'store_prefix = "{relay.settings.store_prefix}"\n'
                      "[[key_rule]]\nname = \"orders\"\nmatch = { sender = \"*@shop.example\" }\n"
                      "key = 'subject:Order #(\\d+)'\ntemplate = \"receipt\"\n")
    done = _cli("explain", "--config", str(config), str(saved), "--rcpt", JANE, "--json",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["source"] == "rule:orders (mode enforce)"
    assert (found["template"], found["key"], found["sender"]) == ("receipt", "2001", SHOP)
    client = aredis.Redis.from_url(REDIS_URL)
    try:
        stored = [key.decode() async for key in
                  client.scan_iter(match=relay.settings.store_prefix + "*")]
    finally:
        await client.aclose()
    assert stored == [found["store_keys"][JANE]]
    text = _cli("explain", "--config", str(config), str(saved), cwd=tmp_path)
    assert "source: rule:orders" in text.stdout and f"store key of {JANE}:" in text.stdout


@pytest.mark.parametrize(("rule", "words"), [
    ('name = "billing"\nkey = \'subject:Invoice \\d+\'', "needs a capture group"),
    ('name = "billing"\nkey = \'body:(unclosed\'', "is not a valid pattern"),
    ('name = "billing"\nkey = "content"\n[[key_rule]]\nname = "billing"\nkey = "content"',
     "two rules have this name"),
])
def test_an_invalid_rule_stops_check_config_naming_it(
        tmp_path: Path, rule: str, words: str) -> None:
    config = tmp_path / "relay.toml"
    config.write_text(f'upstream = "127.0.0.1:1"\n[[key_rule]]\n{rule}\n')
    done = _cli("check-config", "--config", str(config), cwd=tmp_path)
    assert done.returncode == 78, done.stderr
    assert "key_rule 'billing'" in done.stderr and words in done.stderr, done.stderr


def test_an_invalid_rule_stops_serve_before_it_listens(tmp_path: Path) -> None:
    config = tmp_path / "relay.toml"
    config.write_text('upstream = "127.0.0.1:1"\n[[key_rule]]\nname = "billing"\n'
                      "key = 'subject:(?<open'\n")
    done = _cli("serve", "--listen", "127.0.0.1:0", "--config", str(config), cwd=tmp_path)
    assert done.returncode == 78, done.stderr
    assert "key_rule 'billing'" in done.stderr and "is not a valid pattern" in done.stderr
