"""Reconciliation end to end against a real private Postfix smarthost and a real private Exim
(tests/support/smarthosts.py, tests/support/exim.py: each discards what it takes and refuses
at end of data a message carrying the refusal header, Postfix by a header_checks REJECT, Exim
by an acl_smtp_data deny), with a proxy between the relay and the smarthost that loses its
reply to the final dot, or the dot itself (tests/support/reply_dropping_proxy.py). A served
relay (PostgreSQL ledger, SQLite store) reads the smarthost's own log (``postfix_log``: its
``maillog_file``; ``exim_log``: its main log, with its reject log) every second:

- the smarthost took it, its reply lost: marked sent; the retry is an ordinary duplicate; the
  ledger row holds the smarthost's log line; counted ``sent``;
- it refused it at end of data, its reply lost: released; the retry is relayed (and refused
  again, now heard);
- a message without a Message-ID gets one and is reconciled the same way;
- a Message-ID reused by a second attempt seconds later: the first attempt's acceptance,
  logged before the second's dot, is not about it; its refusal releases it;
- the dot lost on the way: the smarthost never took it; it stays in doubt until the give-up
  bound, then one ``reconcile_given_up`` row.

How long each took (from the relay's in-doubt answer to the reconciler's row) is printed (run
with ``-s``). Postfix's runs as root with Debian's postfix."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import exim, postfix, smarthosts
from tests.support.clients import message, send
from tests.support.metrics import scrape
from tests.support.net import free_port
from tests.support.postgres import ledger_rows
from tests.support.relays import ServeProcess, start_serve
from tests.support.reply_dropping_proxy import ReplyDroppingProxy, serve_proxy
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(420)

RCPT = "user@example.net"
GIVE_UP_S = 40.0


@dataclass
class Rig:
    relay: ServeProcess
    proxy: ReplyDroppingProxy
    ledger_url: str
    kind: str  # postfix | exim: the source's name too

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
        print(f"\n{self.kind}, {what}: {outcome} {took:.1f} s after the in-doubt answer")
        return [r for r in await self.rows_of(message_id) if r["outcome"] == outcome][-1]


def _message(dedupe_key: str, message_id: str | None, *, refused: bool = False) -> bytes:
    extra = "" if message_id is None else f"Message-ID: {message_id}\r\n"
    if refused:
        extra += f"{smarthosts.REFUSE_HEADER}: yes\r\n"
    return message(key=dedupe_key, extra=extra)


@contextlib.contextmanager
def _smarthost(kind: str, folder: Path, port: int) -> Iterator[str]:
    """A refusing smarthost of ``kind`` on ``port``; yields its source's table lines."""
    if kind == "postfix":
        if not postfix.available():
            pytest.skip("needs root and Debian's postfix")
        with smarthosts.postfix_smarthost(folder, port) as maillog:
            yield f'postfix_log = "{maillog}"\n'
    else:
        with exim.private_exim(folder / "exim", port) as instance:
            yield f'exim_log = "{instance.main_log}"\n'


@pytest.fixture(params=["postfix", "exim"])
async def rig(request: pytest.FixtureRequest, tmp_path: Path, ledger_url: str
              ) -> AsyncIterator[Rig]:
    kind = request.param
    with smarthosts.reachable_folder(f"reconcile-{kind}-") as folder:
        port = free_port()
        with _smarthost(kind, folder, port) as source:
            async with serve_proxy(port) as proxy:
                config = tmp_path / "relay.toml"
                config.write_text(f'[[reconcile_source]]\nname = "{kind}"\n{source}')
                relay = await start_serve(
                    tmp_path, "--config", str(config), "--upstream",
                    f"127.0.0.1:{proxy.port}", "--store",
                    f"sqlite:///{tmp_path / 'dedup.db'}", "--ledger", ledger_url,
                    "--store-prefix", f"test:{uuid.uuid4().hex}:",
                    "--reconcile-interval", "1", "--reconcile-give-up", str(GIVE_UP_S),
                    "--metrics-listen", "127.0.0.1:0", "--settle-journal", "", workers=1)
                try:
                    yield Rig(relay, proxy, ledger_url, kind)
                finally:
                    await asyncio.to_thread(relay.stop)


ACCEPTED_LINE = {"postfix": "(queue active)", "exim": " <= "}
"""What the smarthost's log line of a message it took holds."""


async def test_in_doubt_messages_are_resolved_by_the_smarthosts_log(rig: Rig) -> None:
    tag = uuid.uuid4().hex[:8]
    accepted_id, refused_id, reused_id = (f"<{kind}-{tag}@app.test>"
                                          for kind in ("accepted", "refused", "reused"))

    # the smarthost took it; its reply lost
    since = await rig.in_doubt(_message("K-acc", accepted_id), "drop_reply")
    row = await rig.resolved(accepted_id, "reconciled_sent", since, "accepted")
    # the smarthost's line (addresses masked, as ledger_recipients = masked keeps them)
    assert f"source {rig.kind}" in row["reply"] and ACCEPTED_LINE[rig.kind] in row["reply"]
    retry = await send(rig.relay.port, [RCPT], _message("K-acc", accepted_id))
    assert retry.code == 250 and "duplicate" in retry.text, retry
    assert "in doubt" not in retry.text

    # the smarthost refused it at end of data; its reply lost
    since = await rig.in_doubt(_message("K-ref", refused_id, refused=True), "drop_reply")
    await rig.resolved(refused_id, "reconciled_released", since, "refused")
    dots = rig.proxy.dots
    retry = await send(rig.relay.port, [RCPT], _message("K-ref", refused_id, refused=True))
    assert retry.code == 550 and rig.proxy.dots == dots + 1, retry  # relayed, refused again

    # no Message-ID: the relay's own, reconciled the same way
    since = await rig.in_doubt(_message("K-noid", None), "drop_reply")
    async def own_rows() -> list[dict[str, Any]]:
        return [r for r in await ledger_rows(rig.ledger_url)
                if r["outcome"] == "unknown" and r["message_id"] not in (accepted_id, refused_id)]

    async def landed() -> bool:
        return bool(await own_rows())

    await until(landed, what="the in-doubt row of the message without a Message-ID")
    [own] = await own_rows()
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
    assert counted == {(rig.kind, "sent"): 2.0, (rig.kind, "released"): 2.0,
                       (rig.kind, "given_up"): 0.0}


async def test_a_dot_the_smarthost_never_got_is_given_up_at_the_bound(rig: Rig) -> None:
    message_id = f"<lost-{uuid.uuid4().hex[:8]}@app.test>"
    since = await rig.in_doubt(_message("K-lost", message_id), "lose_dot")
    assert rig.proxy.lost == 1

    async def listed() -> bool:
        return bool(await rig.rows_of(message_id))

    await until(listed, what="the in-doubt row")
    await asyncio.sleep(3)  # rounds go by (every second): none resolves it
    assert [r["outcome"] for r in await rig.rows_of(message_id)] == ["unknown"]
    row = await rig.resolved(message_id, "reconcile_given_up", since, "dot lost")
    assert f"no evidence from {rig.kind}" in row["reply"]
    assert time.time() - since >= GIVE_UP_S - 1  # never before the bound
    outcomes = [r["outcome"] for r in await rig.rows_of(message_id)]
    assert outcomes == ["unknown", "reconcile_given_up"]
