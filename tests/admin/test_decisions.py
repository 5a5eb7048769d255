"""An operator's audited action (relay.admin.decide): the ledger answers before the store is
touched, on a real SQLite store and a PostgreSQL address where nothing answers."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from relay.admin import Decision, LedgerRefused, decide, open_ledger
from relay.core.interfaces import LedgerAction, State
from relay.settings import load_settings
from tests.support.net import free_port

KEY = "email:fp:0123"


async def test_a_ledger_that_does_not_answer_leaves_the_store_untouched(tmp_path: Path) -> None:
    """A forced release with a ledger nobody answers for raises LedgerRefused and the record
    stays SENT."""
    settings = load_settings({
        "upstream": "maildir:md", "store": f"sqlite:///{tmp_path}/dedup.db",
        "ledger": f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"})
    store = await settings.open_store(window_s=settings.dedup_window)
    try:
        assert await store.force_mark_sent(KEY, reply="250 sent", window_s=600)
        decision = Decision(LedgerAction.RELEASE, KEY, "upstream log: not delivered",
                            who="tester", force=True)
        with pytest.raises(LedgerRefused):
            await decide(settings, decision, store=contextlib.nullcontext(store),
                         ledger=open_ledger(settings), instance="test/cli")
        assert (await store.inspect(KEY)).state is State.SENT
    finally:
        await store.close()
