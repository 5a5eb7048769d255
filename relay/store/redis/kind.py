"""Redis as a :class:`relay.store.kinds.StoreKind`: one server (``redis://``, ``rediss://``), a
Cluster or a Sentinel-managed master (:mod:`relay.store.redis.urls`), the TLS files their URLs
name, and the opening with its start-up checks. Imports no redis-py: the store module does,
when a store is opened."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

from relay.core.errors import ConfigError, StoreError
from relay.core.interfaces import FingerprintStore
from relay.store.kinds import NamedFile, OpenOptions, StoreKind
from relay.store.redis.urls import (
    CLUSTER_SCHEMES,
    SENTINEL_SCHEMES,
    SERVER_SCHEMES,
    is_multi_host_url,
    parse_multi_host_url,
)

# the start-up lines of the relay's store (as they were when the settings opened it)
log = logging.getLogger("relay.app")

# redis-py URL options that name a file (the CA bundle, a client certificate and its key)
_FILE_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile")


def _check_url(url: str, setting: str) -> None:
    """Raise ValueError naming the fault of a Redis URL (never its password): a Cluster's or
    Sentinel's host list, or one server's database number and port (redis-py would quietly
    take db 0 for ``/abc``)."""
    if is_multi_host_url(url):
        parse_multi_host_url(url)
        return
    parts = urlsplit(url)
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"{setting} URL database must be a number, got /{db}")
    try:
        parts.port  # noqa: B018  # raises ValueError for a port that is no number
    except ValueError:
        raise ValueError(f"{setting} URL port must be a number from 0 to 65535") from None


def _files(url: str) -> list[NamedFile]:
    """The TLS files the URL's options name (``ssl_ca_certs``: PEM CA certificates)."""
    files = []
    for name, value in parse_qsl(urlsplit(url).query):
        if name in _FILE_OPTIONS:
            use: Literal["read", "ca"] = "ca" if name == "ssl_ca_certs" else "read"
            files.append(NamedFile(Path(value), f"{name}={value}", use))
    return files


async def _open(url: str, options: OpenOptions) -> FingerprintStore:
    """Build the store and see it answer: its server's settings that risk fingerprints are
    logged as warnings, a server that does not answer yet too (the store fails closed until
    it does). Raises ConfigError for a database number the server does not have."""
    from relay.store.redis.store import RedisStore

    store = RedisStore.from_url(url, op_timeout_s=options.op_timeout_s, window_s=options.window_s)
    try:
        await store.ping()
        for warning in await store.check_server():
            log.warning("redis: %s", warning)
    except StoreError as exc:
        if "DB index is out of range" in str(exc):  # a setting error, not an outage
            await store.close()
            raise ConfigError("the Redis server has no database of that number") from exc
        log.warning("redis not reachable at start-up (%s); will fail closed until it is", exc)
    return store


REDIS = StoreKind(
    name="Redis",
    label="redis",
    schemes=tuple(f"{s}://" for s in SERVER_SCHEMES + CLUSTER_SCHEMES + SENTINEL_SCHEMES),
    forms="redis://, rediss://, redis+cluster://H:P,..., redis+sentinel://H:P,.../SERVICE "
          "(rediss+ for TLS)",
    check_url=_check_url,
    files=_files,
    open=_open,
)
