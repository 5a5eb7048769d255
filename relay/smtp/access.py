"""Who may use the relay: client networks, connection limits, sender patterns.

:class:`ConnectionGate` is shared by every session of one listener (no global state): it
decides at connect time, before the greeting, whether a client may talk to the relay, and
counts open connections overall and per client address. Refusals are ``421 4.7.0``
(RFC 5321 section 3.1 allows a 421 greeting; RFC 3463 X.7.0 "other security status").
"""

from __future__ import annotations

import fnmatch
import ipaddress
from collections import Counter
from collections.abc import Sequence

from relay.core import replies
from relay.core.interfaces import SmtpReply

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(cidrs: Sequence[str]) -> tuple[Network, ...]:
    """CIDR strings to networks (host bits allowed). Raises ValueError for a bad one."""
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def address_in(host: str, networks: Sequence[Network]) -> bool:
    """True when the IP address ``host`` (IPv4-mapped IPv6 counts as IPv4) is in a network."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in networks)


class ConnectionGate:
    """Admits or refuses client connections; one per listener.

    ``allowed``: networks whose clients may connect (for PROXY protocol connections the
    check is made on the proxied source address, see :meth:`allows`); ``max_total`` and
    ``max_per_ip``: open connections at once, in all and from one address.
    """

    def __init__(self, *, allowed: Sequence[Network], max_total: int, max_per_ip: int) -> None:
        self._allowed = tuple(allowed)
        self._max_total = max_total
        self._max_per_ip = max_per_ip
        self._total = 0
        self._open: Counter[str] = Counter()

    def set_allowed(self, allowed: Sequence[Network]) -> None:
        """Admit clients of ``allowed`` from now on (a configuration reload): new connections
        are checked against them; open ones stay."""
        self._allowed = tuple(allowed)

    def allows(self, host: str) -> bool:
        """True when ``host`` is in an allowed network."""
        return address_in(host, self._allowed)

    def admit(self, host: str | None) -> SmtpReply | None:
        """Count a new connection, and with ``host`` one from that client address; the
        refusal when over a limit (then nothing is counted). ``host`` is None behind a PROXY
        balancer until its header names the client (:meth:`admit_host`)."""
        if self._total >= self._max_total:
            return replies.TOO_MANY_CONNECTIONS
        if host is not None and (refusal := self.admit_host(host)) is not None:
            return refusal
        self._total += 1
        return None

    def admit_host(self, host: str) -> SmtpReply | None:
        """Count one more connection from the client address ``host``, or refuse it."""
        if self._open[host] >= self._max_per_ip:
            return replies.TOO_MANY_CONNECTIONS_FROM_HOST
        self._open[host] += 1
        return None

    def release(self, host: str | None) -> None:
        """Uncount a connection that :meth:`admit` counted (``host``: the address it was
        counted under, by admit or admit_host, or None)."""
        self._total -= 1
        if host is None:
            return
        self._open[host] -= 1
        if self._open[host] <= 0:
            del self._open[host]

    def enter(self, host: str, proxy_networks: Sequence[Network] | None) -> SmtpReply | None:
        """Admit a TCP connection from ``host`` before a byte is exchanged: the 421 refusal,
        or None when it was counted. With ``proxy_networks`` (PROXY protocol) the peer must
        be a trusted balancer and only the total is counted here; the client's address is
        checked and counted when the header arrives."""
        if proxy_networks is not None:
            if not address_in(host, proxy_networks):
                return replies.CLIENT_NOT_ALLOWED
            return self.admit(None)
        if not self.allows(host):
            return replies.CLIENT_NOT_ALLOWED
        return self.admit(host)


def sender_allowed(address: str, patterns: Sequence[str]) -> bool:
    """True when no patterns are set, or the reverse path matches one (case-insensitive glob).

    Patterns are shell globs (``*@example.com``, ``app-*@example.com``); the null reverse path
    ``<>`` is matched as the empty string (allow it with a pattern ``""`` or ``*``).
    """
    if not patterns:
        return True
    text = "" if address == "<>" else address.lower()
    return any(fnmatch.fnmatchcase(text, p.lower()) for p in patterns)
