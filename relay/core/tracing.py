"""The spans of one message (design.md §6.8), behind a small Protocol.

:class:`Tracer` is what the wrappers that open the spans see (:mod:`relay.ops.traced`, built
only when tracing is on: a relay whose tracing is off makes no call to a tracer); the
OpenTelemetry one is :class:`relay.ops.tracing.OtelTracer`. Span names and attributes are
fixed here, so the wrappers and the docs name them once:

====================  ========================================================================
span                  attributes
====================  ========================================================================
``smtp.message``      ``relay.queue_id``, ``relay.recipients`` (count), ``relay.result``,
                      ``relay.outcomes`` (the recipients' outcomes, sorted, comma-separated),
                      ``smtp.reply_code``
``store.reserve``     ``relay.keys`` (count)
``upstream.transaction``  ``relay.recipients`` (count), ``relay.upstream`` (its label),
                      ``smtp.reply_code`` (the final dot's, or the refusal's; absent: no reply)
``store.settle``      ``relay.settles`` (count), ``relay.settle_actions`` (sorted,
                      comma-separated)
====================  ========================================================================

No attribute carries an address, a dedupe key or a fingerprint.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

AttributeValue = str | int | float | bool

MESSAGE = "smtp.message"
RESERVE = "store.reserve"
UPSTREAM = "upstream.transaction"
SETTLE = "store.settle"


class Span(Protocol):
    """One open span."""

    @property
    def recording(self) -> bool:
        """Whether it is kept (sampled): attributes set on a span that is not are dropped, so
        a caller may skip the work of building them."""

    @property
    def trace_id(self) -> str:
        """Its trace's id, 32 lowercase hex digits (W3C Trace Context); empty when it is not
        sampled (no exporter will hold that trace)."""

    def set(self, name: str, value: AttributeValue) -> None:
        """Set attribute ``name``."""

    def fail(self, description: str) -> None:
        """Mark the span as failed (an exception leaving the span marks it on its own)."""


class Tracer(Protocol):
    """Opens spans; a span opened inside another one's ``with`` block (in the same task, or in
    a task created there) is its child."""

    def span(self, name: str) -> AbstractContextManager[Span]:
        """A context manager that opens span ``name`` and ends it on exit."""
