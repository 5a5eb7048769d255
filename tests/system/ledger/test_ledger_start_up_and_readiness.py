"""The store's and the ledger's schema checks at start-up, a read-only ledger, and the ledger's
part of ``/readyz``.

- A store or a ledger slow to connect at start-up still has its schema checked before the relay
  serves.
- ``ledger_required`` on a ledger that takes no writes (read-only) relays nothing: each message
  is answered ``451 4.3.0``.
- With ``--workers 2``, ``/readyz``'s ``ledger`` part carries the last ``error`` while the ledger
  is down, as one worker's body does (a known defect: strict xfail).

They run against the shared PostgreSQL on 127.0.0.1:5432 in private schemas; the first runs
``python -m relay serve`` behind a proxy that delays each new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import pytest

from relay.store.postgres import migrations
from tests.support.clients import message, send
from tests.support.metrics import readyz
from tests.support.net import free_port
from tests.support.postgres import POSTGRES_URL, _run, private_schema
from tests.support.relays import MakeRelay, start_serve
from tests.support.sink import Sink

CONNECT_DELAY_S = 0.6
"""Seconds the proxy waits before it opens each connection to PostgreSQL (more than 0.4 of
the 1 s store_timeout the relay is given, less than the timeout itself)."""


@contextlib.asynccontextmanager
async def _slow_proxy(delay_s: float) -> AsyncIterator[int]:
    """A TCP proxy on a free loopback port (yielded) to the test PostgreSQL that waits
    ``delay_s`` seconds before connecting each new client; closed at the end."""
    host, port = "127.0.0.1", 5432
    tasks: set[asyncio.Task[None]] = set()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await asyncio.sleep(delay_s)
            up_reader, up_writer = await asyncio.open_connection(host, port)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            writer.close()
        finally:
            tasks.discard(task)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _v1_schema(url: str) -> None:
    """The store's schema as the previous release left it: step 1 only, version 1."""
    step_1 = migrations._SCHEMA_TABLE_SQL + ";" + migrations._STORE_STEPS[0]  # constants
    await _run(step_1 + ";INSERT INTO dedup_relay_schema VALUES ('store', 1)", url)  # noqa: S608


START_WAIT_S = 60.0
"""How long a relay is given to start and judge its database (a loaded runner takes tens of
seconds to start Python processes)."""


async def _exits_69_or_names_the_schema(proc: asyncio.subprocess.Process, metrics: int,
                                        log: Path) -> None:
    """Wait up to START_WAIT_S for ``proc`` to exit 69 naming schema version 1, or for its
    /readyz to answer 503 with the store's error naming the schema (a 200, or a 503 for
    another reason, is waited past: it must come to name the schema)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_WAIT_S
    seen: object = None
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 0.5)
        text = await asyncio.to_thread(log.read_text, errors="replace")
        if proc.returncode is not None:
            assert proc.returncode == 69, (proc.returncode, text)
            assert "version 1" in text, text
            return
        with contextlib.suppress(OSError):  # its metrics port not open yet
            status, body = await asyncio.to_thread(readyz, metrics)
            seen = (status, body)
            if status == 503 and "schema" in str(body["components"]["store"]["error"]):
                return
        assert loop.time() < deadline, (seen, text)


async def test_a_store_slow_to_connect_at_start_up_still_has_its_schema_checked(
        tmp_path: Path) -> None:
    """Store schema version 1 behind a proxy that takes 0.6 s to open a connection,
    store_timeout 1 s, one rate limit: serve exits 69 (the schema message), or,
    if it keeps running, /readyz is 503 with the store's error naming the schema. A relay
    that skipped the check when its first connection was slow would run with /readyz
    flapping between 200 and 503 ("no PostgreSQL connection within 0.4 s": the cleanup's
    statements on the missing rate-limit tables fail and their connections are closed),
    never naming the schema."""
    with private_schema(upgraded=False) as url:
        await _v1_schema(url)
        async with _slow_proxy(CONNECT_DELAY_S) as port:
            slow_url = url.replace("127.0.0.1:5432", f"127.0.0.1:{port}")
            assert slow_url != url and url.startswith(POSTGRES_URL.rsplit("/", 1)[0])
            metrics = free_port()
            env = {"RELAY_RATE_LIMIT":
                   '[{"scope": "upstream", "messages": 5, "per": 300, "name": "up5"}]'}
            with (tmp_path / "serve.log").open("wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "relay", "serve", "--store", slow_url,
                    "--store-timeout", "1", "--upstream", "127.0.0.1:9", "--workers", "1",
                    "--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{metrics}",
                    cwd=tmp_path, env={**_clean_env(), **env}, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=log)
            try:
                await _exits_69_or_names_the_schema(proc, metrics, tmp_path / "serve.log")
            finally:
                if proc.returncode is None:
                    proc.terminate()
                    try:
                        await asyncio.wait_for(proc.wait(), 20)
                    except TimeoutError:
                        proc.kill()
                        await proc.wait()


def _clean_env() -> dict[str, str]:
    """This process's environment without RELAY_* variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}


async def test_ledger_required_on_a_read_only_ledger_relays_nothing(
        ledger_url: str, make_relay: MakeRelay, sink: Sink) -> None:
    """The ledger's table exists but its sessions take no writes (a standby-like session):
    with ledger_required, a message 2 s after start is answered 451 4.3.0 and nothing reaches
    the smarthost."""
    read_only = f"{ledger_url}&options={quote('-c default_transaction_read_only=on')}"
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=read_only,
                             ledger_required=True)
    await asyncio.sleep(2.0)
    answer = await send(relay.port, ["ro@example.net"], message(key="order-ro"))
    assert (answer.code, sink.handler.delivered) == (451, []), answer



@pytest.mark.xfail(strict=True, reason="with --workers 2 /readyz's ledger part has no "
                   "error while the ledger is down (one worker's body has it)")
async def test_readyz_ledger_part_carries_the_error_with_two_workers(
        sink: Sink, tmp_path: Path) -> None:
    """The ledger's server refuses connections (a closed port), `serve --workers 2`, one
    message relayed: /readyz's `ledger` part is `down` and carries the last `error`, as the
    README says ("`/readyz`'s `ledger` part carries the last `error` while it is down") and as
    a single worker's body does."""
    down = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    served = await start_serve(
        tmp_path, "--store", f"sqlite:///{tmp_path / 'd.db'}", "--ledger", down,
        "--upstream", f"127.0.0.1:{sink.port}", "--metrics-listen", "127.0.0.1:0", workers=2)
    try:
        assert served.metrics_port is not None
        answer = await send(served.port, ["w2@example.net"], message(key="order-w2"))
        assert answer.code == 250, answer
        part: dict[str, object] = {}
        for _ in range(30):  # up to 6 s for the failed write and the supervisor's poll
            _, body = await asyncio.to_thread(readyz, served.metrics_port)
            part = body["ledger"]
            if part.get("state") == "down" and part.get("error"):
                break
            await asyncio.sleep(0.2)
        assert part.get("state") == "down" and "refused" in str(part.get("error")), part
    finally:
        await asyncio.to_thread(served.stop)


async def test_a_ledger_slow_to_connect_at_start_up_still_has_its_schema_checked(
        tmp_path: Path) -> None:
    """A ledger database without the ledger's table behind a proxy that takes 2.5 s to open a
    connection (the ledger's calls wait 2 s of their 5 s for one): serve exits 69 naming
    `db upgrade --ledger`, as it does when the database answers quickly. A relay
    that skipped the check when its first connection was slow would log "audit ledger not
    reachable at start-up ... rows queue until it answers" and run, every row then failing
    ("relation dedup_relay_ledger does not exist")."""
    with private_schema(upgraded=False) as url:
        async with _slow_proxy(2.5) as port:
            slow_url = url.replace("127.0.0.1:5432", f"127.0.0.1:{port}")
            assert slow_url != url
            with (tmp_path / "serve.log").open("wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "relay", "serve",
                    "--store", f"sqlite:///{tmp_path / 'd.db'}", "--ledger", slow_url,
                    "--upstream", "127.0.0.1:9", "--workers", "1", "--listen", "127.0.0.1:0",
                    "--metrics-listen", "off", cwd=tmp_path, env=_clean_env(),
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), START_WAIT_S)
                text = (tmp_path / "serve.log").read_text(errors="replace")
                assert proc.returncode == 69 and "--ledger" in text, (proc.returncode, text)
            finally:
                if proc.returncode is None:
                    proc.terminate()
                    try:
                        await asyncio.wait_for(proc.wait(), 20)
                    except TimeoutError:
                        proc.kill()
                        await proc.wait()
