"""relay.smtp.aiosmtpd_init: a session set up without per-connection introspection is the
session aiosmtpd's own constructor makes (every attribute, every bound hook), and the
introspection runs once per session class, handler class and excluded mechanisms."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from aiosmtpd.smtp import SMTP
from prometheus_client import CollectorRegistry

from relay.ops.metrics import PrometheusMetrics
from relay.smtp import aiosmtpd_init, session
from relay.smtp.access import ConnectionGate, parse_networks
from relay.smtp.handler import ListenerLimits, ListenerSecurity, RelayHandler, smtp_factory
from relay.smtp.session import RelaySMTP
from relay.smtp.tls import server_context
from tests.support.pki import Pki


def _aiosmtpd_init(smtp: SMTP, handler: Any, **kwargs: Any) -> None:
    """What RelaySMTP did before: aiosmtpd's constructor, auth_require_tls set after it."""
    auth_require_tls = kwargs.pop("auth_require_tls", True)
    SMTP.__init__(smtp, handler, auth_require_tls=True, **kwargs)
    smtp._auth_require_tls = auth_require_tls


def _shape(value: Any, owner: object, handler: object) -> Any:
    """``value`` comparable across two sessions: bound methods by function and owner."""
    if inspect.ismethod(value):
        bound_to = ("session" if value.__self__ is owner
                    else "handler" if value.__self__ is handler else value.__self__)
        return ("method", value.__func__, bound_to)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # _AuthMechAttr
        return (type(value), tuple(_shape(v, owner, handler) for v in value))
    if isinstance(value, dict):
        return {k: _shape(v, owner, handler) for k, v in value.items()}
    if isinstance(value, asyncio.StreamReader):
        return ("reader", value._limit)  # type: ignore[attr-defined]
    if isinstance(value, asyncio.Future):
        return ("future", value.done())
    if type(value).__name__ == "ReferenceType":
        return ("weakref", _shape(value(), owner, handler))
    return value


def _attributes(smtp: SMTP, handler: object) -> dict[str, Any]:
    return {k: _shape(v, smtp, handler) for k, v in vars(smtp).items()}


def _handler() -> RelayHandler:
    metrics = PrometheusMetrics(registry=CollectorRegistry())
    limits = ListenerLimits(hostname="relay.test")
    return RelayHandler(core=None, metrics=metrics, limits=limits)  # type: ignore[arg-type]


def _securities(pki: Pki) -> list[tuple[ListenerSecurity, bool]]:
    gate = ConnectionGate(allowed=parse_networks(["127.0.0.0/8"]), max_total=5, max_per_ip=5)
    tls = server_context(pki.cert, pki.key)
    return [
        (ListenerSecurity(gate=gate), False),
        (ListenerSecurity(gate=gate, tls_context=tls, tls_required=True, auth_enabled=True,
                          auth_required=True,
                          proxy_networks=parse_networks(["127.0.0.0/8"])), False),
        (ListenerSecurity(gate=gate, tls_context=tls, auth_enabled=True), True),
    ]


async def test_a_session_is_set_up_as_aiosmtpd_sets_it_up(
        pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listener without TLS or AUTH, with STARTTLS, required AUTH and PROXY, and the
    implicit-TLS port: the same attributes and values as aiosmtpd's constructor gives."""
    handler = _handler()
    limits = ListenerLimits(hostname="relay.test")
    for security, implicit in _securities(pki):
        factory = smtp_factory(handler, limits, security, 60.0, implicit_tls=implicit)
        fast = factory()
        with monkeypatch.context() as patch:
            patch.setattr(session, "init_smtp", _aiosmtpd_init)
            reference = factory()
        assert _attributes(fast, handler) == _attributes(reference, handler)
        assert set(fast._auth_methods) == ({"LOGIN", "PLAIN"} if security.auth_enabled
                                           else set())


async def test_introspection_runs_once_per_session_and_handler_class() -> None:
    """A second session of the same classes binds the names found for the first."""
    handler = _handler()
    gate = ConnectionGate(allowed=parse_networks(["127.0.0.0/8"]), max_total=5, max_per_ip=5)
    factory = smtp_factory(handler, ListenerLimits(hostname="relay.test"),
                           ListenerSecurity(gate=gate), 60.0)
    aiosmtpd_init._CACHE.clear()
    first, second = factory(), factory()
    assert len(aiosmtpd_init._CACHE) == 1
    found = next(iter(aiosmtpd_init._CACHE.values()))
    assert "DATA" in found.commands and "EHLO" in found.hooks
    assert second._smtp_methods["DATA"].__self__ is second  # bound per session
    assert first._smtp_methods["DATA"].__self__ is first
    assert isinstance(first, RelaySMTP)
