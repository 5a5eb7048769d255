"""``upstream_helo_name``: the name the relay gives in EHLO to the smarthost (a smarthost that
checks it against the client's address, as Postfix's ``smtp_helo_name`` sets it), else the
relay's ``hostname``; a name that could break the command is invalid configuration. A real
relay in this process and a real aiosmtpd sink."""

from __future__ import annotations

import pytest

from relay.core.errors import ConfigError
from relay.settings import load_settings
from tests.support.clients import message, send
from tests.support.relays import MakeRelay
from tests.support.sink import Sink


async def test_the_smarthost_is_greeted_with_the_helo_name(make_relay: MakeRelay,
                                                            sink: Sink) -> None:
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", hostname="relay.internal",
                             upstream_helo_name="mail.example.org")
    assert (await send(relay.port, ["a@example.net"], message(key="helo-1"))).code == 250
    assert [d.helo for d in sink.handler.delivered] == ["mail.example.org"]


async def test_without_it_the_smarthost_is_greeted_with_the_hostname(make_relay: MakeRelay,
                                                                      sink: Sink) -> None:
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", hostname="relay.internal")
    assert (await send(relay.port, ["a@example.net"], message(key="helo-2"))).code == 250
    assert [d.helo for d in sink.handler.delivered] == ["relay.internal"]


@pytest.mark.parametrize("name", ["mail example.org", "mail.example.org\r\nRSET", ""])
def test_a_name_that_would_break_the_command_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="upstream_helo_name"):
        load_settings({"upstream": "127.0.0.1:25", "upstream_helo_name": name})
