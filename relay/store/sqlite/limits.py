"""Rate limits in the SQLite store's file (design.md §4.7): the sliding-window log of
:mod:`relay.store.redis.limits` as rows of the ``rate_events`` table, so that every worker and
relay sharing the file shares the limits.

One row per acquire and bucket: ``(bucket, at_ms, cost, expires_ms)``; ``at_ms`` is the clock
of the host holding the file, read inside the transaction (the store's clock, as every time
the SQLite store records). A call is one transaction (:class:`relay.store.sqlite.store.SqliteStore`
runs it on its writer thread): it deletes the expired rows of every bucket (an index on
``expires_ms``: nothing grows without bound), sums each bucket's window and inserts only when
all have room.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

from relay.core.interfaces import LimitCheck, LimitVerdict

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS rate_events (
        bucket TEXT NOT NULL,
        at_ms INTEGER NOT NULL,
        cost INTEGER NOT NULL,
        expires_ms INTEGER NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS rate_events_bucket ON rate_events (bucket, at_ms, cost)",
    "CREATE INDEX IF NOT EXISTS rate_events_expiry ON rate_events (expires_ms)",
)

_PURGE = "DELETE FROM rate_events WHERE expires_ms <= ?"
# the covering index answers both from the index alone
_USED = "SELECT coalesce(sum(cost), 0) FROM rate_events WHERE bucket = ? AND at_ms > ?"
_OLDEST = ("SELECT at_ms, cost FROM rate_events WHERE bucket = ? AND at_ms > ? ORDER BY at_ms "
           "LIMIT ?")
_INSERT = "INSERT INTO rate_events (bucket, at_ms, cost, expires_ms) VALUES (?, ?, ?, ?)"


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def bucket_name(prefix: str, check: LimitCheck) -> str:
    """The ``bucket`` column of ``check``: ``<prefix>rl:<bucket>``."""
    return f"{prefix}rl:{check.bucket}"


def acquire_in(conn: sqlite3.Connection, now_ms: int, prefix: str,
               checks: Sequence[LimitCheck]) -> LimitVerdict:
    """Take every check's cost or none, inside the caller's transaction (``now_ms``: its
    time). Raises sqlite3.Error."""
    conn.execute(_PURGE, (now_ms,))
    for check in checks:
        window_ms = _ms(check.per_s)
        if check.cost > check.limit:
            return LimitVerdict(allowed=False, refused=check, retry_after_s=None)
        bucket, since_ms = bucket_name(prefix, check), now_ms - window_ms
        used = int(conn.execute(_USED, (bucket, since_ms)).fetchone()[0])
        if used + check.cost <= check.limit:
            continue
        # room once the oldest rows holding ``need`` units left (each holds at least 1)
        need, freed = used + check.cost - check.limit, 0
        wait_ms = window_ms
        for at_ms, cost in conn.execute(_OLDEST, (bucket, since_ms, need)):
            freed += cost
            if freed >= need:
                wait_ms = max(1, at_ms + window_ms - now_ms)
                break
        return LimitVerdict(allowed=False, refused=check, retry_after_s=wait_ms / 1000)
    conn.executemany(_INSERT, [(bucket_name(prefix, c), now_ms, c.cost, now_ms + _ms(c.per_s))
                               for c in checks])
    return LimitVerdict(allowed=True)
