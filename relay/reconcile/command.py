"""A program as evidence (docs/operating/reconciliation.md, the command protocol): the way to
ask a provider's message-search API or a remote smarthost's log.

For each query the program runs as ``argv + [message_id, str(int(attempt_at))]`` (the
Message-ID with its angle brackets, the attempt's unix seconds) in its own process group, and
prints one line: ``accepted``, ``refused`` or ``unknown``, optionally followed by a space and a
detail. Anything else, a non-zero exit, more than ``max_output`` bytes or no answer within
``timeout_s`` (the group is killed) is UNKNOWN, with a detail saying why and a warning logged
on ``relay.reconcile``. A program that cannot be started at all raises OSError from look."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
from collections.abc import Mapping, Sequence

from relay.reconcile.evidence import Evidence, Query, Verdict
from relay.reconcile.log_index import clip

log = logging.getLogger("relay.reconcile")

_ANSWER = re.compile(r"(accepted|refused|unknown)(?: (.*))?")
_STDERR_KEPT = 512  # bytes of a failing program's stderr quoted in the detail


class _NoAnswer(Exception):
    """The program gave no usable answer; the message says why."""


class Command:
    """Runs ``argv`` per query, at most ``concurrency`` at a time."""

    def __init__(self, name: str, argv: Sequence[str], *, timeout_s: float = 10.0,
                 max_output: int = 4096, concurrency: int = 4) -> None:
        if not argv:
            raise ValueError("a command source needs a program to run")
        self._name = name
        self._argv = list(argv)
        self._timeout_s = timeout_s
        self._max_output = max_output
        self._slots = asyncio.Semaphore(concurrency)
        self._running: set[asyncio.subprocess.Process] = set()

    @property
    def name(self) -> str:
        """The source's configured name."""
        return self._name

    async def look(self, queries: Sequence[Query]) -> Mapping[Query, Evidence]:
        """Run the program once per distinct query; raises OSError when it cannot be started
        (missing, not executable)."""
        unique = list(dict.fromkeys(queries))
        answers = await asyncio.gather(*(self._ask(query) for query in unique))
        return dict(zip(unique, answers, strict=True))

    async def close(self) -> None:
        """Kill the programs still running."""
        for process in list(self._running):
            if process.returncode is None:
                _kill_group(process)

    async def _ask(self, query: Query) -> Evidence:
        async with self._slots:
            try:
                verdict, detail = await self._run(query)
            except _NoAnswer as why:
                log.warning("reconcile source %s: no answer for %s: %s", self._name,
                            query.message_id, why, extra={"source": self._name})
                return Evidence(Verdict.UNKNOWN, self._name, clip(str(why)))
        return Evidence(verdict, self._name, clip(detail))

    async def _run(self, query: Query) -> tuple[Verdict, str]:
        process = await asyncio.create_subprocess_exec(
            *self._argv, query.message_id, str(int(query.attempt_at)),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        self._running.add(process)
        try:
            out, err = await asyncio.wait_for(self._collect(process), self._timeout_s)
        except TimeoutError:
            _kill_group(process)
            raise _NoAnswer(f"no answer within {self._timeout_s:g} s (killed)") from None
        except BaseException:
            _kill_group(process)  # too much output, or the look cancelled
            raise
        finally:
            self._running.discard(process)
            with contextlib.suppress(TimeoutError, ProcessLookupError):
                await asyncio.wait_for(_reap(process), 5.0)
        if process.returncode != 0:
            said = err[:_STDERR_KEPT].decode("utf-8", "replace").strip()
            raise _NoAnswer(f"exit status {process.returncode}: {said}")
        return _parse(out)

    async def _collect(self, process: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
        assert process.stdout is not None and process.stderr is not None
        errors = asyncio.ensure_future(_keep_head(process.stderr, _STDERR_KEPT))
        try:
            out = await _read_at_most(process.stdout, self._max_output)
            if len(out) > self._max_output:
                raise _NoAnswer(f"more than {self._max_output} bytes of output (killed)")
            await process.wait()
            return out, await errors
        finally:
            errors.cancel()


async def _read_at_most(stream: asyncio.StreamReader, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of ``stream`` (one more than allowed says "too much")."""
    data = b""
    while len(data) <= limit:
        chunk = await stream.read(limit + 1 - len(data))
        if not chunk:
            break
        data += chunk
    return data


async def _keep_head(stream: asyncio.StreamReader, limit: int) -> bytes:
    """The first ``limit`` bytes of ``stream``, the rest read and dropped (a chatty program
    does not block on a full pipe)."""
    head = b""
    while chunk := await stream.read(65536):
        head = (head + chunk)[:limit]
    return head


async def _reap(process: asyncio.subprocess.Process) -> None:
    """Read the program's pipes to their end and wait for it: its pipes' transports close
    only at their end (a killed program's unread output would keep them open)."""
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            while await stream.read(65536):
                pass
    await process.wait()


def _parse(out: bytes) -> tuple[Verdict, str]:
    lines = out.decode("utf-8", "replace").splitlines()
    if len(lines) != 1:
        raise _NoAnswer(f"{len(lines)} lines of output, not one: {out[:200]!r}")
    match = _ANSWER.fullmatch(lines[0].rstrip())
    if match is None:
        raise _NoAnswer(f"not an answer: {lines[0][:200]!r}")
    return Verdict(match.group(1)), match.group(2) or ""


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the program's process group (it was started in a session of its own; a
    group outlives its leader while a child of it, holding the output open, lives on)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
