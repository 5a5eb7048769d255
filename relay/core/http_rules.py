"""The rules the relay's HTTP clients keep with a peer they do not control (a token endpoint,
an identity provider's discovery document, an OTLP collector). Pure functions, no I/O: the
clients (:mod:`relay.upstream.oauth`, :mod:`relay.upstream.token_http`,
:mod:`relay.ops.tracing`) apply them to their own library's request and response.

- Where a secret may go (:func:`endpoint_refusal`): ``https://`` anywhere; plain ``http://``
  only to this machine (a loopback address or ``localhost``, RFC 6761 section 6.3), and, for
  an Azure managed identity, to a link-local address (the instance metadata service,
  ``169.254.169.254``, RFC 3927: never routed off the link).
- How much of a reply is read (:func:`read_bounded`): the declared ``Content-Length`` first
  (RFC 9110 section 8.6), then at most one byte past the bound, whatever the peer sends.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from urllib.parse import urlsplit

from relay.core.escape import escaped


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an IP literal or a name) is this machine: a loopback address
    (127.0.0.0/8, ::1) or ``localhost`` / ``*.localhost`` (RFC 6761 section 6.3)."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _is_link_local(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_link_local
    except ValueError:
        return False


def endpoint_refusal(url: str, *, link_local: bool = False) -> str | None:
    """None when a request carrying a secret may go to ``url``; else why not, in words for a
    log line or a configuration error (``plain http to a host that is not this machine``).
    ``link_local``: a plain-http link-local address literal is allowed too."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return "not a URL"
    if parts.scheme == "https" and host:
        return None
    if parts.scheme != "http" or not host:
        return f"not an https:// URL (scheme {parts.scheme or 'none'!r})"
    if is_loopback_host(host) or (link_local and _is_link_local(host)):
        return None
    return ("plain http to a host that is not this machine (only https://, or http:// to "
            "loopback" + (" or a link-local address" if link_local else "") + ")")


class ReplyTooLarge(Exception):
    """A peer's reply is longer than the reader's bound; the text says how long."""


def refuse_declared(declared: int | None, limit: int) -> None:
    """Raise :class:`ReplyTooLarge` when a reply's declared length (its ``Content-Length``,
    None when it has none) is over ``limit`` bytes: nothing of it need be read."""
    if declared is not None and declared > limit:
        raise ReplyTooLarge(f"reply of {declared} bytes refused (at most {limit})")


def read_bounded(read: Callable[[int], bytes], *, limit: int,
                 declared: int | None) -> bytes:
    """The reply whose body ``read(n)`` gives (at most ``n`` bytes a call, ``b""`` at its end)
    when it is at most ``limit`` bytes long. Raises :class:`ReplyTooLarge` when its declared
    length (:func:`refuse_declared`: nothing read) or what it sends is longer (after reading
    at most ``limit`` + 1 bytes)."""
    refuse_declared(declared, limit)
    body = bytearray()
    while len(body) <= limit:
        chunk = read(limit + 1 - len(body))
        if not chunk:
            return bytes(body)
        body += chunk
    raise ReplyTooLarge(f"reply over {limit} bytes refused")


def printable_excerpt(text: str, limit: int = 200) -> str:
    """At most ``limit`` characters of ``text`` a peer wrote (an error description), its
    control characters (C0, DEL, C1) escaped as ``\\xNN`` (:func:`relay.core.escape.escaped`):
    fit for one log line, whatever the peer put in it."""
    return escaped(text[:limit])
