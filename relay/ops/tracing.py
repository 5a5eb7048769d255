"""OpenTelemetry tracing of the relay's messages (design.md §6.8), configured by the standard
``OTEL_*`` environment variables and off unless they name an exporter.

:func:`exporters` reads the environment (a pure function of the mapping, one rule per row of
its docstring); :func:`check_tracing` is what ``serve`` and ``check-config`` run (a
:class:`ConfigError` names the ``otel`` extra when the SDK is not installed);
:func:`start_tracing` builds one worker's tracer (:class:`OtelTracer`). Each worker process
has its own provider and exporter (a span processor's thread does not survive a fork, and
workers are spawned, not forked); the spans the core opens are :mod:`relay.core.tracing`'s.

The SDK is imported only here and only when tracing is on: a relay with tracing off runs
without the ``otel`` extra.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relay import __version__
from relay.core.errors import ConfigError
from relay.core.http_rules import ReplyTooLarge, read_bounded
from relay.core.tracing import AttributeValue, Span

if TYPE_CHECKING:
    import requests
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("relay.ops.tracing")

INSTALL = "pip install 'dedup-relay[otel]'"
GRPC_INSTALL = "pip install opentelemetry-exporter-otlp-proto-grpc"
SERVICE_NAME = "dedup-relay"
"""``service.name`` unless ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` set one."""
FLUSH_S = 5.0
"""Seconds the spans still queued get to be exported when the relay stops."""

_KNOWN = ("otlp", "console")
_PROTOCOLS = {"http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
              "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"}


@dataclass(frozen=True)
class Exporters:
    """What the environment asks for: ``names`` (``otlp``, ``console``; empty: tracing off)
    and the OTLP protocol (``http/protobuf`` or ``grpc``)."""

    names: tuple[str, ...] = ()
    protocol: str = "http/protobuf"

    @property
    def on(self) -> bool:
        return bool(self.names)


def exporters(env: Mapping[str, str]) -> Exporters:
    """The trace exporters ``env`` configures (OpenTelemetry's environment variable spec).

    - ``OTEL_SDK_DISABLED=true``: off, whatever else is set.
    - ``OTEL_TRACES_EXPORTER``: a comma-separated list of ``otlp``, ``console``, ``none``
      (``none`` alone: off).
    - unset: ``otlp`` when ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
      ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, else off (the relay does not send spans to a
      default endpoint nobody configured).
    - the OTLP protocol: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else
      ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``http/protobuf``.

    Raises ConfigError for an exporter or a protocol the relay does not support.
    """
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return Exporters()
    listed = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if listed:
        names = tuple(dict.fromkeys(n.strip() for n in listed.split(",") if n.strip()))
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        names = ("otlp",)
    else:
        names = ()
    unknown = [n for n in names if n not in (*_KNOWN, "none")]
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not an exporter the "
                          f"relay supports (otlp, console, none)")
    names = tuple(n for n in names if n != "none")
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip().lower()
    if "otlp" in names and protocol not in _PROTOCOLS:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported "
                          f"(http/protobuf or grpc)")
    return Exporters(names=names, protocol=protocol)


def _missing(module: str, install: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError:
        return f"{module} does not import: {install}"
    return None


def check_tracing(env: Mapping[str, str]) -> Exporters:
    """The exporters ``env`` configures, each importable; ConfigError (exit 78) naming what to
    install when one is not (the ``otel`` extra, or the gRPC exporter)."""
    wanted = exporters(env)
    if not wanted.on:
        return wanted
    missing = _missing("opentelemetry.sdk.trace", INSTALL)
    if missing is None and "otlp" in wanted.names:
        install = GRPC_INSTALL if wanted.protocol == "grpc" else INSTALL
        missing = _missing(_PROTOCOLS[wanted.protocol], install)
    if missing is not None:
        raise ConfigError(f"tracing is configured (OTEL_* environment) but {missing}")
    return wanted


class _OtelSpan:
    """:class:`relay.core.tracing.Span` over an OpenTelemetry span."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    @property
    def recording(self) -> bool:
        return bool(self._span.is_recording())

    @property
    def trace_id(self) -> str:
        context = self._span.get_span_context()
        if not context.is_valid or not context.trace_flags.sampled:
            return ""
        return f"{context.trace_id:032x}"

    def set(self, name: str, value: AttributeValue) -> None:
        self._span.set_attribute(name, value)

    def fail(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode
        self._span.set_status(Status(StatusCode.ERROR, description))


class OtelTracer:
    """:class:`relay.core.tracing.Tracer` over one process's OpenTelemetry provider."""

    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("relay", __version__)

    @contextlib.contextmanager
    def _open(self, name: str) -> Iterator[Span]:
        with self._tracer.start_as_current_span(name) as span:
            yield _OtelSpan(span)

    def span(self, name: str) -> AbstractContextManager[Span]:
        return self._open(name)

    def shutdown(self, timeout_s: float = FLUSH_S) -> bool:
        """Export what is queued and stop the exporters, in a daemon thread waited for at
        most ``timeout_s`` seconds (the SDK's own flush does not keep to its timeout against
        a collector that does not answer); False when it did not end in time (the rest is
        dropped when the process exits). Blocks: call it off the event loop."""
        def stop() -> None:
            self._provider.force_flush(timeout_millis=int(timeout_s * 1000))
            self._provider.shutdown()

        worker = threading.Thread(target=stop, name="otel-shutdown", daemon=True)
        worker.start()
        worker.join(timeout_s)
        return not worker.is_alive()


MAX_COLLECTOR_REPLY_BYTES = 64 * 1024
"""What the OTLP/HTTP exporter reads of a collector's reply at most (an
``ExportTraceServiceResponse`` is a few bytes; the exporter only looks at its status)."""


def _exporter(name: str, protocol: str) -> Any:
    """One span exporter; the OTLP ones read their endpoint, headers, timeout, compression
    and certificates from the ``OTEL_EXPORTER_OTLP_*`` environment themselves. The OTLP/HTTP
    one sends through :func:`_collector_session`."""
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter(
            out=sys.stdout, formatter=lambda span: span.to_json(indent=None) + "\n")
    module = importlib.import_module(_PROTOCOLS[protocol])
    if protocol == "http/protobuf":
        return module.OTLPSpanExporter(session=_collector_session())
    return module.OTLPSpanExporter()


def _collector_session() -> requests.Session:
    """The requests session of the OTLP/HTTP exporter (the one its
    ``OTEL_PYTHON_EXPORTER_OTLP_HTTP_*CREDENTIAL_PROVIDER`` names, else a new one) with a
    response hook that reads a collector's reply within :data:`MAX_COLLECTOR_REPLY_BYTES`
    (:func:`relay.core.http_rules.read_bounded`): the exporter would read it whole."""
    import requests
    from opentelemetry.exporter.otlp.proto.http._common import _load_session_from_envvar

    session = _load_session_from_envvar(
        "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER") or requests.Session()
    session.hooks["response"].append(_bounded_reply)
    return session


def _bounded_reply(response: requests.Response, **_: Any) -> requests.Response:
    """A requests response hook: read at most :data:`MAX_COLLECTOR_REPLY_BYTES` of
    ``response`` and let the connection go. A longer reply keeps its status (the collector
    took the spans or not) and loses its body, with a WARNING."""
    length = response.headers.get("Content-Length", "")
    try:
        body = read_bounded(functools.partial(response.raw.read, decode_content=True),
                            limit=MAX_COLLECTOR_REPLY_BYTES,
                            declared=int(length) if length.isdigit() else None)
    except ReplyTooLarge as exc:
        log.warning("tracing: the OTLP collector %s answered HTTP %d with a %s: its body "
                    "is not read", response.url, response.status_code, exc)
        body = b""
    finally:
        response.close()
    response._content = body  # what .content and .text give
    return response


def start_tracing(env: Mapping[str, str]) -> OtelTracer | None:
    """This process's tracer: None when ``env`` (the process environment: the SDK reads its
    other variables from ``os.environ`` itself) configures no exporter, else an
    :class:`OtelTracer` exporting in batches (``OTEL_BSP_*``) to each
    exporter, its resource the ``OTEL_RESOURCE_ATTRIBUTES`` / ``OTEL_SERVICE_NAME`` ones over
    the defaults ``service.name`` ``dedup-relay``, ``service.version`` and ``process.pid``
    (which worker). Sampling is
    ``OTEL_TRACES_SAMPLER`` (default: every message). Raises ConfigError as
    :func:`check_tracing`."""
    wanted = check_tracing(env)
    if not wanted.on:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # the relay's values are defaults: OTEL_RESOURCE_ATTRIBUTES / OTEL_SERVICE_NAME win
    resource = Resource({"service.version": __version__, "process.pid": os.getpid()}).merge(
        Resource.create())
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    # stopped by the relay (OtelTracer.shutdown, bounded), not by an atexit hook
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for name in wanted.names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, wanted.protocol)))
    return OtelTracer(provider)
