"""An upstream that answers at once, on asyncio's loop and on uvloop's (tests/conftest.py).

aiosmtplib drops a reply that arrives while no read is pending; uvloop runs a connection's
``data_received`` before task steps queued earlier, so a final dot written in the transfer's
first step could be answered before the reader started: the 250 was lost and the message
waited out the final-dot timeout (found with Postfix's smtp-sink).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.support.clients import message, send
from tests.support.relays import MakeRelay

pytestmark = pytest.mark.both_loops


def _serve_one(conn: socket.socket, dots: list[int]) -> None:
    """Answer each SMTP line as soon as it is read (blocking socket, own thread)."""
    with conn, conn.makefile("rb") as lines:
        conn.sendall(b"220 fast.test ESMTP\r\n")
        in_data = False
        for line in lines:
            if in_data:
                if line == b".\r\n":
                    in_data = False
                    dots.append(1)
                    conn.sendall(b"250 2.0.0 Ok\r\n")
                continue
            verb = line[:4].upper()
            if verb == b"EHLO":
                conn.sendall(b"250-fast.test\r\n250-PIPELINING\r\n250 8BITMIME\r\n")
            elif verb == b"DATA":
                in_data = True
                conn.sendall(b"354 go ahead\r\n")
            elif verb == b"QUIT":
                conn.sendall(b"221 bye\r\n")
                return
            else:
                conn.sendall(b"250 Ok\r\n")


@pytest.fixture
def fast_peer() -> Iterator[tuple[int, list[int]]]:
    """(port, dots): a threaded peer on 127.0.0.1 that replies with no event loop delay."""
    server = socket.create_server(("127.0.0.1", 0))
    dots: list[int] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_serve_one, args=(conn, dots), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1], dots
    server.close()


async def test_every_final_dot_reply_of_a_fast_upstream_is_read(
    make_relay: MakeRelay, fast_peer: tuple[int, list[int]]
) -> None:
    """80 messages, several at a time: each answered 250 (none waits out the 3 s final timeout)."""
    port, dots = fast_peer
    relay = await make_relay(upstream=f"127.0.0.1:{port}", upstream_timeout=3.0)
    results = await asyncio.gather(*(
        send(relay.port, [f"user{n}@example.net"], message(key=f"K-{n}")) for n in range(80)))
    assert [r.code for r in results] == [250] * 80, [r for r in results if r.code != 250]
    assert len(dots) == 80
