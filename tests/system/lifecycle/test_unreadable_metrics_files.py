"""`serve --workers 2`: the supervisor's ``/readyz`` and ``/metrics`` read the workers'
prometheus-client multiprocess files; one that cannot be read is skipped, never answered with
a 500 and a traceback. A worker creates its file before it sizes it (prometheus-client's own
open bug: a reader that comes in between meets a 0-byte file), and a disk that filled up can
leave one cut short. Real processes, real files in the workers' multiprocess directory."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.support.clients import message, send
from tests.support.metrics import scrape
from tests.support.relays import REDIS_URL, ServeProcess, delete_prefix, start_serve
from tests.support.sink import Sink
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def relay(tmp_path: Path, sink: Sink) -> AsyncIterator[ServeProcess]:
    """Two workers in front of ``sink`` on the test Redis (a fresh prefix), the metrics and
    health endpoint on a free port; stopped and its keys deleted at the end."""
    prefix = f"test:metrics-files:{uuid.uuid4().hex}:"
    served = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--store", REDIS_URL,
        "--store-prefix", prefix, "--settle-journal", str(tmp_path / "owed.jsonl"),
        "--metrics-listen", "127.0.0.1:0", workers=2)
    yield served
    await asyncio.to_thread(served.stop)
    delete_prefix(REDIS_URL, prefix)


def _multiprocess_dir(relay: ServeProcess) -> Path:
    """The workers' PROMETHEUS_MULTIPROC_DIR, read from a worker's environment."""
    pid = next(iter(relay.worker_pids().values()))
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    [value] = [v for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")]
    return Path(os.fsdecode(value.split(b"=", 1)[1]))


def _get(port: int, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of ``GET path``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return int(reply.status), reply.headers.get_content_type(), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get_content_type(), exc.read().decode()


def _zero_bytes(folder: Path) -> None:
    """A gauge file of a worker that created it and has not sized it yet."""
    (folder / "gauge_livemin_4000001.db").touch()


def _cut_short(folder: Path) -> None:
    """A copy of a live worker's counter file cut in the middle of its entries (its header
    still says how much of it is used)."""
    source = next(folder.glob("counter_*.db"))
    data = source.read_bytes()
    used = int.from_bytes(data[:4], "little")
    (folder / "counter_4000002.db").write_bytes(data[:max(12, used // 2)])


@pytest.mark.parametrize("spoil", [_zero_bytes, _cut_short], ids=["zero-bytes", "cut-short"])
async def test_an_unreadable_worker_file_is_skipped_by_readyz_and_metrics(
        relay: ServeProcess, sink: Sink, spoil: Callable[[Path], None]) -> None:
    """With an unreadable file beside the workers' own: ``/readyz`` answers 200 JSON (ready:
    every live worker's probes answered), ``/metrics`` answers 200 with every worker's
    counts, and neither body holds a traceback."""
    port = relay.metrics_port
    assert port is not None
    for n in range(4):
        assert (await send(relay.port, [f"u{n}@example.net"], message(key=f"K-{n}"))).code \
            == 250
    folder = _multiprocess_dir(relay)
    spoil(folder)

    async def ready() -> bool:
        return (await asyncio.to_thread(_get, port, "/readyz"))[0] == 200
    await until(ready, within_s=20, what="/readyz 200 beside the unreadable file")
    status, kind, body = await asyncio.to_thread(_get, port, "/readyz")
    assert (status, kind) == (200, "application/json"), body
    assert json.loads(body)["ready"] is True
    status, kind, text = await asyncio.to_thread(_get, port, "/metrics")
    assert status == 200 and "Traceback" not in text, text[:2000]
    samples = await asyncio.to_thread(scrape, port)
    assert sum(v for _, v in samples["relay_messages_total"]) == 4
