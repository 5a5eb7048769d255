"""Real redis-server processes for the Cluster and Sentinel tests, on free loopback ports.

:func:`redis_cluster` starts six cluster-enabled servers, joins them with
``redis-cli --cluster create ... --cluster-replicas 1`` (three masters, three replicas) and
waits for ``cluster_state:ok`` on every node. :func:`redis_sentinel` starts a master, a replica
and one sentinel that monitors the master as ``m``. Both are context managers: every process
they started is stopped and their temporary directory deleted on the way out, whatever
happened. Every wait is bounded; a wait that runs out fails the test with what was seen.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

START_TIMEOUT_S = 10.0
# a replica's first full sync starts at once, not after the default 5 s diskless-sync delay
_FAST_SYNC = ["--repl-diskless-sync-delay", "0"]
SENTINEL_SERVICE = "m"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    """Poll ``check`` every 50 ms until it is true; return the seconds it took.

    Fails the test when ``timeout_s`` seconds pass first. Redis errors count as "not yet".
    """
    started = time.monotonic()
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if check():
                return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.05)


def client(port: int) -> redis.Redis:
    """A synchronous client of the server on ``port`` with short timeouts."""
    return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)


def is_master(port: int) -> bool:
    """True when the server on ``port`` is a master now."""
    with contextlib.closing(client(port)) as conn:
        return bool(conn.info("replication")["role"] == "master")


def replicate(port: int, key: str = "redis_servers:probe") -> None:
    """Write ``key`` on the master on ``port`` and WAIT, on that connection, for a replica.

    WAIT covers the writes of its own connection, and the replication stream is ordered: once
    a replica has this write it has every earlier write of the master. It also brings a
    replica that just synced fully online: its first acknowledgement can take a second.
    """
    with contextlib.closing(client(port)) as conn:
        pipe = conn.pipeline(transaction=False)
        pipe.set(key, "probe")
        pipe.execute_command("WAIT", 1, 5000)
        assert pipe.execute()[1] >= 1, f"no replica of {port} acknowledged within 5 s"


def in_sync(port: int) -> bool:
    """True when the server on ``port`` is a replica with a live link to its master."""
    with contextlib.closing(client(port)) as conn:
        return conn.info("replication").get("master_link_status") == "up"


class ServerExited(Exception):
    """A server process exited while it was being started (its log's tail in the message)."""


@dataclass
class Server:
    """One redis-server (or sentinel) process on ``port``, its files under ``workdir``.

    ``start`` again after ``kill`` restarts it with the same arguments and files (a cluster
    node comes back with its ``nodes.conf``).
    """

    port: int
    workdir: Path
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the process and wait until it answers PING."""
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        log = self.workdir / f"{self.port}.log"
        proc = self.proc = subprocess.Popen(
            [exe, *self.args, "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.workdir), "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answering() -> bool:
            """Whether this process answers on the port: another one on it (the port was
            taken between the pick and the bind) does not count, and its exit ends the wait."""
            if proc.poll() is not None:
                self.proc = None
                tail = log.read_text(errors="replace")[-600:] if log.exists() else ""
                raise ServerExited(f"redis-server on port {self.port} exited "
                                   f"{proc.returncode}: {tail}")
            with contextlib.closing(redis.Redis(
                    port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5,
                    retry=Retry(NoBackoff(), 0))) as conn:
                return bool(conn.info("server")["process_id"] == proc.pid)

        wait_for(f"redis-server on port {self.port} answering", answering, START_TIMEOUT_S)

    def ping(self) -> bool:
        with contextlib.closing(client(self.port)) as conn:
            return bool(conn.ping())

    def kill(self) -> None:
        """SIGKILL the process (a crash: no shutdown, no save)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=5)
            self.proc = None

    def stop(self) -> None:
        """Terminate the process (SIGKILL after 5 s); never raises."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None


@dataclass
class Servers:
    """Processes started together; ``stop_all`` stops every one of them."""

    workdir: Path
    servers: list[Server] = field(default_factory=list)

    def add(self, args: Callable[[int], list[str]]) -> Server:
        """Start a server on a free port with ``args(port)``. A port taken by another process
        between the pick and the server's bind (its log says so) is picked again, twice at
        most. Raises :class:`ServerExited` for any other early exit."""
        for attempt in range(3):
            port = free_port()
            server = Server(port=port, workdir=self.workdir, args=args(port))
            self.servers.append(server)
            try:
                server.start()
            except ServerExited as exc:
                if "Address already in use" not in str(exc) or attempt == 2:
                    raise
                continue
            return server
        raise AssertionError("unreachable")

    def stop_all(self) -> None:
        for server in self.servers:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                server.stop()


@contextlib.contextmanager
def server_group(name: str) -> Iterator[Servers]:
    """Servers started under one temporary directory; all stopped and the directory deleted
    on exit."""
    with tempfile.TemporaryDirectory(prefix=f"dedup-relay-{name}-") as tmp:
        servers = Servers(workdir=Path(tmp))
        try:
            yield servers
        finally:
            servers.stop_all()


# ---------------------------------------------------------------------------------------------
# Redis Cluster
# ---------------------------------------------------------------------------------------------


@dataclass
class Cluster:
    """A running three-master, three-replica cluster."""

    nodes: list[Server]

    @property
    def url(self) -> str:
        """The store URL naming every node as a startup node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.live())

    def live(self) -> list[Server]:
        return [n for n in self.nodes if n.proc is not None]

    def node(self, port: int) -> Server:
        return next(n for n in self.nodes if n.port == port)

    def replica_port_of(self, master_port: int) -> int:
        """The port of the replica that follows the master on ``master_port``."""
        with contextlib.closing(client(master_port)) as conn:
            info = conn.info("replication")
        return int(info["slave0"]["port"])

    def state_ok(self, port: int) -> bool:
        with contextlib.closing(client(port)) as conn:
            info = conn.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    def wait_ok(self, timeout_s: float = 15.0) -> float:
        """Wait until every live node reports cluster_state:ok; return the seconds it took."""
        return wait_for("cluster_state:ok on every node",
                        lambda: all(self.state_ok(n.port) for n in self.live()), timeout_s)

    def wait_healthy(self) -> None:
        """Wait for cluster_state:ok, every replica in sync, and a write on every master
        acknowledged by its replica."""
        self.wait_ok()
        wait_for("every replica in sync", lambda: all(
            self.in_sync(n.port) for n in self.live() if not self.is_master(n.port)), 15.0)
        for port in self.masters():
            replicate(port, self.keys_on(port, "redis_servers:probe:", 1)[0])

    def is_master(self, port: int) -> bool:
        return is_master(port)

    def in_sync(self, port: int) -> bool:
        return in_sync(port)

    def masters(self) -> dict[int, list[tuple[int, int]]]:
        """Each master's port and its slot ranges, as CLUSTER SLOTS reports them now."""
        owners: dict[int, list[tuple[int, int]]] = {}
        with contextlib.closing(client(self.live()[0].port)) as conn:
            for start, end, master, *_ in conn.execute_command("CLUSTER", "SLOTS"):
                owners.setdefault(int(master[1]), []).append((int(start), int(end)))
        return owners

    def master_of(self, key: str, masters: dict[int, list[tuple[int, int]]]) -> int:
        """The port of the master that serves ``key`` in ``masters`` (from :meth:`masters`)."""
        slot = key_slot(key.encode())
        return next(port for port, ranges in masters.items()
                    if any(a <= slot <= b for a, b in ranges))

    def keys_on(self, master_port: int, prefix: str, count: int) -> list[str]:
        """``count`` keys ``prefix<n>`` whose slots the master on ``master_port`` serves."""
        ranges = self.masters()[master_port]
        keys: list[str] = []
        n = 0
        while len(keys) < count:
            key = f"{prefix}{n}"
            if any(a <= key_slot(key.encode()) <= b for a, b in ranges):
                keys.append(key)
            n += 1
        return keys


def _cluster_args(workdir: Path, port: int) -> list[str]:
    return ["--cluster-enabled", "yes",
            "--cluster-config-file", str(workdir / f"nodes-{port}.conf"),
            "--cluster-node-timeout", "1000", "--cluster-port", str(free_port()),
            *_FAST_SYNC, "--save", "", "--appendonly", "no"]


@contextlib.contextmanager
def redis_cluster() -> Iterator[Cluster]:
    """Start a 3-master/3-replica cluster; stop it and delete its files on exit."""
    with server_group("cluster") as servers:
        nodes = [servers.add(lambda port: _cluster_args(servers.workdir, port))
                 for _ in range(6)]
        exe = shutil.which("redis-cli") or "redis-cli"
        subprocess.run(
            [exe, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True, timeout=30)
        cluster = Cluster(nodes=nodes)
        cluster.wait_healthy()  # so WAIT and failovers behave from the first test on
        yield cluster


# ---------------------------------------------------------------------------------------------
# Redis Sentinel
# ---------------------------------------------------------------------------------------------


@dataclass
class SentinelSet:
    """A master and (unless started without) a replica watched by one sentinel as ``m``."""

    master: Server
    replica: Server | None
    sentinel: Server

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel.port}/{SENTINEL_SERVICE}"

    def master_port(self) -> int:
        """The port of the master the sentinel names now."""
        with contextlib.closing(client(self.sentinel.port)) as conn:
            _host, port = conn.execute_command(
                "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_SERVICE)
        return int(port)

    def follow(self, port: int) -> None:
        """Make the server on ``port`` a replica of the current master and wait until it is in
        sync, as Sentinel would (it waits ~10 s before it converts a reachable old master)."""
        master = self.master_port()
        with contextlib.closing(client(port)) as conn:
            conn.replicaof("127.0.0.1", str(master))
        wait_for(f"server {port} in sync with master {master}", lambda: in_sync(port), 15.0)
        replicate(master)

    def replica_known(self) -> bool:
        """True when the sentinel knows a replica that is up and linked to the master."""
        with contextlib.closing(client(self.sentinel.port)) as conn:
            replicas = conn.sentinel_slaves(SENTINEL_SERVICE)
        return any(not r["is_sdown"] and r.get("master-link-status") == "ok" for r in replicas)


@contextlib.contextmanager
def redis_sentinel(*, with_replica: bool = True) -> Iterator[SentinelSet]:
    """Start master, replica (unless not ``with_replica``) and sentinel; stop them and delete
    their files on exit."""
    with server_group("sentinel") as servers:
        plain = [*_FAST_SYNC, "--save", "", "--appendonly", "no"]
        master = servers.add(lambda _port: plain)
        replica = servers.add(lambda _port: [*plain, "--replicaof", "127.0.0.1",
                                             str(master.port)]) if with_replica else None
        conf = servers.workdir / "sentinel.conf"
        conf.write_text(
            f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master.port} 1\n"
            f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n"
            f"sentinel failover-timeout {SENTINEL_SERVICE} 3000\n")
        sentinel = servers.add(lambda _port: [str(conf), "--sentinel"])
        sentinels = SentinelSet(master=master, replica=replica, sentinel=sentinel)
        if with_replica:
            wait_for("the sentinel knowing the replica", sentinels.replica_known, 15.0)
            replicate(master.port)
        else:
            wait_for("the sentinel naming the master", lambda: bool(sentinels.master_port()),
                     15.0)
        yield sentinels
