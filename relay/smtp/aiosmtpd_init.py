"""aiosmtpd 1.4.6's ``SMTP.__init__`` without its per-connection introspection.

aiosmtpd builds three maps in every session's constructor: the AUTH mechanisms
(``inspect.getmembers`` of the session and of the handler, which reads every attribute), the
``handle_*`` hooks (``dir`` of the handler, ``inspect.signature`` of its EHLO hook) and the
``smtp_*`` commands (``dir`` of the session). They depend only on the session class, the handler
class and the excluded mechanisms, so :func:`init_smtp` finds their names once per such triple
and binds them per session; every other attribute is set as aiosmtpd sets it.
tests/smtp/test_aiosmtpd_init.py compares the result with aiosmtpd's own constructor (aiosmtpd
is pinned: an upgrade that sets other attributes fails that test).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import ssl
from collections.abc import Iterable
from typing import Any, NamedTuple

from aiosmtpd import smtp as aiosmtpd_smtp
from aiosmtpd.smtp import SMTP

log = logging.getLogger("mail.log")  # aiosmtpd's logger


class Introspected(NamedTuple):
    """The attribute names aiosmtpd's constructor finds by introspection."""

    auth: tuple[tuple[str, str, bool], ...]  # (mechanism, attribute, on the session: builtin)
    hooks: tuple[str, ...]  # handler attributes handle_X, as X
    ehlo_hook_ver: str | None  # "new" (5 parameters), "old" (4) or None (no handle_EHLO)
    commands: tuple[str, ...]  # session attributes smtp_X, as X


_CACHE: dict[tuple[type[Any], type[Any], tuple[str, ...]], Introspected] = {}


def introspect(session: SMTP, handler: Any, exclude: tuple[str, ...]) -> Introspected:
    """The names for ``type(session)`` and ``type(handler)`` without the ``exclude``\\ d
    mechanisms, computed on the first call for that triple (instance attributes of the handler
    named ``auth_*``/``handle_*`` are not looked for: the relay's handler has none).

    Raises RuntimeError for a ``handle_EHLO`` with neither 4 nor 5 parameters (as aiosmtpd).
    """
    key = (type(session), type(handler), exclude)
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = _introspect(session, handler, exclude)
    return found


def _introspect(session: SMTP, handler: Any, exclude: tuple[str, ...]) -> Introspected:
    auth: dict[str, tuple[str, bool]] = {}
    for obj in (session, handler):
        for name in dir(obj):  # sorted, like inspect.getmembers; the handler's win
            if name.startswith("auth_"):
                member = getattr(obj, name)
                mechanism = getattr(member, "__auth_mechanism_name__",
                                    name.replace("auth_", "").replace("__", "-"))
                auth[mechanism] = (name, obj is session)
    for mechanism in exclude:
        auth.pop(mechanism, None)
    hooks = tuple(m.replace("handle_", "") for m in dir(handler) if m.startswith("handle_"))
    ehlo_hook_ver: str | None = None
    if "EHLO" in hooks:
        parameters = len(inspect.signature(handler.handle_EHLO).parameters)
        if parameters not in (4, 5):
            raise RuntimeError("Unsupported EHLO Hook")
        ehlo_hook_ver = "old" if parameters == 4 else "new"
    commands = tuple(m.replace("smtp_", "") for m in dir(session) if m.startswith("smtp_"))
    return Introspected(tuple((m, n, own) for m, (n, own) in auth.items()), hooks,
                        ehlo_hook_ver, commands)


def init_smtp(session: SMTP, handler: Any, *, data_size_limit: int | None = 33554432,
              enable_SMTPUTF8: bool = False, decode_data: bool = False,
              hostname: str | None = None, ident: str | None = None,
              tls_context: ssl.SSLContext | None = None, require_starttls: bool = False,
              timeout: float = 300, auth_required: bool = False,
              auth_require_tls: bool = True,
              auth_exclude_mechanism: Iterable[str] | None = None,
              auth_callback: Any = None, command_call_limit: int | dict[str, int] | None = None,
              authenticator: Any = None, proxy_protocol_timeout: float | None = None,
              loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Set up ``session`` as ``SMTP.__init__(session, handler, ...)`` of aiosmtpd 1.4.6 does
    (same keywords and defaults; raises ValueError/TypeError/RuntimeError as it does), with
    the introspected names from :func:`introspect`. It does not warn about AUTH without TLS
    (the relay sets ``_auth_require_tls`` itself, :class:`relay.smtp.session.RelaySMTP`), nor
    on every connection about a ``proxy_protocol_timeout`` under 3 s (the operator's setting,
    checked once in :mod:`relay.settings.access`)."""
    s: Any = session  # aiosmtpd's attributes, untyped to mypy
    s.__ident__ = ident or aiosmtpd_smtp.__ident__
    if loop is None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = aiosmtpd_smtp.make_loop()
    s.loop = loop
    asyncio.StreamReaderProtocol.__init__(
        session, asyncio.StreamReader(loop=loop, limit=s.line_length_limit),
        client_connected_cb=s._cb_client_connected, loop=loop)
    s.event_handler = handler
    s.data_size_limit = data_size_limit
    s.enable_SMTPUTF8 = enable_SMTPUTF8
    s._decode_data = decode_data
    s.command_size_limits.clear()
    s.hostname = hostname or socket.getfqdn()
    s.tls_context = tls_context
    if tls_context:
        if tls_context.verify_mode not in {ssl.CERT_NONE, ssl.CERT_OPTIONAL}:
            log.warning("tls_context.verify_mode not in {CERT_NONE, CERT_OPTIONAL}; this "
                        "might cause client connection problems")
        elif tls_context.check_hostname:
            log.warning("tls_context.check_hostname == True; this might cause client "
                        "connection problems")
    s.require_starttls = tls_context and require_starttls
    s._timeout_duration = timeout
    s._timeout_handle = None
    s._tls_handshake_okay = True
    s._tls_protocol = None
    s._original_transport = None
    s.session = None
    s.envelope = None
    s.transport = None
    s._handler_coroutine = None
    s._auth_require_tls = auth_require_tls
    if proxy_protocol_timeout is not None and proxy_protocol_timeout <= 0:
        raise ValueError("proxy_protocol_timeout must be > 0")
    s._proxy_timeout = proxy_protocol_timeout
    if authenticator is not None:
        s._authenticator, s._auth_callback = authenticator, None
    else:
        s._auth_callback = auth_callback or aiosmtpd_smtp.login_always_fail
        s._authenticator = None
    s._auth_required = auth_required
    found = introspect(session, handler, tuple(auth_exclude_mechanism or ()))
    s._auth_methods = {
        mechanism: aiosmtpd_smtp._AuthMechAttr(getattr(session if own else handler, name), own)
        for mechanism, name, own in found.auth}
    s._handle_hooks = {name: getattr(handler, "handle_" + name) for name in found.hooks}
    s._ehlo_hook_ver = found.ehlo_hook_ver
    s._smtp_methods = {name: getattr(session, "smtp_" + name) for name in found.commands}
    _call_limits(s, command_call_limit)


def _call_limits(s: Any, command_call_limit: int | dict[str, int] | None) -> None:
    """aiosmtpd's per-command call limits."""
    if command_call_limit is None:
        s._enforce_call_limit = False
        return
    s._enforce_call_limit = True
    if isinstance(command_call_limit, int):
        s._call_limit_base = {}
        s._call_limit_default = command_call_limit
    elif isinstance(command_call_limit, dict):
        if not all(map(aiosmtpd_smtp.is_int, command_call_limit.values())):
            raise TypeError("All command_call_limit values must be int")
        s._call_limit_base = command_call_limit
        s._call_limit_default = command_call_limit.get("*", aiosmtpd_smtp.CALL_LIMIT_DEFAULT)
    else:
        raise TypeError("command_call_limit must be int or Dict[str, int]")
