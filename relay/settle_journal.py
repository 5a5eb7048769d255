"""The journal of settles still owed when the relay stops (issue 8 item 2; docs: README
"Graceful shutdown").

A settle after a definite upstream reply (SENT after a 250, release after a refusal, UNKNOWN
after a cut past the final dot) that has not landed when the relay exits, because the store did
not answer, is written here, one JSON object per line: ``{"token", "key", "action", "reply"}``.
The next start applies every line (the writes are compare-token, so applying them late, or
twice, is always safe) and keeps in the file only what still did not land. Without it the
record would stay SENDING and read as in doubt once its lease ran out, although the relay knew
the answer.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from relay.interfaces import Settle, SettleOp

log = logging.getLogger("relay.settle_journal")

Owed = tuple[str, SettleOp]  # (the attempt's token, the settle it owes)


def read_journal(path: Path) -> list[Owed]:
    """Every owed settle in ``path`` (none when it does not exist); a line that is not a valid
    entry is logged and skipped. Raises :class:`OSError` when the file cannot be read."""
    if not path.exists():
        return []
    owed: list[Owed] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            owed.append((str(entry["token"]), SettleOp(
                key=str(entry["key"]), action=Settle(entry["action"]),
                reply=str(entry.get("reply", "")))))
        except (ValueError, KeyError, TypeError):
            log.error("settle journal %s line %d is not an owed settle: skipped", path, number)
    return owed


def write_journal(path: Path, owed: Sequence[Owed]) -> None:
    """Replace ``path`` with ``owed`` (deleted when empty), atomically (write, fsync, rename).
    Raises :class:`OSError`."""
    if not owed:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as out:
        for token, op in owed:
            out.write(json.dumps({"token": token, "key": op.key, "action": op.action.value,
                                  "reply": op.reply}) + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
