"""Counting a Redis store's records by state (``dedup-relay stats``): the SCAN pattern of a key
prefix, and the tally of the values read back, classified with the store's own codec
(:func:`relay.store.redis.scripts.decode_value`), so a record counts as what a reserve would
read it as. The scan itself is :meth:`relay.store.redis.store.RedisStore.count_states`."""

from __future__ import annotations

from relay.core.interfaces import State, StateCounts
from relay.core.rules import heartbeat_state
from relay.store.redis.scripts import decode_value, relay_sent

_GLOB_SPECIAL = frozenset("*?[]\\")


def match_pattern(prefix: str) -> str:
    """The SCAN ``MATCH`` pattern of every key starting with ``prefix``: its glob characters
    (``* ? [ ] \\``) escaped with a backslash, then ``*``."""
    return "".join("\\" + c if c in _GLOB_SPECIAL else c for c in prefix) + "*"


class StateTally:
    """Adds up the values of the keys a scan read; :meth:`counts` gives the result.

    ``lease_ms`` judges a SENDING value that names no lease of its own (``D|token|ms`` of
    earlier versions); ``older_than_ms`` is the age from which an in-doubt record counts in
    ``in_doubt_older``. Times are the server's (unix milliseconds).
    """

    def __init__(self, *, lease_ms: int, older_than_ms: int) -> None:
        self._lease_ms = lease_ms
        self._older_than_ms = older_than_ms
        self._by_state = {State.PENDING: 0, State.SENDING: 0, State.SENT: 0, State.UNKNOWN: 0}
        self._foreign = 0
        self._past_lease = 0
        self._older = 0
        self._oldest_ms: int | None = None
        self._oldest_age_ms = 0
        self.scanned = 0

    def add_key(self) -> None:
        """Count one key looked at (whatever it turns out to hold)."""
        self.scanned += 1

    def add(self, value: bytes | None, now_ms: int) -> None:
        """Count one key's value: ``None`` when the key is gone (expired since SCAN),
        ``b""`` for another Redis type (read as SENT, as a reserve reads it); ``now_ms`` is
        the server's time when it was read."""
        if value is None:
            return
        record = decode_value(value)
        self._by_state[record.state] += 1
        if record.state is State.SENT and not relay_sent(value) and record.at is None:
            self._foreign += 1  # neither ``0[#<d>]`` nor ``S|<ms>|...``: not the relay's
        if record.state is State.UNKNOWN:
            self._in_doubt(record.at, now_ms)
        elif record.state is State.SENDING and record.at is not None:
            own_lease_ms = None if record.lease_s is None else round(record.lease_s * 1000)
            age_ms = now_ms - round(record.at * 1000)
            if heartbeat_state(age_ms, own_lease_ms, self._lease_ms) is State.UNKNOWN:
                self._past_lease += 1
                self._in_doubt(record.at, now_ms)

    def _in_doubt(self, at: float | None, now_ms: int) -> None:
        if at is None:
            return
        at_ms = round(at * 1000)
        if now_ms - at_ms >= self._older_than_ms:
            self._older += 1
        if self._oldest_ms is None or at_ms < self._oldest_ms:
            self._oldest_ms, self._oldest_age_ms = at_ms, now_ms - at_ms

    def counts(self, *, complete: bool) -> StateCounts:
        """The tally so far as :class:`StateCounts`."""
        oldest = None if self._oldest_ms is None else self._oldest_ms / 1000
        return StateCounts(
            pending=self._by_state[State.PENDING], sending=self._by_state[State.SENDING],
            sent=self._by_state[State.SENT], unknown=self._by_state[State.UNKNOWN],
            foreign=self._foreign, sending_past_lease=self._past_lease, scanned=self.scanned,
            complete=complete, oldest_in_doubt_at=oldest,
            oldest_in_doubt_age_s=None if oldest is None else self._oldest_age_ms / 1000,
            in_doubt_older=self._older)
