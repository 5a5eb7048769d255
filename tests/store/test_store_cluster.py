"""The Redis store on Redis Cluster and Redis Sentinel, against real servers.

This module starts its own servers on free loopback ports (``redis_servers.py``): a cluster of
three masters and three replicas, and a master with a replica watched by one sentinel. Both are
shared by the module's tests and stopped at its end, whatever happened; the tests that fail a
master over leave the servers healthy again for the next. Every wait is bounded. The shared
Redis on 127.0.0.1:6379 is not used. Store URL parsing is tested here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any
from uuid import uuid4

import pytest
import redis
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import SentinelManagedSSLConnection

from relay.core.errors import StoreError
from relay.core.interfaces import Settle, SettleOp, State
from relay.store.redis.clients import open_client
from relay.store.redis.store import RedisStore
from relay.store.redis.urls import MultiHostUrl, parse_multi_host_url
from tests.support.clients import message, send
from tests.support.redis_servers import (
    Cluster,
    SentinelSet,
    Servers,
    client,
    free_port,
    is_master,
    redis_sentinel,
    replicate,
    server_group,
    wait_for,
)
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

OP_TIMEOUT_S = 1.0  # the stores' operation timeout in this module
SLACK_S = 0.5  # how much later than OP_TIMEOUT_S a failing call may return
RECOVERY_LIMIT_S = 15.0  # a failover must be over, for the store, within this
LEASE_S = 60.0
WINDOW_S = 3600.0


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses."""
    return f"test:{uuid4().hex}:"


@pytest.fixture
async def cluster_store(cluster: Cluster) -> AsyncIterator[RedisStore]:
    """A store on the cluster, closed after the test."""
    store = RedisStore.from_url(cluster.url, op_timeout_s=OP_TIMEOUT_S, window_s=WINDOW_S)
    yield store
    await store.close()


@pytest.fixture
async def sentinel_store(sentinel: SentinelSet) -> AsyncIterator[RedisStore]:
    """A store on the sentinel's master, closed after the test."""
    store = RedisStore.from_url(sentinel.url, op_timeout_s=OP_TIMEOUT_S)
    yield store
    await store.close()


async def mark_sent(store: RedisStore, keys: list[str], reply: str = "250 ok") -> None:
    """Reserve ``keys`` and settle them SENT, asserting that both apply to every key."""
    token = uuid4().hex
    reservations = await store.reserve(keys, token=token, lease_s=LEASE_S)
    assert all(r.reserved for r in reservations)
    ops = [SettleOp(key, Settle.SENT, reply) for key in keys]
    done = await store.settle(ops, token=token, window_s=WINDOW_S)
    assert done == [True] * len(keys)


async def until_answered(call: Callable[[], Awaitable[Any]]) -> tuple[Any, float, int]:
    """Repeat ``call`` until it succeeds; return its result, the seconds taken, the failures.

    Every failure must be a StoreError that came within the operation timeout (no hang);
    the whole wait is bounded by RECOVERY_LIMIT_S.
    """
    started = time.monotonic()
    failures = 0
    while True:
        attempt = time.monotonic()
        try:
            result = await call()
        except StoreError:
            assert time.monotonic() - attempt < OP_TIMEOUT_S + SLACK_S, "a call hung"
            failures += 1
        else:
            return result, time.monotonic() - started, failures
        assert time.monotonic() - started < RECOVERY_LIMIT_S, "the store did not recover"
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# URLs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis+cluster://10.0.0.1:7000,10.0.0.2",
            MultiHostUrl("cluster", (("10.0.0.1", 7000), ("10.0.0.2", 6379)), tls=False),
        ),
        (
            "rediss+cluster://relay:p%40ss@[::1]:7000/0?ssl_cert_reqs=none",
            MultiHostUrl("cluster", (("::1", 7000),), tls=True, username="relay",
                         password="p@ss", options={"ssl_cert_reqs": "none"}),
        ),
        (
            "redis+sentinel://:pw@s1,s2:26380/mymaster/3?sentinel_password=spw&socket_timeout=0.5",
            MultiHostUrl("sentinel", (("s1", 26379), ("s2", 26380)), tls=False, password="pw",
                         service="mymaster", db=3, options={"socket_timeout": 0.5},
                         sentinel_auth={"password": "spw"}),
        ),
        (
            "rediss+sentinel://s1/m",
            MultiHostUrl("sentinel", (("s1", 26379),), tls=True, service="m"),
        ),
    ],
)
def test_url_forms_parse(url: str, expected: MultiHostUrl) -> None:
    """Cluster and Sentinel URLs give their hosts (default ports), TLS, userinfo, path, options."""
    parsed = parse_multi_host_url(url)
    assert parsed == expected
    assert parsed.password == expected.password  # not part of the repr, compared on its own


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("redis+cluster://h:0", "bad port"),
        ("redis+cluster://h:1,,h:2", "empty host"),
        ("redis+cluster://h/1", "/0"),
        ("redis+sentinel://h", "/<service>"),
        ("redis+sentinel://h/m/x", "not a number"),
        ("redis+cluster://h?ssl_cert_reqs=none", "rediss+"),
        ("redis+cluster://h?retry=3", "not one the store knows"),
        ("redis+cluster://h?socket_timeout=soon", "bad value"),
    ],
)
def test_bad_urls_are_refused_without_the_url(url: str, complaint: str) -> None:
    """A malformed Cluster or Sentinel URL raises ValueError naming the fault, not the URL."""
    with pytest.raises(ValueError, match=complaint) as caught:
        RedisStore.from_url(url)
    assert url not in str(caught.value)


async def test_url_passwords_reach_the_servers_and_sentinels() -> None:
    """The userinfo password goes to the Redis servers; sentinel_password to the sentinels."""
    cluster_client, _ = open_client("redis+cluster://u:pw@h:7000", op_timeout_s=1)
    assert isinstance(cluster_client, redis.asyncio.RedisCluster)
    assert cluster_client.get_connection_kwargs()["password"] == "pw"
    master, service = open_client(
        "redis+sentinel://u:pw@s:26379/m?sentinel_password=spw", op_timeout_s=1)
    assert service is not None and isinstance(master, redis.asyncio.Redis)
    assert master.connection_pool.connection_kwargs["password"] == "pw"
    assert master.connection_pool.connection_kwargs["username"] == "u"
    sentinel_pool = service.sentinel.sentinels[0].connection_pool
    assert sentinel_pool.connection_kwargs["password"] == "spw"
    await RedisStore(client=master, sentinel=service).close()
    await RedisStore(client=cluster_client).close()


async def test_rediss_urls_use_tls_to_servers_and_sentinels() -> None:
    """rediss+cluster and rediss+sentinel connect with TLS, to the sentinels too."""
    cluster_client, _ = open_client("rediss+cluster://h:7000", op_timeout_s=1)
    assert isinstance(cluster_client, redis.asyncio.RedisCluster)
    assert cluster_client.get_connection_kwargs()["connection_class"] is SSLConnection
    master, service = open_client("rediss+sentinel://s/m?ssl_cert_reqs=none", op_timeout_s=1)
    assert service is not None and isinstance(master, redis.asyncio.Redis)
    assert master.connection_pool.connection_class is SentinelManagedSSLConnection
    assert master.connection_pool.connection_kwargs["ssl_cert_reqs"] == "none"
    sentinel_pool = service.sentinel.sentinels[0].connection_pool
    assert sentinel_pool.connection_class is SSLConnection
    await RedisStore(client=master, sentinel=service).close()
    await RedisStore(client=cluster_client).close()


# ---------------------------------------------------------------------------------------------
# Cluster
# ---------------------------------------------------------------------------------------------


async def test_cluster_keys_in_many_slots_reserve_and_settle_in_one_call(
    cluster: Cluster, cluster_store: RedisStore, prefix: str
) -> None:
    """Sixty keys spread over all three masters are reserved, and settled, by one call each."""
    keys = [f"{prefix}{i}" for i in range(60)]
    masters = cluster.masters()
    assert {cluster.master_of(key, masters) for key in keys} == set(masters)
    await mark_sent(cluster_store, keys, "250 2.0.0 queued")
    again = await cluster_store.reserve(keys, token=uuid4().hex, lease_s=LEASE_S)
    assert [r.key for r in again] == keys
    assert all(r.found is not None and r.found.state is State.SENT and r.found.at is not None
               for r in again)


async def test_cluster_nodes_load_the_scripts_lazily(
    cluster: Cluster, cluster_store: RedisStore, prefix: str
) -> None:
    """After SCRIPT FLUSH on every master, a call touching all of them succeeds and caches them."""
    for port in cluster.masters():
        with contextlib.closing(client(port)) as conn:
            conn.script_flush()
    keys = [f"{prefix}{i}" for i in range(30)]
    await mark_sent(cluster_store, keys)
    sha = cluster_store._reserve_script.sha
    for port in cluster.masters():
        with contextlib.closing(client(port)) as conn:
            assert conn.script_exists(sha) == [True]


async def test_cluster_writes_are_on_a_replica_when_the_call_returns(
    cluster: Cluster, cluster_store: RedisStore, prefix: str
) -> None:
    """A SENT mark is on the master's replica when settle returns (WAIT in its pipeline)."""
    masters = list(cluster.masters())
    keys = [cluster.keys_on(port, prefix, 1)[0] for port in masters]
    waits_before = {port: _calls(port, "wait") for port in masters}
    await mark_sent(cluster_store, keys)
    for port, key in zip(masters, keys, strict=True):
        assert _calls(port, "wait") > waits_before[port]
        with contextlib.closing(client(cluster.replica_port_of(port))) as replica:
            replica.execute_command("READONLY")
            value = replica.get(key)
        assert value == b"0"  # SENT


def _calls(port: int, command: str) -> int:
    """How many times the server on ``port`` has run ``command`` (INFO commandstats)."""
    with contextlib.closing(client(port)) as conn:
        stats = conn.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_cluster_manual_failover_is_followed_by_moved(
    cluster: Cluster, cluster_store: RedisStore, prefix: str
) -> None:
    """After CLUSTER FAILOVER a store holding the old slot map reads through MOVED at once and
    writes again within the recovery bound (a WAIT aimed at the old master may fail one call)."""
    old_master = next(iter(cluster.masters()))
    key, other = cluster.keys_on(old_master, prefix, 2)
    await mark_sent(cluster_store, [key])
    replica = cluster.replica_port_of(old_master)
    with contextlib.closing(client(replica)) as conn:
        conn.execute_command("CLUSTER", "FAILOVER")
    wait_for("the manual failover", lambda: cluster.is_master(replica)
             and not cluster.is_master(old_master), 10.0)
    assert (await cluster_store.inspect(key)).state is State.SENT
    token = uuid4().hex
    [reservation], _, _ = await until_answered(
        lambda: cluster_store.reserve([other], token=token, lease_s=LEASE_S))
    assert reservation.reserved
    cluster.wait_healthy()  # the old master is the new one's replica now


async def test_cluster_write_fails_when_the_replica_just_vanished(
    cluster: Cluster, cluster_store: RedisStore, prefix: str
) -> None:
    """A write to a master whose replica acknowledged moments ago and now is gone raises
    StoreError (it could be lost in a failover); it succeeds again once the replica is back."""
    master = next(iter(cluster.masters()))
    replica = cluster.node(cluster.replica_port_of(master))
    first, second = cluster.keys_on(master, prefix, 2)
    await mark_sent(cluster_store, [first])  # acknowledged by the replica
    token = uuid4().hex  # the retry below is the same attempt, as the relay's would be
    replica.kill()
    try:
        with pytest.raises(StoreError, match="replica stopped acknowledging"):
            await cluster_store.reserve([second], token=token, lease_s=LEASE_S)
    finally:
        replica.start()
        cluster.wait_healthy()
    [reservation], _, _ = await until_answered(
        lambda: cluster_store.reserve([second], token=token, lease_s=LEASE_S))
    assert reservation.reserved


async def test_cluster_master_crash_keeps_replicated_marks_and_recovers(
    cluster: Cluster, cluster_store: RedisStore, prefix: str
) -> None:
    """A SIGKILLed master's replicated SENT and PENDING keys survive its failover; calls during
    it raise StoreError within the timeout, and the store answers again once one is elected."""
    master = next(iter(cluster.masters()))
    replica = cluster.replica_port_of(master)
    sent, pending, probe = cluster.keys_on(master, prefix, 3)
    await mark_sent(cluster_store, [sent], "250 2.0.0 before the crash")
    token = uuid4().hex
    await cluster_store.reserve([pending], token=token, lease_s=LEASE_S)
    replicate(master, probe)
    cluster.node(master).kill()
    try:
        record, recovery_s, failures = await until_answered(lambda: cluster_store.inspect(sent))
        print(f"cluster failover: store answered again after {recovery_s:.2f} s, "
              f"{failures} StoreError(s) on the way")
        assert failures >= 1
        assert record.state is State.SENT
        assert record.at is not None
        assert cluster.is_master(replica)
        assert (await cluster_store.inspect(pending)).token == token
        done = await cluster_store.settle(
            [SettleOp(pending, Settle.SENT, "250 ok")], token=token, window_s=WINDOW_S)
        assert done == [True]
    finally:
        cluster.node(master).start()  # comes back as the new master's replica
        wait_for("the old master back as a replica", lambda: cluster.in_sync(master)
                 and not cluster.is_master(master), 15.0)
        cluster.wait_healthy()


async def test_cluster_check_server_warns_for_every_master(
    cluster: Cluster, cluster_store: RedisStore
) -> None:
    """check_server on a cluster without persistence names every master in a warning."""
    warnings = await cluster_store.check_server()
    masters = cluster.masters()
    assert len(warnings) == len(masters) == 3
    for port in masters:
        assert any(f"127.0.0.1:{port} persistence is off" in w for w in warnings)


async def test_relay_on_a_cluster_delivers_a_repeated_message_once(
    cluster: Cluster, make_relay: MakeRelay, sink: Sink
) -> None:
    """A relay whose store is the cluster sends the same message twice upstream only once."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", store=cluster.url)
    first = await send(relay.port, ["user@example.net"], message(key="cluster-1"))
    second = await send(relay.port, ["user@example.net"], message(key="cluster-1"))
    assert (first.code, second.code) == (250, 250)
    assert "suppressed" in second.text
    assert sink.handler.copies_to("user@example.net") == 1


# ---------------------------------------------------------------------------------------------
# Sentinel
# ---------------------------------------------------------------------------------------------


async def test_sentinel_check_server_warns_without_persistence(
    sentinel_store: RedisStore,
) -> None:
    """check_server through Sentinel checks the master: persistence off; a replica is known."""
    warnings = await sentinel_store.check_server()
    assert len(warnings) == 1
    assert "persistence is off" in warnings[0]


async def test_sentinel_store_follows_a_failover(
    sentinel: SentinelSet, sentinel_store: RedisStore, prefix: str
) -> None:
    """After SENTINEL FAILOVER the store's writes land on the new master (the first, taken by the
    old master that Sentinel has not demoted yet, fails instead of counting), and what it wrote
    before is kept."""
    key, later = prefix + "sent", prefix + "later"
    await mark_sent(sentinel_store, [key])
    old_master = sentinel.master_port()
    with contextlib.closing(client(sentinel.sentinel.port)) as conn:
        conn.execute_command("SENTINEL", "FAILOVER", "m")
    wait_for("the sentinel naming a new master", lambda: sentinel.master_port() != old_master,
             10.0)
    new_master = sentinel.master_port()
    wait_for("the new master taking writes", lambda: is_master(new_master), 10.0)
    token = uuid4().hex  # one token for every try: a reserve that landed is reserved again
    [reservation], recovery_s, failures = await until_answered(
        lambda: sentinel_store.reserve([later], token=token, lease_s=LEASE_S))
    print(f"sentinel failover: store wrote again after {recovery_s:.2f} s, "
          f"{failures} StoreError(s) on the way")
    assert failures >= 1  # the pooled connection still led to the old master, which took it
    assert reservation.reserved
    assert (await sentinel_store.inspect(key)).state is State.SENT
    with contextlib.closing(client(new_master)) as conn:
        assert conn.get(later) == f"P|{token}".encode()
    sentinel.follow(old_master)  # healthy again for the next test


async def test_sentinel_master_crash_raises_store_error_then_recovers(
    sentinel: SentinelSet, sentinel_store: RedisStore, prefix: str
) -> None:
    """With the master SIGKILLed, calls raise StoreError within the timeout until the sentinel
    promotes the replica; then the replicated SENT key is still there."""
    key = prefix + "sent"
    await mark_sent(sentinel_store, [key])
    master_port = sentinel.master_port()
    master = next(s for s in (sentinel.master, sentinel.replica)
                  if s is not None and s.port == master_port)
    replicate(master_port, prefix + "probe")
    master.kill()
    try:
        record, recovery_s, failures = await until_answered(lambda: sentinel_store.inspect(key))
        print(f"sentinel crash: store answered again after {recovery_s:.2f} s, "
              f"{failures} StoreError(s) on the way")
        assert failures >= 1
        assert record.state is State.SENT
        assert sentinel.master_port() != master_port
    finally:
        master.start()
        sentinel.follow(master.port)


async def test_sentinel_without_replica_is_reported_and_not_waited_on(prefix: str) -> None:
    """A Sentinel service with no replica gets a warning, and writes wait for one only once."""
    with redis_sentinel(with_replica=False) as lone:
        store = RedisStore.from_url(lone.url, op_timeout_s=OP_TIMEOUT_S)
        try:
            warnings = await store.check_server()
            assert any("knows no live replica of 'm'" in w for w in warnings)
            started = time.monotonic()
            await mark_sent(store, [prefix + "a"])  # reserve waits 250 ms, then pauses WAIT
            first_s = time.monotonic() - started
            started = time.monotonic()
            await mark_sent(store, [prefix + "b"])
            second_s = time.monotonic() - started
        finally:
            await store.close()
    assert first_s >= 0.25  # one WAIT timeout
    assert second_s < 0.2  # none: the server is not waited on now


# ---------------------------------------------------------------------------------------------
# Start-up checks on a single server
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def evicting_server() -> Iterator[Servers]:
    """A redis-server with maxmemory-policy allkeys-lru and no persistence."""
    with server_group("evicting") as servers:
        servers.add(lambda _port: ["--maxmemory-policy", "allkeys-lru", "--save", "",
                                   "--appendonly", "no"])
        yield servers


async def test_check_server_warns_about_eviction_and_persistence(
    evicting_server: Servers,
) -> None:
    """A real server with allkeys-lru and neither AOF nor snapshots gets both warnings."""
    port = evicting_server.servers[0].port
    store = RedisStore.from_url(f"redis://127.0.0.1:{port}/0", op_timeout_s=OP_TIMEOUT_S)
    try:
        warnings = await store.check_server()
    finally:
        await store.close()
    assert len(warnings) == 2
    assert "'allkeys-lru'" in warnings[0]
    assert "persistence is off" in warnings[1]



StoreCall = Callable[[RedisStore], Awaitable[object]]
STORE_CALLS: dict[str, StoreCall] = {
    "reserve": lambda s: s.reserve(["k"], token="t", lease_s=1),
    "settle": lambda s: s.settle([SettleOp("k", Settle.SENT, "250")], token="t", window_s=1),
    "inspect": lambda s: s.inspect("k"),
    "force_release": lambda s: s.force_release("k"),
    "ping": lambda s: s.ping(),
    "check_server": lambda s: s.check_server(),
}


@pytest.mark.parametrize("scheme", ["redis+cluster", "redis+sentinel"])
@pytest.mark.parametrize("op", list(STORE_CALLS))
async def test_unreachable_cluster_or_sentinel_raises_store_error(scheme: str, op: str) -> None:
    """Every operation with no cluster node or sentinel listening raises StoreError in time."""
    ports = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    path = "/m" if scheme == "redis+sentinel" else ""
    store = RedisStore.from_url(f"{scheme}://{ports}{path}", op_timeout_s=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(StoreError) as caught:
            await STORE_CALLS[op](store)
    finally:
        await store.close()
    assert caught.value.op == op
    assert time.monotonic() - started < 0.5 + SLACK_S
