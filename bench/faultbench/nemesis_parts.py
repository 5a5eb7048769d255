"""The nemesis's smarthost and relays, each able to take a fault and heal from it: a
smarthost whose faults come and go (:class:`NemesisSink`) and a relay kept running as a
service manager keeps it (:class:`RelayNode`); the store is ``bench.faultbench.nemesis_store``.

Faults holding a relay down are counted (``down``), so overlapping ones compose: the relay is
started again when the last of them ends. A fault that cannot apply (a kill of a relay already
down) returns False and is not counted as applied. Loopback only; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiosmtpd.smtp import SMTP, Envelope, Session

from bench.faultbench.lib import (
    BenchSink,
    Faults,
    RelayProcess,
    _end,
    _group_gone,
    _libfaketime,
    _Plan,
    _StallingSMTP,
)

HANG_S = 3.0
"""How long the smarthost holds its reply to a dot it took (``upstream-hang``): longer than
the relay's wait for that reply (1 s)."""
STALL_S = 2.5
"""How long the smarthost stops reading after its 354 (``upstream-stall``)."""
READ_REST_S = 0.5
"""How long after the relay's FIN the smarthost goes on reading what arrived before it."""
FATES = {"upstream-4yz": "temp", "upstream-hang": "hang", "upstream-close": "close"}


class NemesisSink(BenchSink):
    """The bench's smarthost whose faults start and stop while it serves.

    :meth:`start_fault` / :meth:`end_fault` switch a fault of :data:`FATES` or
    ``upstream-stall`` on and off with a share of the transactions it hits; each transaction
    draws its fate when its MAIL arrives. Every final dot is logged to ``dots.jsonl``:
    ``{"t", "key", "rcpts", "fate", "taken"}`` (``fate``: ok, temp_dot, hang, close or stall;
    ``taken``: the smarthost queued the message,
    whatever became of its reply), besides the taken copies in ``sink.jsonl``.
    """

    def __init__(self, log_path: Path, dots_path: Path, seed: int) -> None:
        super().__init__(Faults(slow_s=0.1), log_path, seed)
        self.dots_path = dots_path
        self._active: list[tuple[str, float]] = []
        dots_path.touch()

    def start_fault(self, kind: str, share: float) -> None:
        """Hit ``share`` (0-1) of the transactions that start from now with ``kind``."""
        self._active.append((kind, share))

    def end_fault(self, kind: str, share: float) -> None:
        """End one fault :meth:`start_fault` started."""
        with contextlib.suppress(ValueError):
            self._active.remove((kind, share))

    def heal(self) -> None:
        """End every fault."""
        self._active.clear()

    def _draw(self) -> str:
        for kind, share in self._active:
            if kind in FATES and self._rng.random() < share:
                fate = FATES[kind]
                return self._rng.choice(("temp_dot", "temp_rcpt")) if fate == "temp" else fate
        return "ok"

    def _stalls(self, options: list[str]) -> bool:
        return any(kind == "upstream-stall" and self._rng.random() < share
                   for kind, share in self._active)

    def stall_s(self, envelope: Envelope) -> float:
        plan = self._plans.get(id(envelope))
        return STALL_S if plan is not None and plan.stall else 0.0

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        await self._slow()
        plan = self._plans.pop(id(envelope), _Plan("ok"))
        fate = "stall" if plan.stall and plan.fate == "ok" else plan.fate
        if plan.fate == "temp_dot":
            self._dot(envelope, fate, taken=False)
            return "451 4.3.0 bench: temporary failure"
        self._log(envelope)  # taken: logged before the reply, as a real MTA queues it
        self._dot(envelope, fate, taken=True)
        if plan.fate == "close" and isinstance(server.transport, asyncio.WriteTransport):
            server.transport.abort()  # no reply: what it had buffered is dropped, then FIN
            return "421 4.3.0 bench: never sent"
        if plan.fate == "hang":
            await asyncio.sleep(HANG_S)
        return "250 2.0.0 Ok: queued as BENCH"

    def _dot(self, envelope: Envelope, fate: str, *, taken: bool) -> None:
        content = envelope.original_content or b""
        head = content.split(b"\r\n\r\n", 1)[0]
        key = ""
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"x-dedupe-key:"):
                key = line.split(b":", 1)[1].decode(errors="replace").strip()
        entry = {"t": time.time(), "key": key, "rcpts": [r.lower() for r in envelope.rcpt_tos],
                 "fate": fate, "taken": taken}
        with self.dots_path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(entry) + "\n")


class _ReadToTheEndSMTP(_StallingSMTP):
    """The stalling SMTP server that, like a real MTA, reads what arrived before the peer's
    FIN: a message whose final dot came before the close is taken. (aiosmtpd ends the session
    at the FIN, dropping lines still unread; a relay that gave up waiting for the reply to a
    dot closes while a stalled link still holds that dot.) The session ends
    :data:`READ_REST_S` after the FIN."""

    def eof_received(self) -> bool | None:
        asyncio.get_running_loop().call_later(READ_REST_S, self._end_at_eof)
        return True  # half-closed until then

    def _end_at_eof(self) -> None:
        if self.transport is not None and self.session is not None:
            super().eof_received()


@dataclass
class SinkServer:
    """A running :class:`NemesisSink` on ``port``."""

    handler: NemesisSink
    port: int
    server: asyncio.base_events.Server

    def close(self) -> None:
        self.server.close()


async def start_nemesis_sink(workdir: Path, seed: int) -> SinkServer:
    """Serve a :class:`NemesisSink` on a free loopback port in the running loop; its receive
    buffer is 64 KiB, so a stalled read backs the message up into the relay."""
    handler = NemesisSink(workdir / "sink.jsonl", workdir / "dots.jsonl", seed)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.bind(("127.0.0.1", 0))
    server = await asyncio.get_running_loop().create_server(
        lambda: _ReadToTheEndSMTP(handler, hostname="sink.bench", decode_data=False,
                                  enable_SMTPUTF8=True), sock=sock)
    return SinkServer(handler, server.sockets[0].getsockname()[1], server)


# ------------------------------------------------------------------------------------------
# relays
# ------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc), oldest first."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                raw = Path(f"/proc/{entry}/stat").read_text()
                if int(raw[raw.rindex(")") + 2:].split()[1]) == pid:
                    found.append(int(entry))
    return sorted(found)


@dataclass
class RelayNode:
    """One relay (``serve --workers 2``: a supervisor and its workers, one process group)
    kept running as a service manager keeps a unit: a relay that exits on its own is started
    again after a second; one a fault stopped, when the last such fault ends.

    ``clock_file`` is libfaketime's timestamp file when the run steps this relay's wall clock
    (``+0`` until a step; re-read at every clock call), None otherwise. ``notes`` collects
    what happened to it (exits, starts that failed).
    """

    process: RelayProcess
    clock_file: Path | None = None
    down: int = 0
    offsets: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _stopping: bool = False
    _keeper: asyncio.Task[None] | None = None
    _starting: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def running(self) -> bool:
        proc = self.process.proc
        return proc is not None and proc.returncode is None

    def clock_env(self) -> dict[str, str]:
        """libfaketime's environment for this relay (empty without a clock file)."""
        if self.clock_file is None:
            return {}
        self.clock_file.write_text("+0\n")
        return {"LD_PRELOAD": _libfaketime(), "FAKETIME_TIMESTAMP_FILE": str(self.clock_file),
                "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}

    async def start(self) -> None:
        """Start the relay unless it runs (the keeper and the end of a fault may both ask);
        a start that fails (the store down, say) is noted, not raised: the keeper tries
        again."""
        async with self._starting:
            if self.running:
                return
            try:
                await self.process.start()
            except RuntimeError as exc:
                self.notes.append(f"{time.time():.3f} start failed: {str(exc)[:300]}")

    def keep(self) -> None:
        """Start the keeper: every 0.5 s, a relay that exited while no fault holds it down
        is started again (systemd's ``Restart=always``)."""
        async def loop() -> None:
            while not self._stopping:
                await asyncio.sleep(0.5)
                if not self._stopping and self.down == 0 and not self.running:
                    self._reap()
                    await self.start()
        self._keeper = asyncio.create_task(loop())

    def _reap(self) -> None:
        proc = self.process.proc
        if proc is not None and proc.returncode is not None:
            self.notes.append(f"{time.time():.3f} exited on its own ({proc.returncode})")
            self.process.exit_codes.append(proc.returncode)
            self.process.proc = None

    async def kill(self) -> bool:
        """SIGKILL to every process of the relay; False when it was not running."""
        if not self.running:
            return False
        await self.process.signal_and_wait(signal.SIGKILL)
        return True

    async def terminate(self, kill_after_s: float) -> bool:
        """SIGTERM; SIGKILL to the whole group when it still runs ``kill_after_s`` later (an
        orchestrator's stop timeout). False when it was not running."""
        proc = self.process.proc
        if proc is None or proc.returncode is not None:
            return False
        group = proc.pid
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), kill_after_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            self.notes.append(f"{time.time():.3f} SIGKILL {kill_after_s:.1f} s after SIGTERM")
        code = await _end(proc, signal.SIGKILL, 10)
        await _group_gone(group)
        self.process.exit_codes.append(code)
        self.process.proc = None
        return True

    def signal_worker(self, index: int, sig: int) -> bool:
        """Send ``sig`` to worker ``index`` (modulo the workers running); False when none."""
        proc = self.process.proc
        workers = _children(proc.pid) if proc is not None and self.running else []
        if not workers:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(workers[index % len(workers)], sig)
        return True

    def hangup(self) -> bool:
        """SIGHUP to the supervisor (a reload); False when the relay is not running."""
        if not self.running or self.process.proc is None:
            return False
        self.process.proc.send_signal(signal.SIGHUP)
        return True

    def step_clock(self, offset_s: float) -> None:
        """Add ``offset_s`` to the relay's wall clock (the sum of the steps in force)."""
        self.offsets.append(offset_s)
        self._write_clock()

    def unstep_clock(self, offset_s: float) -> None:
        """Take back one step :meth:`step_clock` made."""
        with contextlib.suppress(ValueError):
            self.offsets.remove(offset_s)
        self._write_clock()

    def reset_clock(self) -> None:
        """Take back every step: the wall clock is true again."""
        self.offsets.clear()
        self._write_clock()

    def _write_clock(self) -> None:
        if self.clock_file is not None:
            self.clock_file.write_text(f"{sum(self.offsets):+.3f}s\n")

    async def close(self) -> None:
        """Stop the keeper and the relay (SIGTERM, its whole shutdown)."""
        self._stopping = True
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        self._reap()
        await self.process.stop()


# ------------------------------------------------------------------------------------------
# the store
