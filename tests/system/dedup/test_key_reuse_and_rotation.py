"""A key reused for other content and a rotated fingerprint secret, on real relays over real
SMTP (smtplib clients, a real aiosmtpd sink upstream), on each store: Redis, an embedded SQLite
file and PostgreSQL (a private schema).

- One relay answers a key reused for other content under each ``key_reuse`` value, one per
  template (``[[template_policy]]``): ``suppress`` (250, not relayed, counted and in the
  ledger), ``reject`` (550 5.7.1), ``relay`` (relayed, then the record is the new content's);
  a retry that differs only in a timestamp is no reuse (design.md §4.9).
- A message sent through a relay keyed with the old secret, its retry sent through a relay
  keyed with the new one and the old as ``fingerprint_secret_previous``: suppressed, one copy
  upstream (design.md §2.3).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.app import Relay
from relay.settings import TemplatePolicy
from tests.support.clients import SendResult, message, send
from tests.support.metrics import sample
from tests.support.postgres import private_schema, wait_ledger_rows
from tests.support.relays import REDIS_URL, MakeRelay
from tests.support.sink import Sink

JANE = "jane@example.net"
RECEIPT = "Thanks for order 1042. Shipped 2024-01-08 09:00 UTC."
RECEIPT_RETRIED = "Thanks for order 1042. Shipped 2024-01-08 09:04 UTC."
REFUND = "Your refund for order 1042 is on its way."


@pytest.fixture(params=["redis", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Each store's URL (Redis: the shared test server, under the relay's random prefix)."""
    if request.param == "postgres":
        with private_schema() as url:
            yield url
        return
    yield REDIS_URL if request.param == "redis" else f"sqlite:///{tmp_path}/fingerprints.db"


async def _sent(relay: Relay, body: str, template: str) -> SendResult:
    return await send(relay.port, [JANE], message(key="order-1042", template=template,
                                                  body=body), mail_from="shop@shop.example")


async def test_a_key_reused_for_other_content_under_each_key_reuse(
        make_relay: MakeRelay, sink: Sink, store: str, ledger_url: str) -> None:
    relay = await make_relay(
        upstream=f"127.0.0.1:{sink.port}", store=store, ledger=ledger_url,
        key_reuse="suppress", template_policy=(
            TemplatePolicy.model_validate({"match": "reject-*", "key_reuse": "reject"}),
            TemplatePolicy.model_validate({"match": "relay-*", "key_reuse": "relay"})))
    replies: dict[str, list[SendResult]] = {}
    for template in ("suppress-receipt", "reject-receipt", "relay-receipt"):
        replies[template] = [await _sent(relay, body, template)
                             for body in (RECEIPT, RECEIPT_RETRIED, REFUND, REFUND)]
    # the first send is relayed, the retry (another timestamp) is a duplicate
    for got in replies.values():
        assert [r.code for r in got[:2]] == [250, 250]
        assert "duplicate suppressed" in got[1].text
    suppress, reject, relay_ = (replies[t][2:] for t in replies)
    assert [r.code for r in suppress] == [250, 250]
    assert all("duplicate suppressed" in r.text for r in suppress)
    assert [r.code for r in reject] == [550, 550]
    assert all(r.text.startswith("5.7.1 Dedupe key already used for other content")
               for r in reject)
    assert relay_[0].code == 250 and "relayed 1" in relay_[0].text
    assert "duplicate suppressed" in relay_[1].text  # the record is the refund's now
    # upstream: each template's receipt once, and the refund once under relay
    assert sink.handler.copies_to(JANE) == 4
    for template, reused in (("suppress-receipt", 2), ("reject-receipt", 2),
                             ("relay-receipt", 1)):
        assert sample(relay.registry, "relay_key_reuse_total", template=template) == reused
    rows = await wait_ledger_rows(ledger_url, 12)
    assert [(r["template"], r["outcome"]) for r in rows if r["key_reused"]] == [
        ("suppress-receipt", "suppressed"), ("suppress-receipt", "suppressed"),
        ("reject-receipt", "refused_perm"), ("reject-receipt", "refused_perm"),
        ("relay-receipt", "relayed")]


async def test_a_secret_rotated_between_a_send_and_its_retry_is_suppressed(
        make_relay: MakeRelay, sink: Sink, store: str) -> None:
    """The first relay keeps the old secret; the second was started with the new one and the
    old one as previous (step 1 of the rotation): the retry through it is a duplicate, and a
    new message through it is recorded under the new secret's key only."""
    upstream = f"127.0.0.1:{sink.port}"
    before = await make_relay(upstream=upstream, store=store, fingerprint_secret="old secret")
    after = await make_relay(upstream=upstream, store=store,
                             store_prefix=before.settings.store_prefix,  # its random one
                             fingerprint_secret="new secret",
                             fingerprint_secret_previous="old secret")
    assert (await _sent(before, RECEIPT, "receipt")).code == 250
    retry = await _sent(after, RECEIPT, "receipt")
    assert retry.code == 250 and "duplicate suppressed" in retry.text, retry
    assert sink.handler.copies_to(JANE) == 1
    assert sample(after.registry, "relay_recipients_total", outcome="suppressed") == 1
    # another order after the rotation: relayed once, its retry a duplicate under the new key
    other = message(key="order-1043", template="receipt", body=RECEIPT)
    for code in (250, 250):
        assert (await send(after.port, [JANE], other)).code == code
    assert sink.handler.copies_to(JANE) == 2
    # the relay still on the old secret does not know the new key (why step 1 comes first)
    assert (await send(before.port, [JANE], other)).code == 250
    assert sink.handler.copies_to(JANE) == 3
