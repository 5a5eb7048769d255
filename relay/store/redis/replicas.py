"""Replica acknowledgement of the store's writes on a Redis Cluster or Sentinel-managed master.

A write the relay relies on ends its pipeline with ``WAIT 1 <ms>``, aimed at each server written
to and sent on the connection of those writes (WAIT covers only its own connection's writes).
Per server: a replica acknowledges within ``min(250 ms, op_timeout_s / 4)``: done; none does,
or WAIT is refused, although one did in the last 10 s: StoreError (a failover is under way, the
caller retries on the new master); none has for 10 s: the write counts as on a single server, a
warning is logged and the server is not waited on for 30 s. Behind Sentinel an unacknowledged
WAIT also asks the sentinels for the master and drops the connections to a demoted one. A single
``redis://`` server is never waited on. Why each case is handled so: docs/design.md §3
("Replica acknowledgement").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode, ClusterPipeline
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import RedisError

from relay.store.redis.clients import Client

log = logging.getLogger("relay.store.redis.store")

WAIT_MAX_MS = 250  # longest a write waits for a replica's acknowledgement (WAIT's timeout)
RECENT_S = 10.0  # a server acknowledged this recently must go on doing so, or the call fails
PAUSE_S = 30.0  # after an unacknowledged WAIT, how long that server is not waited on
_TEXT_MAX = 300  # characters of a WAIT refusal kept in the warning

WaitTarget = ClusterNode | None  # the cluster node to WAIT on; None: the Sentinel master


class ReplicaAckError(RedisError):
    """A server whose replica acknowledged writes until moments ago did not acknowledge one.

    A RedisError, so the store's boundary translates it into StoreError like any other.
    """


class ReplicaAcks:
    """Which servers a write waits on (see the module docstring), and what they answered.

    ``enabled`` is False for a single server: then nothing is ever waited on.
    """

    def __init__(self, *, client: Client, enabled: bool, op_timeout_s: float) -> None:
        self._client = client
        self._enabled = enabled
        self.timeout_ms = max(1, min(WAIT_MAX_MS, int(op_timeout_s * 1000) // 4))
        self._acked_at: dict[str, float] = {}  # server name -> time.monotonic() of last ack
        self._paused_until: dict[str, float] = {}  # server name -> time.monotonic()

    async def targets(self, keys: Sequence[str]) -> list[WaitTarget]:
        """The servers to WAIT on after writing ``keys``: each one written to, unless paused."""
        if not keys or not self._enabled:
            return []
        now = time.monotonic()
        client = self._client
        if not isinstance(client, redis.asyncio.RedisCluster):
            return [] if self._paused_until.get(self._name(None), 0.0) > now else [None]
        await client.initialize()  # a no-op unless the slot map must be (re)loaded
        nodes = {node.name: node for key in keys if (node := client.get_node_from_key(key))}
        return [n for name, n in nodes.items() if self._paused_until.get(name, 0.0) <= now]

    def add_waits(self, pipe: Pipeline | ClusterPipeline, targets: Sequence[WaitTarget]) -> None:
        """Append one ``WAIT 1 <timeout_ms>`` per target to ``pipe``, after its writes."""
        for target in targets:
            if target is None:
                pipe.execute_command("WAIT", 1, self.timeout_ms)
            else:
                pipe.execute_command("WAIT", 1, self.timeout_ms, target_nodes=target)

    async def note(self, targets: Sequence[WaitTarget], answers: Sequence[Any]) -> None:
        """Take in the WAIT answers (see the module docstring); raise :class:`ReplicaAckError`
        when a write may be lost in a failover under way."""
        now = time.monotonic()
        lost = []
        for target, acked in zip(targets, answers, strict=True):
            name = self._name(target)
            if isinstance(acked, int) and acked >= 1:
                self._acked_at[name] = now
                continue
            why = f"{type(acked).__name__}: {acked}"[:_TEXT_MAX] if isinstance(
                acked, Exception) else f"no replica acknowledged within {self.timeout_ms} ms"
            moved_to = await self._sentinel_master_moved() if target is None else None
            if moved_to is not None:
                lost.append(f"{name} ({why}; the sentinels name {moved_to} master now)")
            elif now - self._acked_at.get(name, -RECENT_S) < RECENT_S:
                lost.append(f"{name} ({why})")
            else:
                self._paused_until[name] = now + PAUSE_S
                log.warning("redis %s: writes are on the master only (WAIT 1: %s); a failover "
                            "now could lose them; not waiting on it for %g s", name, why, PAUSE_S)
        if lost:
            raise ReplicaAckError(
                "replica stopped acknowledging writes (failover or partition?): " + ", ".join(lost)
            )

    def _name(self, target: WaitTarget) -> str:
        """A cluster node's address; the Sentinel master's current address."""
        pool = self._sentinel_pool()
        if target is not None or pool is None:
            return "master" if target is None else target.name
        address = pool.master_address
        return f"{address[0]}:{address[1]}" if address else "master"

    def _sentinel_pool(self) -> SentinelConnectionPool | None:
        if isinstance(self._client, redis.asyncio.RedisCluster):
            return None
        pool = self._client.connection_pool
        return pool if isinstance(pool, SentinelConnectionPool) else None

    async def _sentinel_master_moved(self) -> str | None:
        """Ask the sentinels for the master; its new address when it moved, else None.

        redis-py asks only when it opens a connection, so pooled connections would go on
        writing to an old master that Sentinel has not demoted yet (about 10 s after a failover
        in our tests). Getting the address drops the idle connections when it changed, so
        the caller's retry connects to the new master.
        """
        pool = self._sentinel_pool()
        if pool is None:
            return None
        before = pool.master_address
        after = await pool.get_master_address()  # type: ignore[no-untyped-call]  # untyped
        return None if after == before else f"{after[0]}:{after[1]}"
