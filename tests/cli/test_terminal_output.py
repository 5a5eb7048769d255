"""What `dedup-relay history` and `in-doubt` print on a terminal (a pty, as an operator's
shell gives them) when a client's Message-ID and a smarthost's reply carry control
characters: a relay served in the test's loop writes the rows to a real PostgreSQL ledger,
then the commands run as processes on the pty; and the escape itself, character by
character."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay.app import Relay
from relay.cli.terminal import shown, shown_lines
from tests.support.clients import message, send
from tests.support.postgres import wait_ledger_rows
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.timeout(90)

RCPT = "zoe@example.net"
HOSTILE_ID = "<\x1b[2J\x1b]0;pwned\x07\x9b6n\x7fé@x>"  # clear, title, C1 CSI, DEL; é stays
HOSTILE_REPLY = "250 2.0.0 Ok: queued as \x1b]8;;http://evil.example/\x07Q1\x1b]8;;\x07"


def on_a_terminal(args: list[str], env: dict[str, str], cwd: Path) -> bytes:
    """What ``python -m relay ARGS`` writes (stdout and stderr) to a pty it runs on."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    full_env.update(env, TERM="xterm")
    main, child = os.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "relay", *args], stdin=child,
                                stdout=child, stderr=child, env=full_env, cwd=cwd)
    finally:
        os.close(child)
    out = bytearray()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if not select.select([main], [], [], 0.5)[0]:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the process closed the pty
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=30) == 0, bytes(out)
    finally:
        os.close(main)
    return bytes(out)


def env_of(relay: Relay, ledger_url: str) -> dict[str, str]:
    return {"RELAY_LEDGER": ledger_url, "RELAY_STORE": relay.settings.store,
            "RELAY_STORE_PREFIX": relay.settings.store_prefix}


def assert_escaped(out: bytes) -> None:
    """No control character but the pty's own line ends reached the terminal; the escapes
    are visible and the printable UTF-8 text is as it was."""
    controls = {b for b in out if b < 0x20 or b == 0x7F} - {0x0A, 0x0D}
    assert not controls, out
    text = out.decode("utf-8")
    assert not any(0x80 <= ord(ch) <= 0x9F for ch in text), out
    assert "\\x1b[2J\\x1b]0;pwned\\x07\\x9b6n\\x7fé@x" in text, out


async def test_history_escapes_what_a_client_and_a_smarthost_sent(
        make_relay: MakeRelay, sink: Sink, ledger_url: str, tmp_path: Path) -> None:
    """A message relayed with a Message-ID and an upstream reply holding ESC, BEL, a C1 CSI
    and DEL: `history` prints both on the terminal with every control character escaped,
    and the recipient and the é as they are."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                             ledger_recipients="full")
    sink.handler.data_plan.append(HOSTILE_REPLY)
    sent = message(key="k-1", extra=f"Message-ID: {HOSTILE_ID}\r\n")
    assert (await send(relay.port, [RCPT], sent)).code == 250
    [row] = await wait_ledger_rows(ledger_url, 1)
    assert row["message_id"] == HOSTILE_ID and "\x1b]8;;" in row["reply"]
    out = await asyncio.to_thread(on_a_terminal, ["history", "--store-key", row["store_key"]],
                                  env_of(relay, ledger_url), tmp_path)
    assert_escaped(out)
    assert "\\x1b]8;;http://evil.example/\\x07Q1" in out.decode() and RCPT in out.decode()


async def test_in_doubt_escapes_what_a_client_sent(
        make_relay: MakeRelay, sink: Sink, ledger_url: str, tmp_path: Path) -> None:
    """A message left in doubt (the smarthost never answered the dot) whose Message-ID holds
    control characters: `in-doubt` prints it with every one escaped."""
    relay = await make_relay(upstream=f"127.0.0.1:{sink.port}", ledger=ledger_url,
                             upstream_timeout=0.6)
    sink.handler.hang_after_dot_s = 2.0
    sent = message(key="k-2", extra=f"Message-ID: {HOSTILE_ID}\r\n")
    assert (await send(relay.port, [RCPT], sent)).code == 451
    [row] = await wait_ledger_rows(ledger_url, 1)
    assert row["outcome"] == "unknown" and row["message_id"] == HOSTILE_ID
    out = await asyncio.to_thread(on_a_terminal, ["in-doubt"], env_of(relay, ledger_url),
                                  tmp_path)
    assert_escaped(out)
    assert row["store_key"] in out.decode()


def test_every_control_character_is_escaped_and_printable_text_kept() -> None:
    """Each C0 control, DEL, each C1 control and a lone surrogate become a visible escape;
    printable text (accents, CJK, emoji, a backslash) is printed as it is; line breaks are
    kept only by shown_lines."""
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0)]:
        assert shown(f"a{chr(code)}b") == f"a\\x{code:02x}b"
    assert shown("x\udcffy") == "x\\udcffy"
    assert shown("Zoë 東京 📨 a\\b") == "Zoë 東京 📨 a\\b"
    assert shown_lines("one\x1b\ntwo") == "one\\x1b\ntwo"
