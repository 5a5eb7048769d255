"""Store URLs that name a Redis Cluster or a Sentinel-managed master: parsing only, no I/O.

::

    redis+cluster://[user:password@]host[:port][,host[:port]...][/0][?option=value&...]
    redis+sentinel://[user:password@]host[:port][,host[:port]...]/service[/db][?option=value&...]

``rediss+cluster://`` and ``rediss+sentinel://`` are the same over TLS (for Sentinel: to the
sentinels and to the servers). Cluster hosts are startup nodes (port 6379 when left out): one
that answers is enough, the client learns the others from ``CLUSTER SLOTS`` and again after a
failover. Sentinel hosts are sentinels (port 26379 when left out), asked for the master of
``service`` on every new connection, so the client follows a failover. An IPv6 host is written
in brackets: ``[::1]:7000``.

The user and password of the URL (percent-encoded) authenticate to the Redis servers. Sentinels
that need credentials of their own get the options ``sentinel_username`` and
``sentinel_password``. The other options are redis-py connection arguments: ``socket_timeout``
and ``socket_connect_timeout`` (seconds; the store's operation timeout when left out),
``socket_keepalive``, ``health_check_interval``, ``max_connections``, ``protocol``,
``client_name`` and, with ``rediss+``, ``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_ca_data``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname``, ``ssl_min_version``,
``ssl_ciphers``. Any other option, or a value of the wrong type, is refused when the URL is
parsed (so ``check-config`` reports it), not at the first connection.

This module imports no I/O library, so the settings can validate a store URL with it;
:mod:`relay.store.redis.clients` builds the redis-py clients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

OptionValue = str | int | float | bool

# the schemes of the Redis URLs, written once (relay.store.redis.kind takes them as the store's)
SERVER_SCHEMES = ("redis", "rediss")  # one server: redis-py's own URL
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
TLS_SCHEMES = ("rediss", "rediss+cluster", "rediss+sentinel")
_DEFAULT_PORT = {"cluster": 6379, "sentinel": 26379}
_SENTINEL_OPTIONS = {"sentinel_username": "username", "sentinel_password": "password"}


def _flag(text: str) -> bool:
    """A boolean option, spelled as redis-py's own URLs spell them."""
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


_SERVER_OPTIONS: dict[str, Callable[[str], OptionValue]] = {
    "socket_timeout": float,
    "socket_connect_timeout": float,
    "socket_keepalive": _flag,
    "health_check_interval": int,
    "max_connections": int,
    "protocol": int,
    "client_name": str,
}
_TLS_OPTIONS: dict[str, Callable[[str], OptionValue]] = {
    "ssl_cert_reqs": str,
    "ssl_ca_certs": str,
    "ssl_ca_data": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_check_hostname": _flag,
    "ssl_min_version": int,
    "ssl_ciphers": str,
}


@dataclass(frozen=True)
class MultiHostUrl:
    """A parsed ``redis+cluster://`` or ``redis+sentinel://`` URL (see the module docstring).

    ``service`` is the Sentinel service name (None for a cluster). ``options`` are the
    connection options for the Redis servers, cast to their types; ``sentinel_auth`` the
    credentials for the sentinels (``username``, ``password``), empty when none were given.
    """

    kind: Literal["cluster", "sentinel"]
    hosts: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    service: str | None = None
    db: int = 0
    options: dict[str, OptionValue] = field(default_factory=dict)
    sentinel_auth: dict[str, str] = field(default_factory=dict, repr=False)


def is_multi_host_url(url: str) -> bool:
    """True for a ``redis+cluster``, ``redis+sentinel`` URL or their ``rediss+`` forms."""
    scheme = url.partition("://")[0].lower()
    return scheme in CLUSTER_SCHEMES or scheme in SENTINEL_SCHEMES


def parse_multi_host_url(url: str) -> MultiHostUrl:
    """Parse a Cluster or Sentinel store URL; raise :class:`ValueError` saying what is wrong.

    The message never repeats the URL, which may hold a password.
    """
    scheme = url.partition("://")[0].lower()
    if not is_multi_host_url(url):
        raise ValueError(f"store URL scheme {scheme!r} is not redis+cluster or redis+sentinel")
    kind: Literal["cluster", "sentinel"] = "cluster" if scheme in CLUSTER_SCHEMES else "sentinel"
    tls = scheme in TLS_SCHEMES
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    user, has_password, password = userinfo.partition(":")
    hosts = tuple(_host_port(item, _DEFAULT_PORT[kind]) for item in hostlist.split(","))
    service, db = _path(kind, [unquote(p) for p in parts.path.split("/")[1:] if p])
    options, sentinel_auth = _options(parts.query, tls=tls)
    return MultiHostUrl(
        kind=kind,
        hosts=hosts,
        tls=tls,
        username=unquote(user) or None,
        password=unquote(password) if has_password else None,
        service=service,
        db=db,
        options=options,
        sentinel_auth=sentinel_auth if kind == "sentinel" else {},
    )


def _host_port(item: str, default_port: int) -> tuple[str, int]:
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else rest
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ValueError("store URL has an empty host in its host list")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"store URL host {host!r} has a bad port {port_text!r}")
    return host, int(port_text)


def _path(kind: str, path: list[str]) -> tuple[str | None, int]:
    """The service name and the database number of the URL path."""
    if kind == "cluster":
        if path not in ([], ["0"]):
            raise ValueError("a redis+cluster store URL takes no path but /0 (cluster has db 0)")
        return None, 0
    if not path or len(path) > 2:
        raise ValueError("a redis+sentinel store URL needs the path /<service>[/<db>]")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"store URL database {path[1]!r} is not a number")
    return path[0], int(path[1]) if len(path) == 2 else 0


def _options(query: str, *, tls: bool) -> tuple[dict[str, OptionValue], dict[str, str]]:
    """The server connection options and the sentinel credentials of the query, checked."""
    options: dict[str, OptionValue] = {}
    sentinel_auth: dict[str, str] = {}
    for name, text in parse_qsl(query, keep_blank_values=True):
        if name in _SENTINEL_OPTIONS:
            sentinel_auth[_SENTINEL_OPTIONS[name]] = text
            continue
        if name in _TLS_OPTIONS and not tls:
            raise ValueError(f"store URL option {name!r} needs the rediss+ scheme (TLS)")
        cast = _SERVER_OPTIONS.get(name) or _TLS_OPTIONS.get(name)
        if cast is None:
            raise ValueError(f"store URL option {name!r} is not one the store knows")
        try:
            options[name] = cast(text)
        except ValueError as exc:
            raise ValueError(f"store URL option {name!r} has a bad value {text!r}") from exc
    return options, sentinel_auth
