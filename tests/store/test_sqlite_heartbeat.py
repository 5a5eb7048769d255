"""How old a SQLite SENDING row's heartbeat is (relay/store/sqlite/store.py _heartbeat_age_ms): on
the boot clock within this boot, on the wall clock for a row of an earlier version, at least a
lease for a row of another boot (its attempt ended with that boot)."""

from __future__ import annotations

import pytest

from relay.store.sqlite.store import _heartbeat_age_ms, boot_beat

LEASE_MS = 15_000
NOW_MS = 1_796_000_000_000


def test_a_heartbeat_of_this_boot_is_aged_on_the_boot_clock_whatever_the_wall_says() -> None:
    """Written 2 s ago on the boot clock: 2 s old, though the wall clock moved 20 s (a step)
    or back 20 s."""
    boot, beat_ms = boot_beat()
    for wall_written in (NOW_MS - 22_000, NOW_MS + 18_000):
        age = _heartbeat_age_ms(wall_written, boot, beat_ms - 2_000, NOW_MS, LEASE_MS)
        assert 2_000 <= age < 3_000


@pytest.mark.parametrize(("boot", "beat_ms"), [(None, None), ("unknown", 5), ("x", None)])
def test_a_heartbeat_without_a_boot_clock_is_aged_on_the_wall_clock(
        boot: str | None, beat_ms: int | None) -> None:
    """A row of an earlier version (no boot clock), or of a host without a boot id: the wall
    clock's age, as before."""
    assert _heartbeat_age_ms(NOW_MS - 4_000, boot, beat_ms, NOW_MS, LEASE_MS) == 4_000


def test_a_heartbeat_of_another_boot_is_at_least_a_lease_old() -> None:
    """Written a second ago (wall) in another boot: the host rebooted since, the attempt is
    gone, the row reads as in doubt at once."""
    age = _heartbeat_age_ms(NOW_MS - 1_000, "another-boot", 10, NOW_MS, LEASE_MS)
    assert age >= LEASE_MS
