"""On a PROXY-protocol listener, a connection that closes (FIN) while the relay waits for its
PROXY header gives its connection slot back at once, not after the header wait
(``proxy_protocol_timeout``): a load balancer's health check connects and closes, hundreds of
times. Raw sockets on the plain listener, the STARTTLS one (the header comes before any TLS)
and the implicit-TLS one (the header is read inside TLS), on both loops."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time

import pytest
from pydantic import ValidationError

from relay.app import Relay
from relay.settings import Settings
from tests.support.pki import Pki, tls_relay
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.both_loops

SLOTS = 4
HEADER_WAIT_S = 30.0  # far longer than any wait below: a slot back is never the wait's end
CLOSED_WITHIN_S = 10.0
HEADER = b"PROXY TCP4 192.0.2.10 127.0.0.1 40000 25\r\n"
SENT_BEFORE_FIN = {
    "nothing": b"",
    "part-of-the-signature": b"PROX",
    "part-of-a-v1-header": HEADER[:20],
    "part-of-a-v2-header": b"\r\n\r\n\x00\r\nQU",
}


def _connect(port: int, context: ssl.SSLContext | None) -> socket.socket:
    """A blocking TCP connection to ``port`` (over TLS when ``context`` is given)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=CLOSED_WITHIN_S)
    if context is None:
        return sock
    return context.wrap_socket(sock, server_hostname="relay.test")


def _half_closed(port: int, context: ssl.SSLContext | None, sent: bytes) -> float:
    """Connect, send ``sent``, shut down the sending side (a TCP FIN; over TLS with no
    close_notify), and return the seconds until the relay closed the connection (or
    ``inf`` when it did not within CLOSED_WITHIN_S)."""
    sock = _connect(port, context)
    try:
        if sent:
            sock.sendall(sent)
        sock.shutdown(socket.SHUT_WR)  # on a TLS socket: the plain socket's, nothing of TLS
        started = time.monotonic()
        try:
            while sock.recv(4096):  # over TLS: the raw records the relay still sends
                pass
        except TimeoutError:
            return float("inf")
        except OSError:
            pass  # reset: closed too
        return time.monotonic() - started
    finally:
        sock.close()


def _greeting(port: int, context: ssl.SSLContext | None) -> str:
    """The first line the relay sends a client whose balancer sent a whole PROXY header."""
    sock = _connect(port, context)
    try:
        sock.sendall(HEADER)
        line = b""
        while not line.endswith(b"\n"):
            chunk = sock.recv(1)
            if not chunk:
                break
            line += chunk
        return line.decode(errors="replace").strip()
    finally:
        sock.close()


async def _proxy_relay(make_relay: MakeRelay, sink: Sink, pki: Pki, listener: str
                       ) -> tuple[Relay, int, ssl.SSLContext | None]:
    """A PROXY-protocol relay with SLOTS connection slots; the port and client TLS context
    of ``listener``."""
    limits: dict[str, object] = {
        "proxy_protocol": True, "proxy_networks": "127.0.0.1/32",
        "allowed_networks": "192.0.2.0/24", "max_connections": SLOTS,
        "max_connections_per_ip": SLOTS, "proxy_protocol_timeout": HEADER_WAIT_S}
    if listener == "plain":
        relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", **limits)
        return relay, relay.port, None
    relay = await tls_relay(make_relay, sink, pki, **limits)
    if listener == "starttls":
        return relay, relay.port, None
    return relay, relay.tls_port, pki.client_context


@pytest.mark.parametrize("sent", list(SENT_BEFORE_FIN), ids=list(SENT_BEFORE_FIN))
@pytest.mark.parametrize("listener", ["plain", "starttls", "implicit-tls"])
async def test_a_connection_closed_during_the_header_wait_gives_its_slot_back(
        make_relay: MakeRelay, sink: Sink, pki: Pki, listener: str, sent: str) -> None:
    """Every slot taken by a client that sends nothing or part of a PROXY header and then
    closes its side: the relay closes each at once (long before the header wait), and as many
    new clients with a whole header are all greeted 220."""
    relay, port, context = await _proxy_relay(make_relay, sink, pki, listener)
    closed_after = await asyncio.gather(*(
        asyncio.to_thread(_half_closed, port, context, SENT_BEFORE_FIN[sent])
        for _ in range(SLOTS)))
    assert max(closed_after) < CLOSED_WITHIN_S, closed_after
    greetings = await asyncio.gather(*(
        asyncio.to_thread(_greeting, port, context) for _ in range(SLOTS)))
    assert all(g.startswith("220") for g in greetings), greetings
    del relay


def _closed_after_silence(port: int) -> float:
    """Connect, send nothing, keep the sending side open; the seconds until the relay closed
    the connection."""
    sock = _connect(port, None)
    try:
        started = time.monotonic()
        while sock.recv(4096):
            pass
        return time.monotonic() - started
    finally:
        sock.close()


async def test_a_connection_without_a_header_is_closed_after_proxy_protocol_timeout(
        make_relay: MakeRelay, sink: Sink) -> None:
    """With ``proxy_protocol_timeout = 1`` a balancer's connection that sends nothing (and
    keeps its side open) is closed about 1 s after it connected, with no greeting."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", proxy_protocol=True,
                             proxy_networks="127.0.0.1/32", proxy_protocol_timeout=1.0)
    waited = await asyncio.to_thread(_closed_after_silence, relay.port)
    assert 0.9 <= waited < CLOSED_WITHIN_S, waited


@pytest.mark.parametrize("value", ["0", "-1", "301"])
def test_a_header_wait_out_of_range_is_refused(value: str) -> None:
    """``proxy_protocol_timeout`` must be more than 0 and at most 300 seconds."""
    with pytest.raises(ValidationError, match="proxy_protocol_timeout"):
        Settings.model_validate({"upstream": "127.0.0.1:25", "proxy_protocol_timeout": value})
