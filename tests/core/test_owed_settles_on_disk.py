"""A settle the store does not take at once is in the settle journal before the message is
answered, and dropped from it once it lands; a settle that lands at once never touches the
file (the dedup core with the real SettleJournal, real Redis under a RedisStore whose settles
fail on demand)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import CollectorRegistry

from relay.core.dedup import DedupCore, Policy
from relay.core.settlement import Settler
from relay.ops.metrics import PrometheusMetrics
from relay.store.journal import SettleJournal
from relay.store.journal_file import read_journal
from relay.store.redis.store import RedisStore
from tests.support.dedup_parts import CountingUpstream, SettleFailsFirst, one_message
from tests.support.relays import REDIS_URL
from tests.support.waiting import until

URL_NAME = f"{REDIS_URL} prefix="


def journaled_core(store: RedisStore, path: Path, prefix: str) -> tuple[DedupCore,
                                                                         SettleJournal]:
    """A DedupCore over ``store`` whose owed settles go to the journal at ``path``."""
    journal = SettleJournal(path, store, prefix=prefix, url_name=URL_NAME + prefix)
    metrics, policy = PrometheusMetrics(registry=CollectorRegistry()), Policy(key_prefix=prefix,
                                                                              lease_s=30.0)
    core = DedupCore(store=store, upstream=CountingUpstream(), metrics=metrics, policy=policy,
                     settler=Settler(store=store, metrics=metrics, window_s=policy.window_s,
                                     lease_s=policy.lease_s, journal=journal))
    return core, journal


def listing(directory: Path) -> dict[str, int]:
    """Each file in ``directory`` and its modification time (ns)."""
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


async def test_an_owed_settle_is_on_disk_when_answered_and_dropped_once_it_lands(
        prefix: str, tmp_path: Path) -> None:
    """The SENT mark fails its three quick tries and the first background one: the line is
    in the file when the 250 is given, and the file is gone once the mark lands."""
    store = SettleFailsFirst.from_url(REDIS_URL)
    store.failures = 4
    path = tmp_path / "owed.jsonl"
    core, journal = journaled_core(store, path, prefix)
    try:
        await journal.pay(core)
        decision = await core.process(one_message())
        on_disk = read_journal(path, *journal.names())
        await asyncio.wait_for(asyncio.gather(*core.background), timeout=10)
        await until(lambda: not path.exists(), within_s=5, what="the landed line dropped")
    finally:
        await journal.write(core)
        await store.close()
    assert decision.reply.code == 250
    assert [op.action.value for _token, op in on_disk] == ["sent"]


async def test_a_settle_that_lands_at_once_never_touches_the_file(
        prefix: str, tmp_path: Path) -> None:
    """With the store answering, a relayed message neither creates the journal nor touches
    the lock file the start's read left."""
    store = RedisStore.from_url(REDIS_URL)
    path = tmp_path / "owed.jsonl"
    core, journal = journaled_core(store, path, prefix)
    try:
        await journal.pay(core)
        started = listing(tmp_path)
        assert (await core.process(one_message())).reply.code == 250
        await journal.write(core)
    finally:
        await store.close()
    assert listing(tmp_path) == started
    assert not path.exists()
