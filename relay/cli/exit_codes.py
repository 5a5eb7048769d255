"""The exit codes of every ``dedup-relay`` command, one table (sysexits.h numbers for the
configuration and start-up failures, so a service manager can tell them apart)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What a ``dedup-relay`` process's exit status means (the same for every command)."""

    OK = 0
    # inspect: absent; release: nothing deleted; release / mark-sent: the record changed
    # since it was read (nothing done); healthcheck: not healthy
    NOT_FOUND = 1
    USAGE = 2  # a flag or an input the command refuses (click's usage errors too)
    STORE_FAILED = 3  # admin commands: the store (or the audit ledger) did not answer or failed
    IN_FLIGHT = 4  # release / mark-sent: refused, an attempt may still be delivering
    UNAVAILABLE = 69  # EX_UNAVAILABLE: serve cannot start (a port in use, the store not opened)
    CONFIG = 78  # EX_CONFIG: the settings are invalid (also a file they name is unusable)


MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "ok",
    ExitCode.NOT_FOUND: "not found or nothing done (inspect: absent; release: nothing "
                        "deleted; release, mark-sent: the record changed since it was read) "
                        "or not healthy",
    ExitCode.USAGE: "usage: a flag or input the command refuses",
    ExitCode.STORE_FAILED: "the store or the audit ledger failed (admin commands)",
    ExitCode.IN_FLIGHT: "refused: the record is in flight (release, mark-sent; see --force)",
    ExitCode.UNAVAILABLE: "cannot start: a port in use, the store cannot be opened "
                          "(EX_UNAVAILABLE)",
    ExitCode.CONFIG: "invalid configuration: a setting, or a file it names (EX_CONFIG)",
}


def epilog() -> str:
    """The exit-code table for ``--help`` (``\\b`` keeps click from re-wrapping it)."""
    rows = [f"  {int(code):>2}  {MEANINGS[code]}" for code in ExitCode]
    return "\b\nExit codes:\n" + "\n".join(rows)
