"""Reconciliation end to end against a real private Postfix smarthost
(tests/support/smarthosts.py: it discards what it queues, and its header_checks REJECT a
message carrying the refusal header), with a proxy between the relay and Postfix that loses
the smarthost's reply to the final dot, or the dot itself (tests/support/reply_dropping_proxy.py).
A served relay (PostgreSQL ledger, SQLite store) reads Postfix's own log (``postfix_log``,
``maillog_file``) every second:

- Postfix queued it, its reply lost: marked sent; the retry is an ordinary duplicate; the
  ledger row holds Postfix's log line; counted ``sent``;
- Postfix refused it at end of data, its reply lost: released; the retry is relayed (and
  refused by Postfix again, now heard);
- a message without a Message-ID gets one and is reconciled the same way;
- a Message-ID reused by a second attempt seconds later: the first attempt's acceptance,
  logged before the second's dot, is not about it; its refusal releases it;
- the dot lost on the way: Postfix never queued it; it stays in doubt until the give-up bound,
  then one ``reconcile_given_up`` row.

How long each took (from the relay's in-doubt answer to the reconciler's row) is printed (run
with ``-s``). Runs once the Postfix source (relay/reconcile/postfix.py) and the private
smarthosts are there, as root with Debian's postfix."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import postfix
from tests.support.clients import message, send
from tests.support.metrics import scrape
from tests.support.net import free_port
from tests.support.postgres import ledger_rows
from tests.support.relays import ServeProcess, start_serve
from tests.support.reply_dropping_proxy import ReplyDroppingProxy, serve_proxy
from tests.support.waiting import until

pytest.importorskip("relay.reconcile.postfix")
smarthosts = pytest.importorskip("tests.support.smarthosts")

pytestmark = [pytest.mark.timeout(420),
              pytest.mark.skipif(not postfix.available(), reason="needs root and postfix")]

RCPT = "user@example.net"
GIVE_UP_S = 40.0


@dataclass
class Rig:
    relay: ServeProcess
    proxy: ReplyDroppingProxy
    ledger_url: str

    async def rows_of(self, message_id: str) -> list[dict[str, Any]]:
        keys = {r["store_key"] for r in await ledger_rows(self.ledger_url)
                if r["message_id"] == message_id}
        return [r for r in await ledger_rows(self.ledger_url) if r["store_key"] in keys]

    async def in_doubt(self, data: bytes, mode: str) -> float:
        """Send ``data`` with the proxy in ``mode``: answered as in doubt; when (unix s)."""
        self.proxy.mode = mode
        got = await send(self.relay.port, [RCPT], data)
        assert got.code == 451, got
        self.proxy.mode = "pass"
        return time.time()

    async def resolved(self, message_id: str, outcome: str, since: float,
                       what: str) -> dict[str, Any]:
        """The reconciler's ``outcome`` row of ``message_id``, waited for; prints how long
        after ``since`` it came."""
        async def landed() -> bool:
            return outcome in [r["outcome"] for r in await self.rows_of(message_id)]

        await until(landed, within_s=GIVE_UP_S * 3, what=f"{outcome} of {message_id}")
        took = time.time() - since
        print(f"\n{what}: {outcome} {took:.1f} s after the in-doubt answer")
        return [r for r in await self.rows_of(message_id) if r["outcome"] == outcome][-1]


def _message(dedupe_key: str, message_id: str | None, *, refused: bool = False) -> bytes:
    extra = "" if message_id is None else f"Message-ID: {message_id}\r\n"
    if refused:
        extra += f"{smarthosts.REFUSE_HEADER}: yes\r\n"
    return message(key=dedupe_key, extra=extra)


@pytest.fixture
async def rig(tmp_path: Path, ledger_url: str) -> AsyncIterator[Rig]:
    with smarthosts.reachable_folder("reconcile-postfix-") as folder:
        port = free_port()
        with smarthosts.postfix_smarthost(folder, port) as maillog:
            async with serve_proxy(port) as proxy:
                config = tmp_path / "relay.toml"
                config.write_text(f'[[reconcile_source]]\nname = "postfix"\n'
                                  f'postfix_log = "{maillog}"\n')
                relay = await start_serve(
                    tmp_path, "--config", str(config), "--upstream",
                    f"127.0.0.1:{proxy.port}", "--store",
                    f"sqlite:///{tmp_path / 'dedup.db'}", "--ledger", ledger_url,
                    "--store-prefix", f"test:{uuid.uuid4().hex}:",
                    "--reconcile-interval", "1", "--reconcile-give-up", str(GIVE_UP_S),
                    "--metrics-listen", "127.0.0.1:0", "--settle-journal", "", workers=1)
                try:
                    yield Rig(relay, proxy, ledger_url)
                finally:
                    await asyncio.to_thread(relay.stop)


async def test_postfix_in_doubt_messages_are_resolved_by_its_log(rig: Rig) -> None:
    tag = uuid.uuid4().hex[:8]
    accepted_id, refused_id, reused_id = (f"<{kind}-{tag}@app.test>"
                                          for kind in ("accepted", "refused", "reused"))

    # Postfix queued it; its reply lost
    since = await rig.in_doubt(_message("K-acc", accepted_id), "drop_reply")
    row = await rig.resolved(accepted_id, "reconciled_sent", since, "accepted")
    # Postfix's lines (addresses masked, as ledger_recipients = masked keeps them)
    assert "source postfix" in row["reply"] and "(queue active)" in row["reply"]
    assert "message-id=" in row["reply"]
    retry = await send(rig.relay.port, [RCPT], _message("K-acc", accepted_id))
    assert retry.code == 250 and "duplicate" in retry.text, retry
    assert "in doubt" not in retry.text

    # Postfix refused it at end of data; its reply lost
    since = await rig.in_doubt(_message("K-ref", refused_id, refused=True), "drop_reply")
    await rig.resolved(refused_id, "reconciled_released", since, "refused")
    dots = rig.proxy.dots
    retry = await send(rig.relay.port, [RCPT], _message("K-ref", refused_id, refused=True))
    assert retry.code == 550 and rig.proxy.dots == dots + 1, retry  # relayed, refused again

    # no Message-ID: the relay's own, reconciled the same way
    since = await rig.in_doubt(_message("K-noid", None), "drop_reply")
    [own] = [r for r in await ledger_rows(rig.ledger_url)
             if r["outcome"] == "unknown" and r["message_id"] not in (accepted_id, refused_id)]
    assert own["message_id"].startswith(f"<{own['queue_id']}@")
    await rig.resolved(own["message_id"], "reconciled_sent", since, "no Message-ID")

    # one Message-ID, two attempts: the first accepted (heard), the second refused (lost)
    assert (await send(rig.relay.port, [RCPT], _message("K-reuse-1", reused_id))).code == 250
    # an application's retry comes later than a log's resolution and the sources' clock skew
    # allowance (2 s): closer attempts cannot be told apart by a log (reconciliation.md)
    await asyncio.sleep(3.5)
    since = await rig.in_doubt(_message("K-reuse-2", reused_id, refused=True), "drop_reply")
    await rig.resolved(reused_id, "reconciled_released", since, "reused Message-ID")
    assert "reconciled_sent" not in [r["outcome"] for r in await rig.rows_of(reused_id)]

    assert rig.relay.metrics_port is not None
    samples = await asyncio.to_thread(scrape, rig.relay.metrics_port)
    counted = {(labels["source"], labels["result"]): value
               for labels, value in samples["relay_reconciled_total"]}
    assert counted == {("postfix", "sent"): 2.0, ("postfix", "released"): 2.0,
                       ("postfix", "given_up"): 0.0}


async def test_a_dot_postfix_never_got_is_given_up_at_the_bound(rig: Rig) -> None:
    message_id = f"<lost-{uuid.uuid4().hex[:8]}@app.test>"
    since = await rig.in_doubt(_message("K-lost", message_id), "lose_dot")
    assert rig.proxy.lost == 1
    await asyncio.sleep(3)
    assert [r["outcome"] for r in await rig.rows_of(message_id)] == ["unknown"]
    row = await rig.resolved(message_id, "reconcile_given_up", since, "dot lost")
    assert "no evidence from postfix" in row["reply"]
    assert time.time() - since >= GIVE_UP_S - 1  # never before the bound
    outcomes = [r["outcome"] for r in await rig.rows_of(message_id)]
    assert outcomes == ["unknown", "reconcile_given_up"]
