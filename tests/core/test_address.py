"""Envelope address syntax (relay/core/address.py) and the listener's refusals it drives.

An address without a domain (``RCPT TO:<user>``), ``<a..b@x>`` or ``<u@[]>`` is refused at the
command, never passed upstream, where an MTA may complete ``user`` with its own domain: mail to
the wrong mailbox, answered 250.
"""

from __future__ import annotations

import pytest

from relay.app import Relay
from relay.core import replies
from relay.core.address import (
    address_literal_ok,
    canonical_literal,
    mailbox_problem,
    mask_addresses_in,
)
from tests.support.clients import RawClient
from tests.support.sink import Sink


@pytest.mark.parametrize("path", [
    "user@example.com", "first.last@example.com", '"john doe"@example.com',
    '"a\\"b"@example.com', '"a@b"@example.com', "user+tag@sub.example.co.uk",
    "üser@bücher.example", "u@[192.0.2.1]", "u@[IPv6:2001:db8::1]", "u@[ipv6:::1]",
    "u@[x-tag:content]", "u@localhost", "!#$%&'*+-/=?^_`{|}~@example.com",
])
def test_mailboxes_are_accepted(path: str) -> None:
    """RFC 5321 4.1.2 Mailboxes (with RFC 6531 UTF-8) have no problem."""
    assert mailbox_problem(path) is None


@pytest.mark.parametrize(("path", "problem"), [
    ("user", "no domain"),
    ("x", "no domain"),
    ("u\uff20example.net", "no domain"),  # a fullwidth commercial at is no "@"
    ('"user@example.com"', "no domain"),
    ("a..b@example.com", "local part is neither a dot-string nor a quoted string"),
    (".a@example.com", "local part is neither a dot-string nor a quoted string"),
    ("a.@example.com", "local part is neither a dot-string nor a quoted string"),
    ("a b@example.com", "local part is neither a dot-string nor a quoted string"),
    ("a@b@example.com", "local part is neither a dot-string nor a quoted string"),
    ("@example.com", "local part is neither a dot-string nor a quoted string"),
    ("u@", "domain has an empty or malformed label"),
    ("u@example..com", "domain has an empty or malformed label"),
    ("u@.example.com", "domain has an empty or malformed label"),
    ("u@[]", "malformed address literal"),
    ("u@[IPv6:zz]", "malformed address literal"),
    ("u@[999.1.1.1]", "malformed address literal"),
    ("u@[1.2.3]", "malformed address literal"),
    ("u@[-bad:x]", "malformed address literal"),
    ("u@[tag:]", "malformed address literal"),
])
def test_non_mailboxes_are_named(path: str, problem: str) -> None:
    """Each refusal says what is wrong, never quoting the address."""
    assert mailbox_problem(path) == problem


@pytest.mark.parametrize("path", ["postmaster", "Postmaster", "POSTMASTER"])
def test_postmaster_alone_is_a_recipient_not_a_sender(path: str) -> None:
    """RFC 5321 4.5.1: only Postmaster may stand without a domain, and only as RCPT."""
    assert mailbox_problem(path, postmaster_alone=True) is None
    assert mailbox_problem(path) == "no domain"


def test_literal_helpers() -> None:
    """IPv4/IPv6/general literals validate; IP ones get one spelling."""
    assert address_literal_ok("[10.0.0.1]") and not address_literal_ok("[10.0.0.256]")
    assert canonical_literal("[IPv6:2001:DB8:0:0::1]") == "[ipv6:2001:db8::1]"
    assert canonical_literal("[IPv6:nonsense]") == "[ipv6:nonsense]"


async def _session(relay: Relay) -> RawClient:
    client = await RawClient.connect(relay.port)
    assert (await client.cmd("EHLO app.example.com")).startswith("250")
    return client


@pytest.mark.parametrize("path", ["<user>", "<a..b@example.net>", "<u@[]>", "<u@[999.1.1.1]>"])
async def test_rcpt_that_is_no_mailbox_gets_501_and_the_session_goes_on(
        relay: Relay, sink: Sink, path: str) -> None:
    """RCPT TO:<user> is 501 5.1.3, not relayed; a good RCPT in the same transaction is."""
    client = await _session(relay)
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250 ")
    assert await client.cmd(f"RCPT TO:{path}") == str(replies.BAD_RECIPIENT_SYNTAX)
    assert (await client.cmd("RCPT TO:<user@example.net>")).startswith("250 ")
    assert (await client.cmd("DATA")).startswith("354")
    await client.write(b"X-Dedupe-Key: A-1\r\n\r\nbody\r\n.\r\n")
    assert (await client.reply()).startswith("250 ")
    await client.close()
    assert sink.handler.rcpt_commands == ["user@example.net"]


async def test_postmaster_without_domain_is_a_recipient(relay: Relay) -> None:
    """RCPT TO:<Postmaster> is accepted (RFC 5321 4.5.1)."""
    client = await _session(relay)
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250 ")
    assert (await client.cmd("RCPT TO:<Postmaster>")).startswith("250 ")
    await client.close()


@pytest.mark.parametrize("path", ["<x>", "<a..b@example.com>", "<u@[]>"])
async def test_sender_that_is_no_mailbox_gets_501_5_1_7(relay: Relay, path: str) -> None:
    """MAIL FROM:<x> is 501 5.1.7; the null reverse path <> stays allowed."""
    client = await _session(relay)
    assert await client.cmd(f"MAIL FROM:{path}") == str(replies.BAD_SENDER_SYNTAX)
    assert (await client.cmd("MAIL FROM:<>")).startswith("250 ")
    await client.close()


@pytest.mark.parametrize("path", ["<user@example.net\u3002>", "<user@example.net\uff0e>"])
async def test_rcpt_with_a_mapped_root_dot_is_refused(relay: Relay, path: str) -> None:
    """A domain ending in a full stop that IDNA maps to "." is refused like example.net. is."""
    client = await _session(relay)
    assert (await client.cmd("MAIL FROM:<app@example.com> SMTPUTF8")).startswith("250 ")
    assert (await client.cmd(f"RCPT TO:{path}")).startswith("553 5.1.3")
    await client.close()


@pytest.mark.parametrize("path", ['""@example.com', '""@[192.0.2.1]'])
def test_quoted_local_part_that_is_empty_is_refused(path: str) -> None:
    """A quoted local part with nothing between its quotes names no mailbox."""
    assert mailbox_problem(path) == "local part is empty"


@pytest.mark.parametrize(("command", "reply"), [
    ('MAIL FROM:<""@example.com>', replies.BAD_SENDER_SYNTAX),
    ('RCPT TO:<""@example.net>', replies.BAD_RECIPIENT_SYNTAX),
])
async def test_empty_quoted_local_part_is_501_on_the_wire(relay: Relay, command: str,
                                                          reply: object) -> None:
    """MAIL FROM:<""@x> is 501 5.1.7 and RCPT TO:<""@x> is 501 5.1.3."""
    client = await RawClient.connect(relay.port)
    await client.cmd("EHLO client.test")
    if command.startswith("RCPT"):
        assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250")
    assert await client.cmd(command) == str(reply)
    await client.close()


UNBALANCED = ["<user@example.net", "user@example.net>", "<<user@example.net>",
              "<user@example.net>>", ">user@example.net<"]


@pytest.mark.parametrize("path", UNBALANCED)
def test_a_path_with_an_unbalanced_angle_bracket_is_no_mailbox(path: str) -> None:
    """A path with a stray '<' or '>' outside a quoted string is no Mailbox."""
    assert mailbox_problem(path) is not None


@pytest.mark.parametrize("path", ["<user@example.net", "<<user@example.net>",
                                  "user@example.net>"])
async def test_rcpt_with_an_unbalanced_angle_bracket_is_refused(
        relay: Relay, sink: Sink, path: str) -> None:
    """RCPT TO:<user@x (no closing bracket) or with a doubled one is refused 5yz, not relayed."""
    client = await _session(relay)
    assert (await client.cmd("MAIL FROM:<app@example.com>")).startswith("250 ")
    assert (await client.cmd(f"RCPT TO:{path}"))[:1] == "5"
    await client.close()
    assert sink.handler.rcpt_commands == []


@pytest.mark.parametrize("literal", ["[192.0.2.1", "[192.0.2 .1]", "[a[b]", "192.0.2.1]"])
def test_a_literal_without_its_bracket_syntax_is_refused(literal: str) -> None:
    """A literal that is not "[" dcontent "]" (RFC 5321 4.1.3) is not valid, whatever inside."""
    assert not address_literal_ok(literal)


@pytest.mark.parametrize(("text", "masked"), [
    ("450 4.2.0 <jane.roe@example.net>: greylisted", "450 4.2.0 <j***@example.net>: greylisted"),
    ("550 5.1.1 john@d.example and jane@d.example unknown",
     "550 5.1.1 j***@d.example and j***@d.example unknown"),
    ('550 5.1.1 "john doe"@example.com unknown', "550 5.1.1 ***@example.com unknown"),
    ("550 5.1.1 josé.müller@bücher.example no", "550 5.1.1 j***@bücher.example no"),
    ("550 5.1.1 <x@[192.0.2.1]>", "550 5.1.1 <***@[192.0.2.1]>"),
    ("RCPT TO:<first.last+tag@sub.example.org> refused",
     "RCPT TO:<f***@sub.example.org> refused"),
    ("250 2.0.0 Ok: queued as 4XyZ1", "250 2.0.0 Ok: queued as 4XyZ1"),
    ("j***@example.com", "j***@example.com"),
    ("no address here @ all", "no address here @ all"),
])
def test_addresses_in_a_free_text_are_masked(text: str, masked: str) -> None:
    """Every address inside a reply text (bracketed or bare, quoted or UTF-8 local part, a
    domain or an address literal) is masked as a recipient is; the rest stays, and a masked
    text masks to itself."""
    assert mask_addresses_in(text) == masked

