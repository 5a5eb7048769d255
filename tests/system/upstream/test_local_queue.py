"""A local Postfix keeps the queue in front of the relay (contrib/postfix/main.cf, the lines
docs/deploy/local-queue.md tells an operator to add): a message submitted while the relay is
down waits in Postfix's queue, goes out once when the relay is back, and the same message
submitted again (a retried job) is suppressed by the relay, Postfix's queue empty at the end.
A private Postfix instance (root and Debian's postfix), a real relay in this process, a real
aiosmtpd sink as the smarthost."""

from __future__ import annotations

import asyncio
import shutil
import smtplib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import postfix
from tests.support.clients import message
from tests.support.net import free_port
from tests.support.relays import MakeRelay
from tests.support.sink import Sink
from tests.support.waiting import until

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "contrib" / "postfix" / "main.cf"

pytestmark = [
    pytest.mark.skipif(not postfix.available(), reason="needs root and Debian's postfix"),
    pytest.mark.timeout(120),
]


def submit(port: int, key: str) -> None:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        client.sendmail("app@example.com", ["user@example.net"], message(key=key))


@pytest.fixture
def postfix_dir() -> Iterator[Path]:
    """A folder Postfix's daemons can reach (pytest's own temporary folders are 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="dedup-relay-postfix-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def test_postfix_queues_while_the_relay_is_down_and_the_retry_is_suppressed(
        make_relay: MakeRelay, sink: Sink, postfix_dir: Path) -> None:
    relay_port, postfix_port = free_port(), free_port()
    relaying = EXAMPLE.read_text().replace("[127.0.0.1]:2525", f"[127.0.0.1]:{relay_port}")
    with postfix.private_postfix(postfix_dir, postfix_port, relaying) as queue:
        await until(lambda: _accepts(postfix_port), what="the private Postfix to listen")
        await asyncio.to_thread(submit, postfix_port, "invoice-7")  # the relay is down
        # deferred, not merely queued: a flush sent while the first attempt is still failing
        # is lost, and the message then waits out Postfix's backoff (seen on a loaded runner)
        await until(lambda: postfix.queued(queue, ("deferred",)) == 1
                    and postfix.queued(queue) == 1 and not sink.handler.delivered,
                    within_s=30.0, what="the message deferred in Postfix's queue")
        relay = await make_relay(upstream=f"127.0.0.1:{sink.port}",
                                 listen=f"127.0.0.1:{relay_port}")
        assert relay.port == relay_port
        await asyncio.to_thread(postfix.flush, queue)
        await until(lambda: len(sink.handler.delivered) == 1 and postfix.queued(queue) == 0,
                    within_s=60.0, what="the queued message relayed once")
        await asyncio.to_thread(submit, postfix_port, "invoice-7")  # the job runs again
        await until(lambda: postfix.queued(queue) == 0, within_s=60.0,
                    what="Postfix's queue empty again")
        await asyncio.sleep(0.5)
    assert len(sink.handler.delivered) == 1  # the retry was suppressed, not sent twice


def _accepts(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
