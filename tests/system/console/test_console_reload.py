"""The console's files read again on SIGHUP, by the supervisor of a `serve` process with two
workers (the console is the supervisor's): a user taken out of the users file is signed out at
the next request, one added can sign in, and a file that does not load is refused (the
console keeps its users); a certificate renewed in place is served from the next handshake."""

from __future__ import annotations

import asyncio
import signal
import socket
import ssl
import time
from pathlib import Path

import bcrypt
import pytest
import trustme

from relay.credentials import format_entry
from tests.support.console import (
    OPERATOR,
    OPERATOR_PASSWORD,
    VIEWER,
    VIEWER_PASSWORD,
    browser,
    users_file,
)
from tests.support.net import free_port
from tests.support.relays import ServeProcess, start_serve
from tests.support.sink import Sink

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def reloaded(served: ServeProcess, count: int) -> str:
    """Send SIGHUP; the supervisor's ``count``-th reload line (applied or refused)."""
    served.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = [str(e["message"]) for e in served.lines()
                 if str(e.get("message", "")).startswith("configuration reload")]
        if len(lines) >= count:
            return lines[count - 1]
        await asyncio.sleep(0.05)
    raise AssertionError(f"no reload line: {served.lines()[-5:]}")


async def test_sighup_reads_the_console_users_again(tmp_path: Path, sink: Sink) -> None:
    """See the module's docstring."""
    users = users_file(tmp_path)
    port = free_port()
    served = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--store", "sqlite:///dedup.db",
        "--metrics-listen", "off", "--console-listen", f"127.0.0.1:{port}",
        "--console-auth-file", str(users), workers=2)
    viewer = browser(f"http://127.0.0.1:{port}")
    newcomer = browser(f"http://127.0.0.1:{port}")
    try:
        assert (await viewer.sign_in(VIEWER, VIEWER_PASSWORD))[0] == 303
        assert (await viewer.get("/stats"))[0] == 200
        new_hash = bcrypt.hashpw(b"new-pw-1", bcrypt.gensalt(4)).decode()
        operator_line = next(line for line in users.read_text().splitlines()
                             if line.startswith(f"{OPERATOR}:"))
        users.write_text(f"{operator_line}\n{format_entry('nina', new_hash, 'viewer')}\n")
        assert (await reloaded(served, 1)).startswith("configuration reloaded: applied "
                                                      "console_auth_file")
        assert (await viewer.get("/stats"))[0] == 302  # signed out: no longer in the file
        assert (await newcomer.sign_in("nina", "new-pw-1"))[0] == 303
        assert (await viewer.sign_in(VIEWER, VIEWER_PASSWORD))[0] == 401
        users.write_text("nina:not-a-hash:viewer\n")
        assert (await reloaded(served, 2)).startswith("configuration reload refused")
        assert (await newcomer.get("/stats"))[0] == 200
        other = browser(f"http://127.0.0.1:{port}")
        try:
            assert (await other.sign_in(OPERATOR, OPERATOR_PASSWORD))[0] == 303
        finally:
            await other.http.close()
    finally:
        await viewer.http.close()
        await newcomer.http.close()
        code = served.stop()
    assert code == 0, served.lines()[-5:]


def served_names(port: int, ca: Path) -> list[str]:
    """The DNS names of the certificate the console at ``port`` serves now."""
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            context.wrap_socket(raw) as tls:
        cert = tls.getpeercert()
    assert cert is not None
    names = cert.get("subjectAltName", ())
    assert isinstance(names, tuple)
    return sorted(str(value) for kind, value in names if kind == "DNS")


async def test_sighup_serves_a_renewed_console_certificate(tmp_path: Path, sink: Sink) -> None:
    """The console's own certificate renewed in place (same files, new content) is served
    from the next handshake after SIGHUP, which names it applied; sessions stay."""
    ca = trustme.CA()
    cert, key = tmp_path / "console.pem", tmp_path / "console.key"

    def issue(name: str) -> None:
        issued = ca.issue_cert(name, "127.0.0.1")
        issued.private_key_pem.write_to_path(str(key))
        issued.cert_chain_pems[0].write_to_path(str(cert))

    issue("old.console.test")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    port = free_port()
    served = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{sink.port}", "--store", "sqlite:///dedup.db",
        "--metrics-listen", "off", "--console-listen", f"127.0.0.1:{port}",
        "--console-auth-file", str(users_file(tmp_path)), "--console-tls-cert", str(cert),
        "--console-tls-key", str(key), workers=2)
    try:
        assert await asyncio.to_thread(served_names, port, tmp_path / "ca.pem") == [
            "old.console.test"]
        issue("new.console.test")
        line = await reloaded(served, 1)
        assert "console_tls_cert" in line and "needs a restart: none" in line, line
        assert await asyncio.to_thread(served_names, port, tmp_path / "ca.pem") == [
            "new.console.test"]
    finally:
        code = served.stop()
    assert code == 0, served.lines()[-5:]
