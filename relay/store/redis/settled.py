"""The settles a Redis store announces, heard by one pub/sub connection per store (design.md
§4.8): every settle script that ends an attempt's hold on a key PUBLISHes on the key's channel
(``settled:<key>``, :data:`relay.store.redis.scripts.SETTLED_CHANNEL`); this process
SUBSCRIBEs to a key's channel while some message waits for it, once however many wait, and
UNSUBSCRIBEs when the last one leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from redis.exceptions import RedisError

from relay.core.errors import StoreError
from relay.core.interfaces import SettleWatch
from relay.store.redis.clients import Client
from relay.store.redis.scripts import SETTLED_CHANNEL
from relay.store.settled import KeyWaiters

log = logging.getLogger("relay.store.redis")

_CHANNEL = SETTLED_CHANNEL.encode()
_RETRY_READ_S = 1.0  # after the pub/sub connection failed, before reading again


class SettleChannels:
    """The pub/sub connection of one store; ``op_timeout_s`` (seconds) bounds a SUBSCRIBE's
    confirmation."""

    def __init__(self, client: Client, op_timeout_s: float) -> None:
        self._client = client
        self._op_timeout_s = op_timeout_s
        self._pubsub: Any = None  # redis-py's PubSub (ClusterPubSub on a cluster), once used
        self._reader: asyncio.Task[None] | None = None
        self._confirmed: dict[bytes, asyncio.Future[None]] = {}
        self._lock = asyncio.Lock()  # SUBSCRIBE and UNSUBSCRIBE go out in the order asked
        self.waiters = KeyWaiters(subscribe=self._subscribe, unsubscribe=self._unsubscribe)

    def watching(self, keys: Sequence[str]) -> AbstractAsyncContextManager[SettleWatch]:
        """:meth:`relay.core.interfaces.FingerprintStore.watch_settles`."""
        return self.waiters.watching(keys)

    async def _subscribe(self, keys: list[str]) -> None:
        channels = [_CHANNEL + key.encode() for key in keys]
        loop = asyncio.get_running_loop()
        confirmed = [self._confirmed.setdefault(c, loop.create_future()) for c in channels]
        try:
            async with self._lock:
                if self._pubsub is None:
                    self._pubsub = self._client.pubsub()
                await asyncio.wait_for(self._pubsub.subscribe(*channels), self._op_timeout_s)
                if self._reader is None:
                    self._reader = asyncio.ensure_future(self._read())
            await asyncio.wait_for(asyncio.gather(*(asyncio.shield(f) for f in confirmed)),
                                   self._op_timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreError("watch", f"SUBSCRIBE failed: {exc!r}") from exc
        finally:
            for channel in channels:
                self._confirmed.pop(channel, None)

    async def _unsubscribe(self, keys: list[str]) -> None:
        if self._pubsub is None:
            return
        try:
            async with self._lock:
                await asyncio.wait_for(
                    self._pubsub.unsubscribe(*(_CHANNEL + key.encode() for key in keys)),
                    self._op_timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreError("watch", f"UNSUBSCRIBE failed: {exc!r}") from exc

    async def _read(self) -> None:
        """Hand each announced settle to the waiters, each subscription's confirmation to its
        :meth:`_subscribe`, until :meth:`close`."""
        while True:
            try:
                message = await self._pubsub.get_message(timeout=None)
            except (RedisError, OSError, RuntimeError) as exc:  # redis-py subscribes again
                # on reconnect; RuntimeError: its connection was dropped
                log.warning("the settle channel's connection failed (%r); reading again", exc)
                await asyncio.sleep(_RETRY_READ_S)
                continue
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        channel = message.get("channel")
        if not isinstance(channel, bytes) or not channel.startswith(_CHANNEL):
            return
        if message.get("type") == "message":
            self.waiters.notify(channel[len(_CHANNEL):].decode())
        elif message.get("type") == "subscribe":
            confirmed = self._confirmed.get(channel)
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)

    async def close(self) -> None:
        """Stop reading and close the connection. Never raises."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()
