"""`serve --workers N`: worker processes on the supervisor's listening sockets (real processes,
the shared test Redis under a random prefix, the sink in the test's loop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from relay.core.fingerprint import fingerprint, store_key
from relay.core.interfaces import Settle, SettleOp, State
from relay.core.recipients import normalize_recipient
from relay.store.journal_file import add_to_journal
from relay.store.redis.store import RedisStore
from tests.support.cli import run_cli, wait_for_port
from tests.support.clients import message, send
from tests.support.metrics import scrape
from tests.support.net import free_port
from tests.support.relays import (
    REDIS_URL,
    ServeProcess,
    delete_prefix,
    start_serve,
)
from tests.support.sink import Sink
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(90)

Serve = Callable[..., Awaitable[ServeProcess]]


@pytest.fixture
async def serve(tmp_path: Path, sink: Sink) -> AsyncIterator[Serve]:
    """Factory: ``await serve(*flags, workers=2)`` -> a `serve` process in front of ``sink`` on
    the test Redis under a fresh prefix (``.prefix`` on the process); stopped and its keys
    deleted at the end."""
    started: list[tuple[ServeProcess, str]] = []

    async def make(*flags: str, workers: int = 2) -> ServeProcess:
        prefix = f"test:workers:{uuid.uuid4().hex}:"
        relay = await start_serve(
            tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--store", REDIS_URL,
            "--store-prefix", prefix, "--settle-journal", str(tmp_path / "owed.jsonl"),
            "--shutdown-grace", "10", "--metrics-listen", "off", *flags, workers=workers)
        started.append((relay, prefix))
        relay.prefix = prefix
        return relay

    yield make
    for relay, prefix in started:
        await asyncio.to_thread(relay.stop)
        delete_prefix(REDIS_URL, prefix)


def _messages_by_worker(relay: ServeProcess) -> Counter[int]:
    return Counter(int(e["worker"]) for e in relay.lines() if e.get("message") == "message")


def _value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str,
           **labels: str) -> float:
    return sum(v for got, v in samples.get(name, []) if labels.items() <= got.items())


def _readyz(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as reply:
            return int(reply.status), json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def _record(prefix: str, rcpt: str, key: str) -> State:
    store = RedisStore.from_url(REDIS_URL, op_timeout_s=2.0)
    try:
        name = store_key(prefix, fingerprint(normalize_recipient(rcpt), "welcome", key))
        return (await store.inspect(name)).state
    finally:
        await store.close()


async def test_two_workers_share_the_port_and_their_metrics_add_up(
        serve: Serve, sink: Sink) -> None:
    """Listen port 0 with 2 workers: both log the one port the supervisor bound, both accept
    connections (the ``worker`` field of the message lines), /metrics counts every message of
    both exactly, /readyz is 200 with every worker serving."""
    relay = await serve("--metrics-listen", "127.0.0.1:0")
    port = relay.metrics_port
    assert relay.port != 0 and port is not None
    assert {int(e["worker"]) for e in relay.listening()} == {0, 1}
    assert all(f":{relay.port} " in e["message"] for e in relay.listening())
    sent = 0
    while len(_messages_by_worker(relay)) < 2 and sent < 200:  # bounded: 20 rounds
        batch = range(sent, sent + 10)
        results = await asyncio.gather(*(
            send(relay.port, [f"u{n}@example.net"], message(key=f"K-{n}")) for n in batch))
        assert all(r.code == 250 for r in results), results
        sent += 10
        await until(lambda: sum(_messages_by_worker(relay).values()) == sent,  # noqa: B023
                    within_s=60, what="every message's line in the log")
    by_worker = _messages_by_worker(relay)
    assert set(by_worker) == {0, 1}, by_worker
    samples = await asyncio.to_thread(scrape, port)
    assert _value(samples, "relay_messages_total", result="relayed") == sent
    assert _value(samples, "relay_messages_total") == sent
    assert _value(samples, "relay_recipients_total", outcome="relayed") == sent
    assert _value(samples, "relay_upstream_replies_total", code_class="2xx") == sent
    assert _value(samples, "relay_store_seconds_count", op="reserve") == sent
    assert _value(samples, "relay_sessions_active") in (0, 1)  # the last QUIT may still run

    async def sessions_closed() -> bool:
        return _value(await asyncio.to_thread(scrape, port), "relay_sessions_active") == 0
    await until(sessions_closed, within_s=60, what="relay_sessions_active (livesum) back to 0")
    assert _value(samples, "relay_component_up", component="store") == 1
    assert len(sink.handler.delivered) == sent
    status, body = await asyncio.to_thread(_readyz, port)
    assert status == 200, body
    assert body["ready"] is True


async def test_metrics_describe_each_worker_process_in_either_format(serve: Serve) -> None:
    """``relay_worker_resident_memory_bytes`` and ``relay_worker_cpu_seconds_total`` per
    worker (their ``process_*`` is the supervisor's); OpenMetrics when the scraper asks for
    it, with its ``# EOF``; no ``_created`` series in either format."""
    relay = await serve("--metrics-listen", "127.0.0.1:0")
    assert relay.metrics_port is not None
    samples = await asyncio.to_thread(scrape, relay.metrics_port)
    memory = {got["worker"]: v for got, v in samples["relay_worker_resident_memory_bytes"]}
    cpu = {got["worker"]: v for got, v in samples["relay_worker_cpu_seconds_total"]}
    assert set(memory) == set(cpu) == {"0", "1"}
    assert all(v > 10 * 2**20 for v in memory.values()), memory  # a Python process, loaded
    assert all(v > 0 for v in cpu.values()), cpu
    assert not [name for name in samples if name.endswith("_created")]
    url = f"http://127.0.0.1:{relay.metrics_port}/metrics"
    request = urllib.request.Request(url, headers={
        "Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"})
    with await asyncio.to_thread(urllib.request.urlopen, request, timeout=10) as reply:
        content_type, body = reply.headers["Content-Type"], reply.read().decode()
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith("# EOF")
    assert 'relay_worker_cpu_seconds_total{worker="1"}' in body
    assert "_created" not in body


async def test_readyz_is_503_until_a_killed_worker_serves_again(serve: Serve) -> None:
    """kill -9 of a worker: /readyz names it as not serving (503) until its replacement
    serves, then 200 again."""
    relay = await serve("--metrics-listen", "127.0.0.1:0")
    metrics_port = relay.metrics_port
    assert metrics_port is not None
    pid = relay.worker_pids()[1]
    os.kill(pid, signal.SIGKILL)
    await until(lambda: any("worker 1 exited" in str(e.get("message")) for e in relay.lines()),
                what="the supervisor saw the exit")
    status, body = await asyncio.to_thread(_readyz, metrics_port)  # its back-off: 0.5 s
    assert status == 503, body
    assert "worker(s) [1] not serving" in json.dumps(body), body
    await until(lambda: relay.worker_pids()[1] != pid, within_s=20, what="worker 1 restarted")

    async def ready() -> bool:
        return (await asyncio.to_thread(_readyz, metrics_port))[0] == 200
    await until(ready, within_s=20, what="/readyz 200 again")


async def test_sigterm_waits_for_the_message_in_flight_and_its_settle(
        serve: Serve, sink: Sink) -> None:
    """SIGTERM to the supervisor while a worker waits on the upstream: the client gets its 250,
    the SENT mark lands, the supervisor exits 0 after the workers."""
    relay = await serve()
    sink.handler.delay_s = 1.5  # holds the transaction after the final dot
    sending = asyncio.create_task(send(relay.port, ["user@example.net"], message()))
    await until(lambda: sink.handler.transactions == 1, what="the message reached the sink")
    relay.proc.send_signal(signal.SIGTERM)
    result = await sending
    code = await asyncio.to_thread(relay.proc.wait, 30)
    assert result.code == 250, result
    assert code == 0
    assert len(sink.handler.delivered) == 1
    assert await _record(relay.prefix, "user@example.net", "K-1") is State.SENT
    assert not any(relay.alive(pid) for pid in relay.worker_pids().values())


async def test_a_killed_worker_is_restarted_and_nothing_is_sent_twice(
        serve: Serve, sink: Sink) -> None:
    """kill -9 of a worker: the other keeps serving, the supervisor starts a new one at the
    same index, and a message sent again is still suppressed (one delivery)."""
    relay = await serve()
    first = await send(relay.port, ["user@example.net"], message())
    assert first.code == 250
    old = relay.worker_pids()
    os.kill(old[0], signal.SIGKILL)
    during = await send(relay.port, ["other@example.net"], message(key="K-2"))
    assert during.code == 250, during
    await until(lambda: relay.worker_pids().get(0) not in (None, old[0]), within_s=20,
                what="worker 0 restarted")
    assert relay.proc.poll() is None
    assert relay.worker_pids()[1] == old[1]
    results = [await send(relay.port, ["user@example.net"], message()) for _ in range(6)]
    assert all(r.code == 250 for r in results), results
    assert sink.handler.copies_to("user@example.net") == 1
    assert sink.handler.copies_to("other@example.net") == 1
    assert any("worker 0 exited (signal SIGKILL)" in str(e.get("message"))
               for e in relay.lines())


async def test_one_worker_runs_in_one_process(serve: Serve, sink: Sink) -> None:
    """``--workers 1``: the serve process is the relay itself (no child process, no
    supervisor line, no worker field), and it relays."""
    relay = await serve(workers=1)
    assert relay.children() == []
    assert not any(str(e.get("message", "")).startswith("supervisor") for e in relay.lines())
    assert all("worker" not in e for e in relay.lines())
    assert (await send(relay.port, ["user@example.net"], message())).code == 250
    assert len(sink.handler.delivered) == 1


def test_a_start_error_is_reported_once_with_its_exit_code(tmp_path: Path) -> None:
    """A Redis database number the server does not have (found only when a worker opens the
    store) with 2 workers: exit 78, the error printed once, no worker restarted."""
    result = run_cli("serve", "--workers", "2", "--listen", "127.0.0.1:0", "--upstream",
                     "maildir:md", "--store", "redis://127.0.0.1:6379/99", "--metrics-listen",
                     "off", "--log-format", "json", cwd=tmp_path)
    assert result.returncode == 78, result.stderr
    assert result.stderr.count("the Redis server has no database of that number") == 1, \
        result.stderr


async def test_a_supervisor_killed_with_sigkill_takes_its_workers_along(serve: Serve) -> None:
    """kill -9 of the supervisor: the workers die too (as one process would), the port is
    free for the next start."""
    relay = await serve()
    pids = relay.worker_pids()
    relay.proc.kill()
    await asyncio.to_thread(relay.proc.wait, 10)
    await until(lambda: not any(relay.alive(pid) for pid in pids.values()),
                what="the workers ended with their supervisor")


async def test_a_settle_journal_is_paid_once_by_worker_0(
        serve: Serve, tmp_path: Path) -> None:
    """A journal left by an earlier run (owing a SENT mark) is paid at the start of 2 workers:
    by worker 0 alone (one log line), the record is SENT and the file is gone."""
    prefix = f"test:workers:{uuid.uuid4().hex}:"
    key = store_key(prefix, fingerprint(normalize_recipient("user@example.net"), "welcome",
                                        "K-1"))
    store = RedisStore.from_url(REDIS_URL, op_timeout_s=2.0)
    try:
        await store.reserve([key], token="t-1", lease_s=60.0)
    finally:
        await store.close()
    journal = tmp_path / "owed.jsonl"  # the fixture's settle_journal
    add_to_journal(journal, [("t-1", SettleOp(key=key, action=Settle.SENT, reply="250 ok"))],
                   f"{REDIS_URL} prefix={prefix}")
    try:
        relay = await serve("--store-prefix", prefix)
        paid = [e for e in relay.lines() if "settle journal" in str(e.get("message"))]
        assert [e.get("worker") for e in paid] == [0], paid
        assert await _record(prefix, "user@example.net", "K-1") is State.SENT
        assert not journal.exists()
    finally:
        delete_prefix(REDIS_URL, prefix)


@pytest.mark.slow  # five starts with back-off: 7.5 s of waiting
def test_a_worker_that_never_starts_is_given_up_on_with_exit_69(tmp_path: Path) -> None:
    """Every worker process dies before serving (a sitecustomize exits it, status 3): the
    supervisor retries with back-off, then gives up (exit 69) instead of spinning."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import os\nif 'DEDUP_RELAY_WORKER' in os.environ:\n    os._exit(3)\n")
    result = run_cli("serve", "--workers", "2", "--listen", "127.0.0.1:0", "--upstream",
                     "maildir:md", "--store", REDIS_URL, "--metrics-listen", "off",
                     "--log-format", "json", cwd=tmp_path, env={"PYTHONPATH": str(shim)})
    assert result.returncode == 69, result.stderr
    tries = [line for line in result.stderr.splitlines() if "exited before serving" in line]
    assert len(tries) == 4, result.stderr  # the 5th failure ends it
    assert "could not start (exit code 3, 5 time(s)): giving up" in result.stderr


@pytest.mark.slow  # two relays started and stopped: about 10 s
def test_two_relays_started_at_once_on_one_port_one_serves_and_one_is_refused(
        tmp_path: Path) -> None:
    """Two relays with 2 workers started together on one port (both supervisors bind before
    either's worker listens): one serves, the other exits 69 at once with 'already in use'
    naming the setting, no traceback, instead of workers dying on a closed socket in a loop."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    procs = []
    for name in ("a", "b"):
        home = tmp_path / name
        home.mkdir()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "--workers", "2", "--listen",
             f"127.0.0.1:{port}", "--upstream", "maildir:md", "--metrics-listen", "off"],
            cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 30
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = [p for p in procs if p.poll() is not None]
        assert len(refused) == 1, "neither relay was refused within 30 s"
        [serving] = [p for p in procs if p is not refused[0]]
        wait_for_port(port, serving)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        outputs = [proc.communicate(timeout=60)[1] for proc in procs]
    lost = outputs[procs.index(refused[0])]
    assert refused[0].returncode == 69, lost
    assert "already in use" in lost and "(--listen, RELAY_LISTEN" in lost, lost
    assert not any("Traceback" in out for out in outputs), outputs


def _hang_up_new_children(relay: ServeProcess, stop: threading.Event) -> set[int]:
    """Send SIGHUP to every child of ``relay`` within a millisecond or two of its showing in
    /proc (a new worker's interpreter takes tens of milliseconds to reach its handler) until
    ``stop`` is set; the pids signalled. The pause between looks keeps this thread off the
    CPU the workers' starts need (a loop without one takes a core of two, and the GIL)."""
    seen: set[int] = set()
    while not stop.wait(0.001):
        with contextlib.suppress(OSError, ValueError):
            for pid in relay.children():
                if pid not in seen:
                    seen.add(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGHUP)
    return seen


@pytest.mark.timeout(240)  # four worker starts: each imports the relay, slow on a loaded runner
async def test_a_sighup_to_a_worker_still_starting_does_not_end_it(serve: Serve, sink: Sink
                                                                   ) -> None:
    """SIGHUP sent to each new worker process the moment it exists (before its handler is set),
    over two restarts, one of each worker: no worker dies of it, the relay keeps both workers,
    and it relays."""
    relay = await serve()
    stop = threading.Event()
    watcher = asyncio.create_task(asyncio.to_thread(_hang_up_new_children, relay, stop))
    try:
        for restart in range(2):
            index = restart % 2
            old = relay.worker_pids()[index]
            os.kill(old, signal.SIGKILL)

            def back(index: int = index, old: int = old) -> bool:
                return (relay.worker_pids().get(index) not in (None, old)
                        or relay.proc.poll() is not None)

            await until(back, within_s=30, what=f"worker {index} back")
            assert relay.proc.poll() is None, relay.lines()[-5:]
    finally:
        stop.set()
        signalled = await watcher
    assert len(signalled) >= 2
    exits = [str(e.get("message")) for e in relay.lines() if "exited" in str(e.get("message"))]
    assert not any("SIGHUP" in line for line in exits), exits
    assert (await send(relay.port, ["user@example.net"], message())).code == 250
