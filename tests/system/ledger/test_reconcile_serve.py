"""The reconciler in a served relay (relay/admin/reconciler.py: in the supervisor of two
workers, and in a relay of one process): a message whose dot the upstream swallowed is in
doubt; a ``command`` source that says ``accepted`` resolves it within a round; the /metrics of
the supervisor (or of the one process) counts it in relay_reconciled_total (at 0 for the other
results); the retry is an ordinary duplicate. Runs once the ``command`` source
(relay/reconcile/command.py) is there."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from tests.support.clients import message, send
from tests.support.metrics import scrape
from tests.support.peers import DotSwallower, serve_peer
from tests.support.postgres import ledger_rows
from tests.support.relays import start_serve
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_served_relay_resolves_an_in_doubt_message_by_a_command(
        tmp_path: Path, ledger_url: str, workers: int) -> None:
    script = tmp_path / "look-up"
    script.write_text("#!/bin/sh\necho accepted\n")
    script.chmod(0o755)
    config = tmp_path / "relay.toml"
    config.write_text(f'[[reconcile_source]]\nname = "cmd"\ncommand = ["{script}"]\n')
    async with serve_peer(DotSwallower()) as peer:
        relay = await start_serve(
            tmp_path, "--config", str(config), "--upstream", f"127.0.0.1:{peer.port}",
            "--store", f"sqlite:///{tmp_path / 'dedup.db'}", "--ledger", ledger_url,
            "--store-prefix", f"test:{uuid.uuid4().hex}:", "--reconcile-interval", "1",
            "--metrics-listen", "127.0.0.1:0", "--settle-journal", "", workers=workers)
        try:
            sent = message(key="K-served", extra="Message-ID: <served-1@app.test>\r\n")
            assert (await send(relay.port, ["user@example.net"], sent)).code == 451

            async def resolved() -> bool:
                return "reconciled_sent" in [r["outcome"] for r in await ledger_rows(ledger_url)]

            await until(resolved, within_s=60, what="the reconciled_sent row")
            assert relay.metrics_port is not None
            samples = await asyncio.to_thread(scrape, relay.metrics_port)
            counted = {(labels["source"], labels["result"]): value
                       for labels, value in samples["relay_reconciled_total"]}
            assert counted == {("cmd", "sent"): 1.0, ("cmd", "released"): 0.0,
                               ("cmd", "given_up"): 0.0}
            peer.swallow = False
            retry = await send(relay.port, ["user@example.net"], sent)
            assert retry.code == 250 and peer.received == 1, retry
        finally:
            await asyncio.to_thread(relay.stop)
