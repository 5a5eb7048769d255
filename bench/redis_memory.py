"""Redis ``used_memory`` per SENT fingerprint, hex and compact keys, each with and without the
content digest the relay keeps in its records (the target: at most 160 B).

One command (from the repository root)::

    .venv/bin/python -m bench.redis_memory                 # 100,000 fingerprints per key form
    .venv/bin/python -m bench.redis_memory --keys 20000 --prefix email:fp:

For each key form (``store_key_format`` hex, then compact) and each record form (``0#<d>``:
with the 10-character content digest every relay now writes; ``0``: without one, as relays
before it wrote and as a reserve given no digest writes) a private ``redis-server`` (no
persistence, :class:`bench.run.PrivateRedis`) is flushed, then ``--keys`` fingerprints derived
by :func:`relay.core.keys.recipient_key` (the relay's own derivation, default prefix
``email:fp:``) go through the relay's own store calls: reserve (PENDING), mark SENDING, settle
SENT, ``--batch`` keys per call, one window (24 h). The figures are the growth of
``used_memory`` (and of ``used_memory_dataset``) over the keys added, in bytes per
fingerprint, and ``MEMORY USAGE`` of one record: the records a relay leaves for the dedup
window, without the time an SMTP run of 100,000 messages takes (``bench/run.py`` measures the
same growth through a running relay).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from bench.run import PrivateRedis
from relay.core.interfaces import Settle, SettleOp
from relay.core.keys import KeyFormat, KeyRules, recipient_key
from relay.store.redis.store import RedisStore

WINDOW_S = 86400.0
LEASE_S = 900.0
TARGET_B = 160


@dataclass(frozen=True)
class Growth:
    """``used_memory`` and ``used_memory_dataset`` growth over ``keys`` keys, bytes per key."""

    key_format: str
    keys: int
    used_b_per_fp: float
    dataset_b_per_fp: float
    digest: bool = True
    memory_usage_b: int = 0  # MEMORY USAGE of one record


DIGEST = "AbCdEf0123"  # a content digest as the store keeps it (10 characters)


async def measure(server: PrivateRedis, key_format: KeyFormat, keys: int, batch: int,
                  prefix: str, digest: bool = True) -> Growth:
    """Flush ``server``, write ``keys`` SENT fingerprints as the relay does (with a content
    digest, or without one), return the growth."""
    server.client.flushall()
    rules = KeyRules(key_prefix=prefix, key_format=key_format)
    store = RedisStore.from_url(server.url, op_timeout_s=30.0, window_s=WINDOW_S)
    run = uuid.uuid4().hex[:8]
    before = server.memory()
    try:
        for start in range(0, keys, batch):
            names = [recipient_key(f"user{n}@example.net", "welcome", f"{run}-{n}", rules).key
                     for n in range(start, min(start + batch, keys))]
            token = uuid.uuid4().hex
            assert all(r.reserved for r in await store.reserve(
                names, token=token, lease_s=LEASE_S, content_digest=DIGEST if digest else ""))
            await store.settle([SettleOp(k, Settle.SENDING, lease_s=LEASE_S) for k in names],
                               token=token, window_s=WINDOW_S)
            await store.settle([SettleOp(k, Settle.SENT, "250 2.0.0 Ok: queued as 4F2A91C0DE")
                                for k in names], token=token, window_s=WINDOW_S)
    finally:
        await store.close()
    after = server.memory()
    added = after[2] - before[2]
    sample = server.client.randomkey()
    usage = int(server.client.memory_usage(sample) or 0) if sample is not None else 0
    return Growth(key_format, added, (after[0] - before[0]) / max(added, 1),
                  (after[1] - before[1]) / max(added, 1), digest, usage)


def main() -> int:
    """Command line entry point: prints one line per key form; exit 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--keys", type=int, default=100_000, help="fingerprints per key form")
    parser.add_argument("--batch", type=int, default=1000, help="keys per store call")
    parser.add_argument("--prefix", default="email:fp:", help="key prefix (the default's length)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-redis-memory-"))
    server = PrivateRedis(workdir)
    try:
        for key_format in ("hex", "compact"):
            for digest in (False, True):
                g = asyncio.run(measure(server, key_format, args.keys, args.batch, args.prefix,
                                        digest))
                verdict = "met" if g.used_b_per_fp <= TARGET_B else "not met"
                form = "0#<d>" if g.digest else "0    "
                print(f"{g.key_format:8} {form} {g.keys} fingerprints: used_memory "
                      f"{g.used_b_per_fp:.1f} B/fp, dataset {g.dataset_b_per_fp:.1f} B/fp, "
                      f"MEMORY USAGE {g.memory_usage_b} B (<= {TARGET_B} B: {verdict})",
                      flush=True)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
