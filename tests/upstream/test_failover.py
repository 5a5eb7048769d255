"""Ordered upstreams with failover: a message moves to the next upstream only on a
definite failure before any recipient was accepted and before DATA, never after the dot or an
accepted recipient; a failed upstream cools down, is probed, and comes back (``/readyz``).

Real relays (in this process, on a real Redis) in front of two real aiosmtpd sinks or a
scripted raw peer; nothing mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.smtp import SMTP

from relay.app import Relay
from relay.core.interfaces import DeliveryProgress, OutboundMessage, RcptStatus
from relay.settings import Settings
from relay.upstream.failover import COOLING, READY, FailoverUpstream
from relay.upstream.smtp import SmtpUpstream, SmtpUpstreamConfig
from tests.support.clients import message, send
from tests.support.metrics import readyz
from tests.support.net import free_port
from tests.support.peers import ScriptedPeer, serve_peer
from tests.support.relays import MakeRelay
from tests.support.sink import Sink, SinkHandler, start_sink
from tests.support.waiting import until


@pytest.fixture
async def second() -> AsyncIterator[Sink]:
    """The second upstream: a fresh sink."""
    s = await start_sink()
    yield s
    s.server.close()


def _address(port: int) -> str:
    return f"127.0.0.1:{port}"


def _failovers(relay: Relay, name: str) -> float:
    value = relay.registry.get_sample_value("relay_upstream_failovers_total",
                                            {"from_upstream": name})
    return value if value is not None else 0.0


async def test_first_down_the_second_takes_the_message_once(
        make_relay: MakeRelay, second: Sink) -> None:
    """Nothing listens on the first upstream: the second gets the message, once; the
    failover is counted against the first; the reply is counted for the second."""
    dead = free_port()
    relay = await make_relay(upstream=f"{_address(dead)},{_address(second.port)}")
    result = await send(relay.port, ["user@example.net"], message(key="F-1"))
    assert result.code == 250, result
    assert len(second.handler.delivered) == 1
    assert _failovers(relay, _address(dead)) == 1
    assert relay.registry.get_sample_value(
        "relay_upstream_replies_total",
        {"code_class": "2xx", "upstream": _address(second.port)}) == 1
    again = await send(relay.port, ["user@example.net"], message(key="F-1"))
    assert again.code == 250 and len(second.handler.delivered) == 1  # suppressed


async def test_first_hangs_after_the_dot_nothing_goes_to_the_second(
        make_relay: MakeRelay, sink: Sink, second: Sink) -> None:
    """The first upstream takes the message and never answers the dot: 451 4.4.2 in doubt,
    the second never sees it, and the client's retry is suppressed (not sent anywhere)."""
    sink.handler.hang_after_dot_s = 30.0
    relay = await make_relay(upstream=f"{_address(sink.port)},{_address(second.port)}",
                             upstream_timeout=1.0)
    result = await send(relay.port, ["user@example.net"], message(key="H-1"))
    assert result.code == 451 and result.text.startswith("4.4.2"), result
    assert "in doubt" in result.text
    assert second.handler.transactions == 0
    assert _failovers(relay, _address(sink.port)) == 0
    sink.handler.hang_after_dot_s = 0.0
    retry = await send(relay.port, ["user@example.net"], message(key="H-1"))
    assert retry.code == 250, retry
    assert second.handler.transactions == 0
    assert len(sink.handler.delivered) == 1  # the first one's only


async def test_one_recipient_accepted_another_refused_no_other_upstream(
        make_relay: MakeRelay, sink: Sink, second: Sink) -> None:
    """The first upstream accepts one recipient and refuses the other temporarily: the
    attempt's result stands (one relayed, one told to retry); no other upstream is tried."""
    sink.handler.rcpt_plan["b@example.net"] = deque(["450 4.2.1 mailbox busy"])
    relay = await make_relay(upstream=f"{_address(sink.port)},{_address(second.port)}")
    result = await send(relay.port, ["a@example.net", "b@example.net"], message(key="P-1"))
    assert result.code == 450 and result.text.startswith("4.2.1"), result  # retry the rest
    assert second.handler.transactions == 0
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["a@example.net"]]
    assert _failovers(relay, _address(sink.port)) == 0
    retry = await send(relay.port, ["a@example.net", "b@example.net"], message(key="P-1"))
    assert retry.code == 250, retry  # a is suppressed (sent), b goes now
    assert [d.rcpt_tos for d in sink.handler.delivered] == [["a@example.net"],
                                                            ["b@example.net"]]
    assert second.handler.transactions == 0


async def test_a_4yz_to_mail_moves_on(make_relay: MakeRelay, sink: Sink,
                                      second: Sink) -> None:
    """A 451 to MAIL (no transaction began): the second upstream takes it."""
    sink.handler.mail_plan.append("451 4.3.0 try another")
    relay = await make_relay(upstream=f"{_address(sink.port)},{_address(second.port)}")
    result = await send(relay.port, ["user@example.net"], message(key="M-1"))
    assert result.code == 250, result
    assert len(second.handler.delivered) == 1 and not sink.handler.delivered


async def test_a_5yz_to_mail_is_the_answer(make_relay: MakeRelay, sink: Sink,
                                           second: Sink) -> None:
    """A 550 to MAIL is permanent: the client gets it, no other upstream is tried."""
    sink.handler.mail_plan.append("550 5.7.1 sender refused")
    relay = await make_relay(upstream=f"{_address(sink.port)},{_address(second.port)}")
    result = await send(relay.port, ["user@example.net"], message(key="M-2"))
    assert result.code == 550, result
    assert second.handler.transactions == 0


class Closing421(ScriptedPeer):
    """Greets with 421 and hangs up (a smarthost shedding load)."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Say 421 and close."""
        writer.write(b"421 4.3.2 too busy, closing\r\n")
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()


async def test_a_421_greeting_moves_on(make_relay: MakeRelay, second: Sink) -> None:
    """The first upstream greets 421: the second takes the message."""
    async with serve_peer(Closing421()) as peer:
        relay = await make_relay(upstream=f"{_address(peer.port)},{_address(second.port)}")
        result = await send(relay.port, ["user@example.net"], message(key="G-1"))
    assert result.code == 250, result
    assert len(second.handler.delivered) == 1
    assert _failovers(relay, _address(peer.port)) == 1


async def test_a_tls_failure_moves_on(make_relay: MakeRelay, sink: Sink,
                                      second: Sink) -> None:
    """The first upstream (an inline entry with its own TLS setting) cannot do implicit TLS:
    the handshake fails and the second (plain) takes the message."""
    relay = await make_relay(upstream=(
        {"address": _address(sink.port), "name": "primary", "tls": "tls", "verify": False},
        _address(second.port)))
    result = await send(relay.port, ["user@example.net"], message(key="T-1"))
    assert result.code == 250, result
    assert len(second.handler.delivered) == 1 and not sink.handler.delivered
    assert _failovers(relay, "primary") == 1


async def _readyz_async(port: int) -> tuple[int, dict[str, Any]]:
    return await asyncio.to_thread(readyz, port)


async def test_cool_down_and_recovery_in_readyz(make_relay: MakeRelay, second: Sink) -> None:
    """The first upstream is down: a message fails over, /readyz lists it as cooling down
    (until a time) while the relay stays ready through the second; once the first listens
    again, the probe at the end of the cool-down brings it back as ready, and the next
    message goes to it again."""
    port = free_port()
    relay = await make_relay(upstream=f"{_address(port)},{_address(second.port)}",
                             metrics_listen="127.0.0.1:0", health_interval=0.2,
                             upstream_cooldown=0.5, upstream_cooldown_max=1.0)
    assert (await send(relay.port, ["u@example.net"], message(key="C-1"))).code == 250
    status, body = await _readyz_async(relay.metrics_port)
    assert status == 200, body
    first = body["upstreams"][_address(port)]
    assert first["state"] == COOLING and first["until"] > time.time() - 1, body
    assert body["upstreams"][_address(second.port)]["state"] == READY
    handler = SinkHandler()
    server = await asyncio.get_running_loop().create_server(
        lambda: SMTP(handler, hostname="back.test"), host="127.0.0.1", port=port)
    try:
        async def back() -> bool:
            _, seen = await _readyz_async(relay.metrics_port)
            return bool(seen["upstreams"][_address(port)]["state"] == READY)

        await until(back, within_s=30.0, what="the first upstream ready again")
        assert relay.registry.get_sample_value(
            "relay_upstream_up", {"upstream": _address(port)}) == 1
        assert (await send(relay.port, ["u@example.net"], message(key="C-2"))).code == 250
        assert len(handler.delivered) == 1 and len(second.handler.delivered) == 1
    finally:
        server.close()


async def test_all_down_readyz_is_503_naming_each(make_relay: MakeRelay) -> None:
    """No upstream answers: /readyz is 503 and names each upstream's state."""
    one, two = free_port(), free_port()
    relay = await make_relay(upstream=f"{_address(one)},{_address(two)}",
                             metrics_listen="127.0.0.1:0", health_interval=0.2,
                             upstream_cooldown=5.0)
    status, body = await _readyz_async(relay.metrics_port)
    assert status == 503, body
    assert set(body["upstreams"]) == {_address(one), _address(two)}
    assert all(s["state"] == COOLING for s in body["upstreams"].values()), body
    assert not body["components"]["upstream"]["ok"]


async def test_a_single_upstream_is_always_tried(make_relay: MakeRelay) -> None:
    """One upstream keeps no cool-down: right after a failure the next message is tried on
    it (and delivered once it listens), as before the failover existed."""
    port = free_port()
    relay = await make_relay(upstream=_address(port), upstream_cooldown=60.0)
    assert (await send(relay.port, ["u@example.net"], message(key="S-1"))).code == 451
    handler = SinkHandler()
    server = await asyncio.get_running_loop().create_server(
        lambda: SMTP(handler, hostname="back.test"), host="127.0.0.1", port=port)
    try:
        assert (await send(relay.port, ["u@example.net"], message(key="S-1"))).code == 250
        assert len(handler.delivered) == 1
        assert relay.registry.get_sample_value(
            "relay_upstream_up", {"upstream": _address(port)}) == 1  # ready again
    finally:
        server.close()


def _smtp(port: int) -> SmtpUpstream:
    return SmtpUpstream(config=SmtpUpstreamConfig(
        host="127.0.0.1", port=port, local_hostname="relay.test", connect_timeout_s=1.0,
        command_timeout_s=2.0, final_timeout_s=2.0))


async def test_cool_down_doubles_up_to_its_cap_and_the_order_prefers_the_ready() -> None:
    """A failed upstream's cool-down doubles with each failed probe, capped; while it cools
    down the next one is preferred; when all cool down, the one whose cool-down ends first
    is tried."""
    dead, also_dead = free_port(), free_port()
    failover = FailoverUpstream(
        [("a", _smtp(dead)), ("b", _smtp(also_dead))], cooldown_s=0.05, cooldown_max_s=0.2)
    try:
        assert failover.preferred_name() == "a"
        msg = OutboundMessage("app@example.com", ["u@example.net"], b"Subject: x\r\n\r\nx\r\n")
        result = await failover.deliver(msg)
        assert result.failover and result.upstream == "b"
        assert result.recipients["u@example.net"].status is RcptStatus.REFUSED
        states = failover.states()
        assert states["a"].state == COOLING and states["b"].state == COOLING
        assert failover.preferred_name() == "a"  # its cool-down ends first
        await until(lambda: failover.states()["a"].failures >= 4, within_s=5.0,
                    what="four failed probes")
        a = failover.states()["a"]
        if a.until is not None:
            assert a.until - time.time() <= 0.2 + 0.05  # capped
    finally:
        await failover.close()


async def test_many_failures_at_once_are_one_cool_down(second: Sink) -> None:
    """Ten messages meet the dead first upstream at once: all go to the second, and the first
    cools down once (one failure, the first cool-down), not ten doublings."""
    dead = free_port()
    failover = FailoverUpstream([("a", _smtp(dead)), ("b", _smtp(second.port))],
                                cooldown_s=30.0, cooldown_max_s=600.0)
    try:
        results = await asyncio.gather(*(failover.deliver(OutboundMessage(
            "app@example.com", [f"u{i}@example.net"], b"Subject: x\r\n\r\nx\r\n"))
            for i in range(10)))
        assert {r.upstream for r in results} == {"b"}
        assert all(r.recipients[f"u{i}@example.net"].status is RcptStatus.ACCEPTED
                   for i, r in enumerate(results))
        a = failover.states()["a"]
        assert a.state == COOLING and a.failures == 1
        assert a.until is not None and a.until - time.time() <= 30.0
        assert failover.preferred_name() == "b"
    finally:
        await failover.close()


def test_an_entry_takes_its_own_settings_and_the_global_ones_for_the_rest(
        tmp_path: Path) -> None:
    """An inline table's keys apply to its upstream only; a key left out takes the global
    upstream_* setting; the name defaults to the address."""
    secret = tmp_path / "backup-password"
    secret.write_text("s3cret\n")
    values: dict[str, Any] = {
        "upstream": ("smtp1.test:587", {"address": "[::1]:2525", "name": "backup",
                                        "tls": "tls", "verify": False, "user": "b@example.com",
                                        "password_file": secret, "pool_size": 0}),
        "upstream_tls": "starttls", "upstream_user": "a@example.com",
        "upstream_password": "global", "upstream_pool_size": 7, "hostname": "relay.test"}
    settings = Settings(**values)
    first, backup = (settings.smtp_upstream_config(e, None, local_hostname=settings.hostname,
                                                   default_pool_size=3)
                     for e in settings.upstream)
    assert (first.name, first.host, first.port, first.tls, first.verify) == (
        "smtp1.test:587", "smtp1.test", 587, "starttls", True)
    assert (first.username, first.password, first.pool_size) == ("a@example.com", "global", 7)
    assert (backup.name, backup.host, backup.port, backup.tls, backup.verify) == (
        "backup", "::1", 2525, "tls", False)
    assert (backup.username, backup.password, backup.pool_size) == (
        "b@example.com", "s3cret", 0)
    assert settings.upstream_summary == "smtp1.test:587, backup=[::1]:2525"


async def test_the_before_dot_hook_runs_only_for_the_upstream_past_rcpt(
        sink: Sink, second: Sink) -> None:
    """The first upstream refuses MAIL with a 4yz: the hook (the SENDING mark) is not run for
    it; the second accepts the recipient, and the hook runs once, for it, before its dot."""
    sink.handler.mail_plan.append("451 4.3.0 try another")
    failover = FailoverUpstream([("a", _smtp(sink.port)), ("b", _smtp(second.port))])
    calls: list[tuple[list[str], int]] = []

    async def mark(accepted: Sequence[str]) -> bool:
        calls.append((list(accepted), second.handler.transactions))
        return True

    progress = DeliveryProgress(before_dot=mark)
    try:
        result = await failover.deliver(OutboundMessage(
            "app@example.com", ["u@example.net"], b"Subject: x\r\n\r\nx\r\n"), progress)
    finally:
        await failover.close()
    assert result.upstream == "b" and not result.failover
    assert result.recipients["u@example.net"].status is RcptStatus.ACCEPTED
    assert calls == [(["u@example.net"], 1)]  # once, during the second's transaction
    assert progress.dot_written and progress.before_dot is mark
    assert sink.handler.transactions == 1 and not sink.handler.delivered


async def test_a_silent_first_upstream_leaves_the_relay_ready_through_the_second(
        make_relay: MakeRelay, second: Sink) -> None:
    """The first upstream accepts TCP and never greets; the second is healthy. /readyz is 200
    (the first was slower than the readiness probe's share: no verdict, no cool-down; the
    second answered), and a message still reaches the second after the connect timeout."""
    held: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda _r, w: held.append(w), "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        relay = await make_relay(upstream=f"{_address(port)},{_address(second.port)}",
                                 metrics_listen="127.0.0.1:0", health_interval=0.2,
                                 upstream_connect_timeout=1.0)

        async def ready() -> bool:
            return (await _readyz_async(relay.metrics_port))[0] == 200

        await until(ready, within_s=30.0, what="/readyz 200 through the second upstream")
        await asyncio.sleep(0.6)  # several more readiness rounds: still ready
        code, body = await _readyz_async(relay.metrics_port)
        assert code == 200, body
        result = await send(relay.port, ["u@example.net"], message(key="SILENT-1"))
        assert result.code == 250 and second.handler.copies_to("u@example.net") == 1
    finally:
        silent.close()
        for writer in held:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await silent.wait_closed()


async def test_when_every_upstream_cools_down_each_is_tried_in_turn(second: Sink) -> None:
    """Both upstreams failed (cooling down, long cool-downs); the second comes back before any
    probe: the next message tries the first (its cool-down ends first), fails before anything
    was sent, and goes to the second instead of being refused."""
    down, back = free_port(), free_port()
    failover = FailoverUpstream(
        [("first", SmtpUpstream(config=SmtpUpstreamConfig(
            host="127.0.0.1", port=down, local_hostname="relay.test", pool_size=0))),
         ("second", SmtpUpstream(config=SmtpUpstreamConfig(
             host="127.0.0.1", port=back, local_hostname="relay.test", pool_size=0)))],
        cooldown_s=60.0, cooldown_max_s=60.0, probe_timeout_s=1.0)
    try:
        failed = await failover.deliver(OutboundMessage(
            mail_from="app@example.com", rcpt_tos=["u@example.net"],
            content=message(key="ALL-1")))
        assert failed.failover
        assert all(s.state == COOLING for s in failover.states().values())
        revived = await start_sink()
        try:
            failover._members[1].upstream = SmtpUpstream(config=SmtpUpstreamConfig(
                host="127.0.0.1", port=revived.port, local_hostname="relay.test",
                pool_size=0))
            result = await failover.deliver(OutboundMessage(
                mail_from="app@example.com", rcpt_tos=["u@example.net"],
                content=message(key="ALL-2")))
            assert result.upstream == "second", result
            assert result.recipients["u@example.net"].status is RcptStatus.ACCEPTED
            assert revived.handler.copies_to("u@example.net") == 1
        finally:
            revived.server.close()
    finally:
        await failover.close()
