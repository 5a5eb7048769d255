"""Ordered upstreams with failover through real `serve` processes: the list from
repeated flags, from RELAY_UPSTREAM and from a TOML array; a bad entry refused with exit 78;
a hang after the dot never reaches the second upstream; cool-down and recovery in `/readyz`
of one process and of the supervisor of two workers. Two real sinks in the test's loop, the
shared test Redis under a random prefix."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiosmtpd.smtp import SMTP

from tests.support.cli import run_cli
from tests.support.clients import message, send
from tests.support.metrics import readyz, scrape
from tests.support.net import free_port
from tests.support.relays import REDIS_URL, ServeProcess, delete_prefix, start_serve
from tests.support.sink import Sink, SinkHandler, start_sink
from tests.support.waiting import until

pytestmark = pytest.mark.timeout(90)

Serve = Callable[..., Awaitable[ServeProcess]]


@pytest.fixture
async def second() -> AsyncIterator[Sink]:
    """The second upstream: a fresh sink."""
    s = await start_sink()
    yield s
    s.server.close()


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Serve]:
    """Factory: ``await serve(*flags, workers=1, env=None)`` -> a `serve` process on the test
    Redis under a fresh prefix; stopped and its keys deleted at the end."""
    started: list[tuple[ServeProcess, str]] = []

    async def make(*flags: str, workers: int = 1, env: dict[str, str] | None = None
                   ) -> ServeProcess:
        prefix = f"test:failover:{uuid.uuid4().hex}:"
        relay = await start_serve(
            tmp_path, "--store", REDIS_URL, "--store-prefix", prefix,
            "--settle-journal", str(tmp_path / f"owed-{prefix[-9:-1]}.jsonl"),
            "--shutdown-grace", "5", "--upstream-connect-timeout", "2", *flags,
            workers=workers, env=env)
        started.append((relay, prefix))
        return relay

    yield make
    for relay, prefix in started:
        relay.stop()
        delete_prefix(REDIS_URL, prefix)


def _address(port: int) -> str:
    return f"127.0.0.1:{port}"


def _value(metrics_port: int, name: str, **labels: str) -> float:
    samples = scrape(metrics_port)
    return sum(v for got, v in samples.get(name, []) if labels.items() <= got.items())


async def test_repeated_flags_first_down_second_delivers_once(
        serve: Serve, second: Sink) -> None:
    """`--upstream DEAD --upstream SINK`: the message goes to the second, once; the first is
    not ready by its name (the start-up probe or the message's failover found it down)."""
    dead = free_port()
    relay = await serve("--upstream", _address(dead), "--upstream", _address(second.port),
                        "--metrics-listen", "127.0.0.1:0")
    assert relay.metrics_port is not None
    result = await send(relay.port, ["user@example.net"], message(key="SYS-1"))
    assert result.code == 250, result
    assert len(second.handler.delivered) == 1
    assert _value(relay.metrics_port, "relay_upstream_up", upstream=_address(dead)) == 0
    assert _value(relay.metrics_port, "relay_upstream_up", upstream=_address(second.port)) == 1
    assert _value(relay.metrics_port, "relay_upstream_replies_total", code_class="2xx",
                  upstream=_address(second.port)) == 1


async def test_env_list_is_tried_in_order(serve: Serve, sink: Sink, second: Sink) -> None:
    """RELAY_UPSTREAM=a,b: a takes the mail while it answers; b is not used."""
    relay = await serve(env={"RELAY_UPSTREAM": f"{_address(sink.port)},{_address(second.port)}"},
                        workers=1)
    for i in range(3):
        assert (await send(relay.port, ["u@example.net"], message(key=f"E-{i}"))).code == 250
    assert len(sink.handler.delivered) == 3 and second.handler.transactions == 0


async def test_toml_array_with_an_inline_table(serve: Serve, tmp_path: Path,
                                               second: Sink) -> None:
    """`upstream = ["DEAD", { address = "SINK", name = "backup" }]` in the config file: the
    second, named backup, takes the message; its name is the metric label."""
    dead = free_port()
    config = tmp_path / "relay.toml"
    config.write_text(f'upstream = ["{_address(dead)}", '
                      f'{{ address = "{_address(second.port)}", name = "backup" }}]\n')
    relay = await serve("--config", str(config), "--metrics-listen", "127.0.0.1:0")
    assert relay.metrics_port is not None
    assert (await send(relay.port, ["u@example.net"], message(key="TOML-1"))).code == 250
    assert len(second.handler.delivered) == 1
    assert _value(relay.metrics_port, "relay_upstream_replies_total", code_class="2xx",
                  upstream="backup") == 1
    started = relay.listening()[0]["message"]
    assert f"{_address(dead)}, backup={_address(second.port)}" in started


@pytest.mark.parametrize("flags, named", [
    (("--upstream", "nohost", "--upstream", "127.0.0.1:2525"), "'nohost'"),
    (("--upstream", "127.0.0.1:2525,maildir:/tmp/x"), "must be the only upstream"),
    (("--upstream", "127.0.0.1:2525", "--upstream", "127.0.0.1:2525"), "127.0.0.1:2525"),
])
def test_a_bad_entry_is_exit_78_naming_it(tmp_path: Path, flags: tuple[str, ...],
                                          named: str) -> None:
    """A malformed entry, a Maildir in a list, a name twice: check-config exits 78 naming
    the entry and the setting."""
    done = run_cli("check-config", *flags, cwd=tmp_path)
    assert done.returncode == 78, done
    assert named in done.stderr and "--upstream" in done.stderr, done.stderr


async def test_hang_after_the_dot_never_reaches_the_second(serve: Serve, sink: Sink,
                                                           second: Sink) -> None:
    """The first upstream hangs after the dot: 451 4.4.2 in doubt, the second never sees
    the message, and the client's retry is suppressed."""
    sink.handler.hang_after_dot_s = 20.0
    relay = await serve("--upstream", _address(sink.port), "--upstream", _address(second.port),
                        "--upstream-timeout", "1")
    first = await send(relay.port, ["u@example.net"], message(key="HANG-1"))
    assert first.code == 451 and first.text.startswith("4.4.2"), first
    sink.handler.hang_after_dot_s = 0.0
    retry = await send(relay.port, ["u@example.net"], message(key="HANG-1"))
    assert retry.code == 250, retry
    assert second.handler.transactions == 0
    assert len(sink.handler.delivered) == 1


@pytest.mark.parametrize("workers", [1, 2])
async def test_cool_down_and_recovery_in_readyz(serve: Serve, second: Sink,
                                                workers: int) -> None:
    """The first upstream is down at start: /readyz stays 200 through the second and shows
    the first not ready (cooling down); once it listens, the probe brings it back to ready
    (`relay_upstream_up` 1), and mail goes to it again."""
    port = free_port()
    relay = await serve("--upstream", _address(port), "--upstream", _address(second.port),
                        "--upstream-cooldown", "0.5", "--upstream-cooldown-max", "1",
                        "--health-interval", "0.2", "--metrics-listen", "127.0.0.1:0",
                        workers=workers)
    metrics_port = relay.metrics_port
    assert metrics_port is not None

    async def first_state() -> str:
        status, body = await asyncio.to_thread(readyz, metrics_port)
        assert status == 200, body
        return str(body.get("upstreams", {}).get(_address(port), {}).get("state", ""))

    async def first_not_ready() -> bool:
        return (await first_state()) not in ("", "ready")

    await until(first_not_ready, within_s=10.0, what="the first upstream not ready")
    handler = SinkHandler()
    server = await asyncio.get_running_loop().create_server(
        lambda: SMTP(handler, hostname="back.test"), host="127.0.0.1", port=port)
    try:
        async def first_ready() -> bool:
            return (await first_state()) == "ready"

        await until(first_ready, within_s=10.0, what="the first upstream ready again")
        assert await asyncio.to_thread(
            _value, metrics_port, "relay_upstream_up", upstream=_address(port)) == 1
        assert (await send(relay.port, ["u@example.net"], message(key="BACK-1"))).code == 250
        assert len(handler.delivered) == 1 and second.handler.transactions == 0
    finally:
        server.close()


@pytest.mark.parametrize("entry, named", [
    ('{ address = "127.0.0.1:2525", name = "backup", auth = "xoauth2" }',
     "upstream backup: auth xoauth2 needs user, oauth_token_url"),
    ('{ address = "127.0.0.1:2525", name = "backup", client_cert = "c.pem" }',
     "upstream backup: client_cert and client_key go together"),
    ('{ address = "127.0.0.1:2525", name = "backup", ca_file = "nothing.pem" }',
     "upstream backup: nothing.pem: no PEM CA file"),
    ('{ address = "127.0.0.1:2525", name = "backup", password_file = "none.txt" }',
     "upstream backup: password_file: No such file or directory: none.txt"),
    ('{ address = "127.0.0.1:2525", name = "two words" }', "upstream.1.name"),
    ('{ address = "127.0.0.1:2525", tls = "ssl" }', "upstream.1.tls"),
])
def test_a_bad_inline_table_is_exit_78_naming_it(tmp_path: Path, entry: str,
                                                 named: str) -> None:
    """An inline table whose own settings do not hold (OAuth2 without its endpoint, a
    certificate without its key, a CA file or password file that is not there, a bad name or
    value): check-config exits 78 naming the entry."""
    config = tmp_path / "relay.toml"
    config.write_text(f'upstream = ["127.0.0.1:2526", {entry}]\n')
    done = run_cli("check-config", "--config", str(config), cwd=tmp_path)
    assert done.returncode == 78, done
    assert named in done.stderr, done.stderr


def test_cooldown_max_below_the_cooldown_is_refused(tmp_path: Path) -> None:
    """--upstream-cooldown 60 --upstream-cooldown-max 10: exit 78 naming both."""
    done = run_cli("check-config", "--upstream", "127.0.0.1:2525", "--upstream-cooldown", "60",
                   "--upstream-cooldown-max", "10", cwd=tmp_path)
    assert done.returncode == 78, done
    assert "--upstream-cooldown-max" in done.stderr and "--upstream-cooldown," in done.stderr
