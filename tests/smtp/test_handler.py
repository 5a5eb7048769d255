"""Listener wire rules beyond the shared cases: path syntax, reply hygiene."""

from __future__ import annotations

import pytest

from relay.app import Relay
from relay.core import replies
from relay.core.interfaces import SmtpReply
from tests.support.clients import RawClient
from tests.support.sink import Sink


@pytest.mark.parametrize(("command", "reply"), [
    ("MAIL FROM:<app@example.com", replies.BAD_SENDER_SYNTAX),
    ("MAIL FROM:<a pp@example.com>", replies.BAD_SENDER_SYNTAX),
    ("MAIL FROM:app@example.com", replies.PATH_NEEDS_BRACKETS),
])
async def test_malformed_reverse_path_is_refused(relay: Relay, sink: Sink, command: str,
                                                 reply: SmtpReply) -> None:
    """A reverse path without its closing bracket or with a bare blank is refused, not fixed."""
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    assert await client.cmd(command) == str(reply)
    assert await client.cmd("MAIL FROM:<app@example.com>") == str(replies.SENDER_OK)
    await client.close()


@pytest.mark.parametrize("path", ["<us er@example.net>", "<user@example.net", "<a@b>x"])
async def test_malformed_forward_path_is_refused(relay: Relay, sink: Sink, path: str) -> None:
    """A forward path with a bare blank, no closing bracket or junk after it is 501 5.1.3."""
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    await client.cmd("MAIL FROM:<app@example.com>")
    assert await client.cmd(f"RCPT TO:{path}") == str(replies.BAD_RECIPIENT_SYNTAX)
    assert await client.cmd('RCPT TO:<"us er"@example.net>') == str(replies.RECIPIENT_OK)
    await client.close()


async def test_replies_never_echo_control_characters(relay: Relay) -> None:
    """A command holding CR or NUL is answered on one clean line with an enhanced code."""
    client = await RawClient.connect(relay.port)
    await client.write(b"NO\rOP\x00X\r\n")
    reply = await client.reply()
    assert reply.startswith("500 5.5.1 ")
    assert "\r" not in reply and "\x00" not in reply
    assert (await client.cmd("NOOP")).startswith("250 2.0.0")
    await client.close()
