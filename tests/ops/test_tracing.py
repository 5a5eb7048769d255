"""OpenTelemetry tracing (design.md §6.8): which ``OTEL_*`` environment turns it on (one row per
rule), and real ``python -m relay serve`` processes exporting with
``OTEL_TRACES_EXPORTER=console`` and over OTLP/HTTP to a receiver on loopback. The spans
themselves: tests/core/test_message_spans.py."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from relay.core.errors import ConfigError
from relay.core.tracing import MESSAGE, RESERVE, SETTLE, UPSTREAM
from relay.ops.tracing import Exporters, check_tracing, exporters, start_tracing
from tests.support.clients import message, send
from tests.support.net import free_port
from tests.support.relays import start_serve

# ------------------------------------------------------------------------------------------
# the environment that turns tracing on
# ------------------------------------------------------------------------------------------

ENDPOINT = "http://127.0.0.1:4318"


@pytest.mark.parametrize(("env", "expected"), [
    ({}, Exporters()),
    ({"OTEL_SERVICE_NAME": "relay"}, Exporters()),
    ({"OTEL_TRACES_EXPORTER": "console"}, Exporters(("console",))),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, Exporters(("otlp", "console"))),
    ({"OTEL_TRACES_EXPORTER": "none"}, Exporters()),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, Exporters()),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}, Exporters(("otlp",))),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ENDPOINT}, Exporters(("otlp",))),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     Exporters(("otlp",), "grpc")),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, Exporters(("otlp",))),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, Exporters()),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "false"},
     Exporters(("console",))),
], ids=["unset", "service-name-only", "console", "two", "none", "none-beats-endpoint",
        "endpoint", "traces-endpoint", "grpc", "traces-protocol-first", "sdk-disabled",
        "sdk-enabled"])
def test_the_environment_decides_the_exporters(env: dict[str, str],
                                               expected: Exporters) -> None:
    assert exporters(env) == expected


@pytest.mark.parametrize(("env", "names"), [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "zipkin"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "http/json"),
])
def test_an_exporter_the_relay_cannot_build_is_a_configuration_error(
        env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace("/", "/")):
        exporters(env)


def test_a_protocol_is_not_checked_when_no_otlp_exporter_is_asked_for() -> None:
    assert exporters({"OTEL_TRACES_EXPORTER": "console",
                      "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}).names == ("console",)


def test_the_grpc_exporter_not_installed_names_its_package() -> None:
    """The ``otel`` extra carries the HTTP exporter; gRPC's (grpcio) is the operator's to add."""
    with pytest.raises(ConfigError, match="pip install opentelemetry-exporter-otlp-proto-grpc"):
        check_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
                       "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})


# ------------------------------------------------------------------------------------------
# real relay processes
# ------------------------------------------------------------------------------------------


async def test_the_console_exporter_prints_a_messages_spans(tmp_path: Path) -> None:
    """``OTEL_TRACES_EXPORTER=console``: one JSON object per span on stdout, the queue id of the
    reply on the message span, the service named ``dedup-relay``, no address in any of it."""
    relay = await start_serve(
        tmp_path, "--upstream", "maildir:md", "--metrics-listen", "off", "--store",
        f"sqlite:///{tmp_path}/store.db", workers=1,
        env={"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "50"})
    try:
        reply = await send(relay.port, ["someone@example.net"], message())
    finally:
        assert relay.stop() == 0
    assert reply.code == 250, reply
    queue_id = reply.text.rsplit("id=", 1)[1].strip()
    spans = [e for e in relay.lines() if "context" in e and "name" in e]
    named = {s["name"]: s for s in spans}
    assert set(named) == {MESSAGE, RESERVE, UPSTREAM, SETTLE}, spans
    root = named[MESSAGE]
    assert root["attributes"]["relay.queue_id"] == queue_id
    assert root["resource"]["attributes"]["service.name"] == "dedup-relay"
    assert {s["parent_id"] for s in spans if s is not root} == {root["context"]["span_id"]}
    assert "someone" not in json.dumps(spans)
    decision = next(e for e in relay.lines() if e.get("message") == "message")
    assert decision["trace_id"] == root["context"]["trace_id"].removeprefix("0x")


class OtlpReceiver:
    """An OTLP/HTTP trace receiver (``POST /v1/traces``, protobuf) on loopback."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    async def _traces(self, request: web.Request) -> web.Response:
        received = ExportTraceServiceRequest()
        received.ParseFromString(await request.read())
        self.requests.append(received)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """Every span received, with its resource's attributes."""
        found: list[tuple[dict[str, Any], Any]] = []
        for req in self.requests:
            for resource_spans in req.resource_spans:
                resource = {a.key: a.value.string_value or a.value.int_value
                            for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    found.extend((resource, span) for span in scope.spans)
        return found


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    r = OtlpReceiver()
    await r.start()
    yield r
    await r.stop()


async def test_every_worker_exports_its_spans_over_otlp_http(
        tmp_path: Path, receiver: OtlpReceiver) -> None:
    """Two workers, twenty messages on twenty connections (the kernel spreads them over both
    workers): every message's span reaches the receiver, from both worker processes, once the
    relay stopped (its queued spans are exported on the way out), with the reply code its client
    got; a relayed message's trace holds its reserve, upstream and settle. (A loaded runner may
    answer a message 4yz, a store timeout: its span says so, as its reply did.)"""
    relay = await start_serve(
        tmp_path, "--upstream", "maildir:md", "--metrics-listen", "off", "--store",
        f"sqlite:///{tmp_path}/store.db", workers=2,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
             "OTEL_SERVICE_NAME": "relay-under-test", "OTEL_BSP_SCHEDULE_DELAY": "60000"})
    try:
        replies = await asyncio.gather(*(
            send(relay.port, [f"user{i}@example.net"], message(key=f"K-{i}"))
            for i in range(20)))
    finally:
        # off the loop: the receiver runs on it, and the relay exports as it stops
        assert await asyncio.to_thread(relay.stop, signal.SIGTERM) == 0
    assert sum(r.code == 250 for r in replies) > 0, replies
    spans = receiver.spans()
    traces: dict[bytes, list[Any]] = {}
    for _, span in spans:
        traces.setdefault(span.trace_id, []).append(span)
    roots = [span for _, span in spans if span.name == MESSAGE]
    codes = sorted(next(a.value.int_value for a in root.attributes
                        if a.key == "smtp.reply_code") for root in roots)
    assert codes == sorted(r.code for r in replies)
    assert len(traces) == 20
    for root in roots:
        names = sorted(span.name for span in traces[root.trace_id])
        result = next(a.value.string_value for a in root.attributes if a.key == "relay.result")
        if result == "relayed":
            assert names == sorted([MESSAGE, RESERVE, UPSTREAM, SETTLE]), names
    assert {resource["service.name"] for resource, _ in spans} == {"relay-under-test"}
    assert len({resource["process.pid"] for resource, _ in spans}) == 2


async def test_the_stop_waits_for_a_silent_collector_no_longer_than_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector that takes the connection and never answers: the tracer's stop gives up
    after its bound (the SDK's exporter would wait its own 10 s per attempt, and retry)."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT",
                           f"http://127.0.0.1:{silent.getsockname()[1]}")
        tracer = start_tracing({"OTEL_TRACES_EXPORTER": "otlp"})
        assert tracer is not None
        with tracer.span(MESSAGE):
            pass
        started = time.monotonic()
        assert await asyncio.to_thread(tracer.shutdown, 1.0) is False
        assert time.monotonic() - started < 3.0
    finally:
        silent.close()


def test_the_resource_attributes_of_the_environment_win(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``service.version`` and ``process.pid`` are the relay's defaults: an operator's
    ``OTEL_RESOURCE_ATTRIBUTES`` overrides them (and ``service.name`` stays the relay's
    unless named)."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.version=build-7,team=mail")
    tracer = start_tracing({"OTEL_TRACES_EXPORTER": "console"})
    assert tracer is not None
    with tracer.span(MESSAGE):
        pass
    assert tracer.shutdown(5.0)
    span = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    attributes = span["resource"]["attributes"]
    assert attributes["service.version"] == "build-7" and attributes["team"] == "mail"
    assert attributes["service.name"] == "dedup-relay" and "process.pid" in attributes
