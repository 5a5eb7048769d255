"""A throwaway kind of fingerprint store that lives in the test process: what a new store kind
is made of (a store, its :class:`~relay.store.kinds.StoreKind`), for the tests that add one
through the registry alone (tests/store/test_store_kinds.py).

``memory://NAME`` keeps the records in a dict of this process; ``memory://NAME?dump=PATH``
also writes them to ``PATH`` as JSON lines when the store closes (a file its URL names, which
the settings check as the store's own data file). Records expire by the wall clock; a SENDING
record is judged by its writer's lease (:func:`relay.core.rules.sending_record`), as every
store does.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from relay.core.errors import StoreError
from relay.core.interfaces import Record, Reservation, Settle, SettleOp, SettleWatch, State
from relay.core.rules import same_record, sending_record, takes_over
from relay.store.kinds import NamedFile, OpenOptions, StoreKind
from relay.store.settled import KeyWaiters

SCHEME = "memory://"


@dataclasses.dataclass(frozen=True)
class _Row:
    state: State
    expires: float  # unix seconds
    token: str | None = None
    at: float | None = None
    reply: str | None = None
    lease_s: float | None = None
    content_digest: str | None = None


class MemoryStore:
    """:class:`relay.core.interfaces.FingerprintStore` in a dict; StoreError once closed."""

    def __init__(self, name: str, dump: Path | None = None) -> None:
        self.name, self._dump = name, dump
        self._rows: dict[str, _Row] = {}
        self._closed = False
        self._waiters = KeyWaiters()  # every settle is this process's: heard at once

    def watch_settles(self, keys: Sequence[str]) -> AbstractAsyncContextManager[SettleWatch]:
        return self._waiters.watching(keys)

    def _live(self, op: str, key: str) -> _Row | None:
        if self._closed:
            raise StoreError(op, "the store is closed")
        row = self._rows.get(key)
        if row is not None and row.expires <= time.time():
            del self._rows[key]
            return None
        return row

    def _record(self, row: _Row, lease_s: float | None = None) -> Record:
        now = time.time()
        if row.state is State.SENDING and row.token is not None and row.at is not None:
            return dataclasses.replace(sending_record(
                token=row.token, at=row.at, ttl_s=row.expires - now, age_s=now - row.at,
                own_lease_s=row.lease_s, lease_s=lease_s), content_digest=row.content_digest)
        return Record(row.state, token=row.token, at=row.at, reply=row.reply,
                      ttl_s=row.expires - now, age_s=None if row.at is None else now - row.at,
                      content_digest=row.content_digest)

    async def reserve(self, keys: Sequence[str], *, token: str, lease_s: float,
                      resend_unknown: bool = False, content_digest: str = "",
                      replace_other_content: bool = False) -> list[Reservation]:
        answers = []
        for key in keys:
            row = self._live("reserve", key)
            found = None if row is None else self._record(row, lease_s)
            mine = found is not None and found.state is State.PENDING and found.token == token
            if found is None or mine or takes_over(
                    found, lease_s=lease_s, content_digest=content_digest,
                    resend_unknown=resend_unknown,
                    replace_other_content=replace_other_content):
                if not mine:
                    self._rows[key] = _Row(State.PENDING, time.time() + lease_s, token,
                                           content_digest=content_digest or None)
                answers.append(Reservation(key, True, None if mine else found))
            else:
                answers.append(Reservation(key, False, found))
        return answers

    async def settle(self, ops: Sequence[SettleOp], *, token: str,
                     window_s: float) -> list[bool]:
        done = []
        for op in ops:
            row = self._live("settle", op.key)
            if row is None or row.state not in (State.PENDING, State.SENDING) \
                    or row.token != token:
                done.append(False)
                continue
            now, window = time.time(), op.window_s or window_s
            if op.action is Settle.RELEASE:
                del self._rows[op.key]
            elif op.action is Settle.SENDING:
                self._rows[op.key] = _Row(State.SENDING, now + window, token, now,
                                          lease_s=op.lease_s or None,
                                          content_digest=row.content_digest)
            else:
                reply = op.reply.encode("utf-8", "replace").decode("utf-8")
                state = State.SENT if op.action is Settle.SENT else State.UNKNOWN
                self._rows[op.key] = _Row(state, now + window, None, now,
                                          reply if state is State.SENT else None,
                                          content_digest=row.content_digest)
            done.append(True)
            if op.action is not Settle.SENDING:
                self._waiters.notify(op.key)
        return done

    async def renew(self, keys: Sequence[str], *, token: str, lease_s: float,
                    window_s: float = 0.0) -> list[bool]:
        done = []
        for key in keys:
            row, now = self._live("renew", key), time.time()
            if row is None or row.token != token:
                done.append(False)
                continue
            if row.state is State.PENDING:
                self._rows[key] = dataclasses.replace(row, expires=now + lease_s)
            else:
                self._rows[key] = dataclasses.replace(
                    row, at=now, expires=max(row.expires, now + window_s))
            done.append(True)
        return done

    async def inspect(self, key: str) -> Record:
        row = self._live("inspect", key)
        return Record(State.ABSENT) if row is None else self._record(row)

    async def inspect_many(self, keys: Sequence[str]) -> list[Record]:
        return [await self.inspect(key) for key in keys]

    def _still(self, op: str, key: str, expected: Record | None) -> bool:
        """Whether ``key`` still holds ``expected`` (None: whatever it holds)."""
        row = self._live(op, key)
        if expected is None:
            return True
        if expected.state is State.ABSENT:
            return row is None
        return row is not None and same_record(self._record(row), expected)

    async def force_release(self, key: str, *, expected: Record | None = None) -> bool:
        if expected is not None and expected.state is State.ABSENT:
            return False
        if not self._still("force_release", key, expected):
            return False
        return self._rows.pop(key, None) is not None

    async def force_mark_sent(self, key: str, *, reply: str, window_s: float,
                              expected: Record | None = None) -> bool:
        if not self._still("force_mark_sent", key, expected):
            return False
        now = time.time()
        self._rows[key] = _Row(State.SENT, now + window_s, None, now, reply)
        return True

    async def ping(self) -> None:
        self._live("ping", "")

    async def identity(self) -> str:
        self._live("identity", "")
        return f"memory:{self.name}"

    async def close(self) -> None:
        if self._dump is not None and not self._closed:
            lines = [json.dumps({"key": key, "state": row.state.value})
                     for key, row in self._rows.items()]
            self._dump.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
        self._closed = True


def _parts(url: str) -> tuple[str, Path | None]:
    """The name and the dump file of a ``memory://NAME[?dump=PATH]`` URL."""
    parts = urlsplit(url)
    dump = dict(parse_qsl(parts.query)).get("dump")
    return parts.netloc, None if dump is None else Path(dump)


def _check_url(url: str, setting: str) -> None:
    name, _ = _parts(url)
    if not name:
        raise ValueError(f"a memory:// {setting} URL must name its store: memory://NAME")


def _files(url: str) -> list[NamedFile]:
    _, dump = _parts(url)
    return [] if dump is None else [NamedFile(dump, "the memory store's dump", "write")]


async def _open(url: str, options: OpenOptions) -> MemoryStore:
    return MemoryStore(*_parts(url))


MEMORY = StoreKind(
    name="memory",
    label="in-memory",
    schemes=(SCHEME,),
    forms="memory://NAME (this process only)",
    check_url=_check_url,
    files=_files,
    open=_open,
)
