"""The redis-py clients a store URL names (:mod:`relay.store.redis.urls` describes the URLs).

``redis://``, ``rediss://`` and ``unix://`` name one server and go to redis-py as they are;
``redis+cluster://`` builds a :class:`redis.asyncio.RedisCluster` with the listed startup
nodes, and ``redis+sentinel://`` the master client of
``redis.asyncio.sentinel.Sentinel(...).master_for(service)``. Nothing is connected here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from relay.store.redis.urls import (
    SERVER_SCHEMES,
    MultiHostUrl,
    is_multi_host_url,
    parse_multi_host_url,
)

Client = redis.asyncio.Redis | redis.asyncio.RedisCluster


@dataclass(frozen=True)
class SentinelService:
    """The sentinels a store asks, and the name of the service whose master it writes to."""

    sentinel: Sentinel
    service: str


def open_client(url: str, *, op_timeout_s: float) -> tuple[Client, SentinelService | None]:
    """The client a store URL names, and for Sentinel the sentinels behind it.

    The socket connect timeout is ``op_timeout_s`` seconds unless the URL sets it; so is the
    read timeout of a cluster's or Sentinel's connections (one server: none, the store bounds
    each call).
    Raises :class:`ValueError` for another scheme or a malformed URL.
    """
    if is_multi_host_url(url):
        parsed = parse_multi_host_url(url)
        if parsed.kind == "cluster":
            return cluster_client(parsed, op_timeout_s=op_timeout_s), None
        return sentinel_client(parsed, op_timeout_s=op_timeout_s)
    scheme = url.partition("://")[0].lower()
    if scheme not in (*SERVER_SCHEMES, "unix"):
        raise ValueError(
            f"store URL scheme {scheme!r} is not redis://, rediss://, unix://, "
            "redis+cluster:// or redis+sentinel://"
        )
    # no socket_timeout (unless the URL sets one; redis-py's default is 5 s): every store call
    # runs under the store's own op timeout already, and redis-py would start a task
    # (asyncio.wait_for) per write for it
    client = redis.asyncio.from_url(url, decode_responses=False, retry=_reconnect_once(),
                                    socket_timeout=None, socket_connect_timeout=op_timeout_s)
    return client, None


# redis-py's cluster default is 100 connections per node, and going past it closes every
# connection of the client and starts over; the relay may have a few hundred calls in flight
_CLUSTER_MAX_CONNECTIONS = 1000


def cluster_client(parsed: MultiHostUrl, *, op_timeout_s: float) -> redis.asyncio.RedisCluster:
    """A cluster client with ``parsed.hosts`` as startup nodes, up to 1000 connections a node
    unless the URL says otherwise (``max_connections``)."""
    defaults = {**_timeouts(op_timeout_s), "max_connections": _CLUSTER_MAX_CONNECTIONS}
    return redis.asyncio.RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in parsed.hosts],
        username=parsed.username,
        password=parsed.password,
        ssl=parsed.tls,
        decode_responses=False,
        **{**defaults, **parsed.options},
    )


def sentinel_client(
    parsed: MultiHostUrl, *, op_timeout_s: float
) -> tuple[redis.asyncio.Redis, SentinelService]:
    """The master client of ``parsed.service`` and the sentinels it asks."""
    if parsed.service is None:
        raise ValueError("a redis+sentinel store URL needs a service name")
    server = {**_timeouts(op_timeout_s), **parsed.options}
    to_sentinels = {k: v for k, v in server.items() if k.startswith(("socket_", "ssl_"))}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]  # redis-py leaves __init__ untyped
        list(parsed.hosts),
        sentinel_kwargs={**to_sentinels, **parsed.sentinel_auth, "ssl": parsed.tls},
    )
    master: redis.asyncio.Redis = sentinel.master_for(
        parsed.service,
        username=parsed.username,
        password=parsed.password,
        db=parsed.db,
        ssl=parsed.tls,
        decode_responses=False,
        retry=_reconnect_once(),
        **server,
    )
    return master, SentinelService(sentinel=sentinel, service=parsed.service)


def _reconnect_once() -> Retry:
    """A call that meets a dead connection (the server restarted, or closed an idle one) is
    sent once more on a new one, so a pooled connection from before a restart never fails a
    message once the server answers again. Only connection errors: a timeout is not retried
    (the store's op timeout bounds the whole call). Safe for the state because every script
    is idempotent for its token (a reserve or SENDING mark run twice leaves the same record)
    or compare-token (a settle run twice changes nothing the second time). What the second
    run answers can differ when the first had landed: a settle reports "not applied", and a
    reserve that took over a record in doubt reports a plain reservation (so that one
    take-over is not counted in ``relay_unknown_resent_total``)."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def _timeouts(op_timeout_s: float) -> dict[str, Any]:
    return {"socket_timeout": op_timeout_s, "socket_connect_timeout": op_timeout_s}
