"""The Maildir upstream settles each recipient by its own write (design.md §5.3).

A write that fails part way through a message's recipients is a real kernel refusal: the relay
runs as its own process and is given a file-size limit (``prlimit``, ``RLIMIT_FSIZE``: the
write fails with ``EFBIG``) that lets the files of short recipient addresses through and stops
the one for a longer address (each file carries its ``Delivered-To:`` line, so its size follows
the address). Lifting the limit again lets the retry through.
"""

from __future__ import annotations

import os
import resource
import signal
import smtplib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import wait_for_port
from tests.support.clients import message
from tests.support.net import free_port, maildir_files
from tests.support.relays import REDIS_URL, delete_prefix

SENDER = "app@example.com"
SHORT = ["a@example.net", "b@example.net"]
LONG = "a-much-longer-mailbox-name@example.net"
CALIBRATE = "c@example.net"


@pytest.fixture
def maildir_relay(tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[str], Path]]:
    """`dedup-relay serve` (Redis store, Maildir upstream); yields its port, process and
    Maildir path."""
    port, prefix, box = free_port(), f"test:maildir:{os.getpid()}:{free_port()}:", tmp_path / "md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env["RELAY_STORE_PREFIX"] = prefix
    proc = subprocess.Popen(
        # one process: the tests set a file size limit on the process that writes the Maildir
        [sys.executable, "-m", "relay", "serve", "--workers", "1",
         "--listen", f"127.0.0.1:{port}", "--upstream", f"maildir:{box}",
         "--metrics-listen", "off", "--store", REDIS_URL],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(port, proc)
        yield port, proc, box
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)  # waits, and closes the pipes (no ResourceWarning)
        delete_prefix(REDIS_URL, prefix)


def send_to(port: int, rcpts: list[str], key: str = "K-1") -> tuple[int, bytes]:
    """One message to ``rcpts``; the reply to the final dot."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        client.ehlo("client.test")
        client.mail(SENDER)
        for rcpt in rcpts:
            assert client.rcpt(rcpt)[0] == 250
        try:
            return client.data(message(key=key))
        except smtplib.SMTPDataError as exc:
            error = exc.smtp_error
            return exc.smtp_code, error.encode() if isinstance(error, str) else error


def copies(box: Path, rcpt: str) -> int:
    """How many files in the Maildir were delivered to ``rcpt``."""
    line = f"Delivered-To: {rcpt}\r\n".encode()
    return sum(1 for content in maildir_files(box) if line in content)


def test_a_failed_later_write_keeps_the_earlier_recipients_delivered(
    maildir_relay: tuple[int, subprocess.Popen[str], Path]
) -> None:
    """A write failing for one recipient refuses only it: the retry writes it, not the others."""
    port, proc, box = maildir_relay
    assert send_to(port, [CALIBRATE], key="K-0")[0] == 250  # same sizes as a@ and K-1
    limit = len(maildir_files(box)[0]) + (len(LONG) - len(SHORT[0])) // 2
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    first = send_to(port, [SHORT[0], LONG, SHORT[1]])
    assert first[0] == 451, first
    assert [copies(box, r) for r in (SHORT[0], LONG, SHORT[1])] == [1, 0, 1]
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE,
                     (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    retry = send_to(port, [SHORT[0], LONG, SHORT[1]])
    assert retry[0] == 250, retry
    assert b"relayed 1" in retry[1] and b"suppressed 2" in retry[1], retry
    assert [copies(box, r) for r in (SHORT[0], LONG, SHORT[1])] == [1, 1, 1]
