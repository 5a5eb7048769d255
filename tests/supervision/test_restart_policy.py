"""The restart policy of a worker slot (relay.supervision.policy): the back-off, its reset,
and when the relay gives up."""

from __future__ import annotations

import pytest

from relay.supervision.policy import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    EX_CONFIG,
    EX_UNAVAILABLE,
    MAX_START_FAILURES,
    Restarts,
    exit_text,
)


def test_the_back_off_doubles_up_to_thirty_seconds() -> None:
    """Each waited-out back-off doubles the next, from 0.5 s to at most 30 s."""
    restarts = Restarts(1)
    seen = []
    for _ in range(10):
        seen.append(restarts.backoff_s)
        restarts.waited()
    assert seen[:4] == [BACKOFF_FIRST_S, 1.0, 2.0, 4.0]
    assert max(seen) == BACKOFF_MAX_S == seen[-1]


def test_a_minute_of_serving_resets_the_back_off() -> None:
    """A worker that served over a minute restarts after 0.5 s again; one that served less
    keeps its grown back-off."""
    restarts = Restarts(1, backoff_s=8.0)
    assert restarts.after_exit(-9, served_s=30.0) is None
    assert restarts.backoff_s == 8.0
    assert restarts.after_exit(-9, served_s=61.0) is None
    assert restarts.backoff_s == BACKOFF_FIRST_S


@pytest.mark.parametrize("code", [EX_UNAVAILABLE, EX_CONFIG])
def test_a_start_error_before_serving_ends_the_relay_with_its_code(code: int) -> None:
    """Exit 69 or 78 before the worker served: the relay gives up with that code at once."""
    assert Restarts(0).after_exit(code, served_s=None) == code


def test_a_worker_that_served_restarts_whatever_its_code() -> None:
    """A start error's code after the worker served is a crash: restarted, not given up on,
    and its failed starts count from zero again."""
    restarts = Restarts(0, start_failures=3)
    assert restarts.after_exit(EX_CONFIG, served_s=5.0) is None
    assert restarts.start_failures == 0


def test_five_failed_starts_in_a_row_end_the_relay_with_69(
        caplog: pytest.LogCaptureFixture) -> None:
    """Other exits before serving restart the worker until the fifth, which gives up (69)."""
    restarts = Restarts(1)
    for _ in range(MAX_START_FAILURES - 1):
        assert restarts.after_exit(3, served_s=None) is None
    assert restarts.after_exit(3, served_s=None) == EX_UNAVAILABLE
    assert "worker 1 could not start (exit code 3, 5 time(s)): giving up" in caplog.text


def test_an_exit_by_signal_is_named() -> None:
    """A negative code names the signal that ended the worker."""
    assert exit_text(-9) == "signal SIGKILL"
    assert exit_text(3) == "exit code 3"
