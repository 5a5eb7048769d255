"""``/readyz`` answers whatever fails while readiness is read: a 503 with a JSON body naming
the error, never aiohttp's 500 (the traceback goes to the log). The failing readiness stands
for a reader bug no real part produces on demand any more (prometheus-client's reader raised
``struct.error`` on a worker's 0-byte file: tests/system/lifecycle/
test_unreadable_metrics_files.py has the real files)."""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from relay.ops.health import ComponentStatus
from relay.ops.http import OpsServer


class UnreadableReadiness:
    """A :class:`relay.ops.health.Readiness` whose every read raises as prometheus-client's
    reader of a 0-byte file did."""

    def status(self) -> dict[str, ComponentStatus]:
        raise struct.error("unpack_from requires a buffer of at least 4 bytes")

    @property
    def ready(self) -> bool:
        raise struct.error("unpack_from requires a buffer of at least 4 bytes")

    def upstreams(self) -> dict[str, dict[str, object]]:
        return {}

    def ledger(self) -> dict[str, object]:
        return {}


def _readyz(port: int) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as reply:
            return int(reply.status), reply.headers.get_content_type(), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get_content_type(), exc.read().decode()


async def test_readiness_that_cannot_be_read_is_a_503_with_json(
        caplog: pytest.LogCaptureFixture) -> None:
    """``/readyz`` is 503 ``{"ready": false, "error": ...}`` naming the error; the log has
    the traceback."""
    server = OpsServer(registry=CollectorRegistry(), health=UnreadableReadiness(),
                       host="127.0.0.1", port=0)
    await server.start()
    try:
        with caplog.at_level(logging.ERROR, logger="relay.ops.http"):
            status, kind, body = await asyncio.to_thread(_readyz, server.port)
    finally:
        await server.stop()
    assert (status, kind) == (503, "application/json"), body
    answer = json.loads(body)
    assert answer["ready"] is False
    assert answer["error"].startswith("readiness could not be read: error: unpack_from"), answer
    assert any(r.exc_info for r in caplog.records if r.name == "relay.ops.http")
