"""SIGHUP reloads the configuration file: real `serve` processes (one, and two
workers under a supervisor), the shared test Redis under a random prefix, the sink as the
smarthost, real SMTP clients on existing and new connections, `dedup-relay reload`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import smtplib
import ssl
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import pytest

from relay.credentials import format_entry
from relay.reload import compare, file_digests
from relay.settings import Settings
from tests.support.cli import run_cli
from tests.support.clients import RawClient, message, send
from tests.support.metrics import scrape
from tests.support.net import free_port
from tests.support.pki import make_pki
from tests.support.relays import REDIS_URL, ServeProcess, _spawn_serve, delete_prefix, start_serve
from tests.support.sink import Sink
from tests.support.waiting import until

# A backstop against a hang, not a bound on the steps: each step waits with its own bound (a
# start up to 60 s, a CLI command up to 60 s, a reload line up to 15 s), and a loaded runner
# took 36 s to start two workers and 7 s to run one `dedup-relay reload`.
pytestmark = pytest.mark.timeout(240)

# A reload takes one of two paths: a relay in one process reads the file and applies it
# itself (relay.reload.relay_hangup); a supervisor reads and checks it, counts and logs the
# reload, and each worker applies its reading (relay.supervision.reloads, worker_hangup). A
# setting is applied by the same code on either path (relay.app.Relay.apply). So the tests
# of the paths themselves (the refusal and its count, two SIGHUPs at once, the SQLite file's
# locks) run with each; a setting's test runs with two workers where each worker must apply
# it (every new connection, whichever worker takes it) or the supervisor speaks for them (one
# line, no worker restarted), else in one process.
WORKERS = pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
TWO_WORKERS = pytest.mark.parametrize("workers", [2], ids=["two-workers"])
ONE_PROCESS = pytest.mark.parametrize("workers", [1], ids=["one-process"])
_IMPLICIT_TLS = re.compile(r"implicit TLS \[?[0-9a-fA-F.:]+?\]?:(\d+)")


def _toml(values: dict[str, Any]) -> str:
    """The settings as TOML (strings, numbers, booleans and lists of strings: JSON's spelling
    of them is TOML's)."""
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items())


@dataclass
class Configured:
    """A `serve` process started with ``--config path``; :meth:`rewrite` changes the file,
    :meth:`hangup` sends SIGHUP, :meth:`reloads` are the relay's reload lines."""

    relay: ServeProcess
    path: Path
    values: dict[str, Any]
    extra: str = ""  # appended to the file as is (a broken line)
    tls_port: int = 0
    created: list[Path] = field(default_factory=list)

    def rewrite(self, extra: str = "", **changes: Any) -> None:
        """Write the file again with ``changes`` (None removes a key) and ``extra`` text."""
        for key, value in changes.items():
            if value is None:
                self.values.pop(key, None)
            else:
                self.values[key] = value
        # written beside and renamed over, as an editor saves: a reload that reads the file
        # meanwhile sees the old text or the new one, never a half-written file
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(_toml(self.values) + extra)
        os.replace(partial, self.path)

    def hangup(self) -> None:
        """`kill -HUP` the serve process (the supervisor, or the only process)."""
        os.kill(self.relay.proc.pid, signal.SIGHUP)

    def reloads(self) -> list[dict[str, Any]]:
        """The relay's own reload lines (not a worker's)."""
        return [e for e in self.relay.lines()
                if str(e.get("message", "")).startswith("configuration reload")
                and "worker" not in e]

    async def reloaded(self, count: int = 1) -> dict[str, Any]:
        """Wait for the relay's ``count``-th reload line; that line."""
        await until(lambda: len(self.reloads()) >= count or self.relay.proc.poll() is not None,
                    15, "the reload line")
        assert self.relay.proc.poll() is None, self.relay.log_path.read_text()
        return self.reloads()[count - 1]


Start = Callable[..., Awaitable[Configured]]


@pytest.fixture
async def configured(tmp_path: Path, sink: Sink) -> AsyncIterator[Start]:
    """Factory: ``await configured(workers, **settings)`` -> a `serve` process in front of
    ``sink`` reading its settings from a TOML file (metrics on a free port); stopped and its
    keys deleted at the end."""
    started: list[Configured] = []

    async def make(workers: int, **settings: Any) -> Configured:
        prefix = f"test:reload:{uuid.uuid4().hex}:"
        values: dict[str, Any] = {
            "upstream": f"127.0.0.1:{sink.port}", "store": REDIS_URL, "store_prefix": prefix,
            "settle_journal": str(tmp_path / "owed.jsonl"), "metrics_listen": "127.0.0.1:0",
            "shutdown_grace": 5, "hostname": "relay.test", **settings}
        path = tmp_path / f"relay-{uuid.uuid4().hex[:6]}.toml"
        path.write_text(_toml(values))
        relay = await start_serve(tmp_path, "--config", str(path), workers=workers)
        relay.prefix = prefix
        run = Configured(relay=relay, path=path, values=values)
        for entry in relay.listening():
            found = _IMPLICIT_TLS.search(str(entry["message"]))
            if found:
                run.tls_port = int(found.group(1))
        started.append(run)
        return run

    yield make
    for run in started:
        await asyncio.to_thread(run.relay.stop)
        delete_prefix(REDIS_URL, run.relay.prefix)


async def _transaction(client: RawClient, mail_from: str, data: bytes,
                       rcpt: str = "user@example.net") -> str:
    """MAIL, RCPT, DATA on an open session; the reply to the first refused command or to the
    final dot."""
    reply = await client.cmd(f"MAIL FROM:<{mail_from}>")
    if not reply.startswith("250"):
        return reply
    reply = await client.cmd(f"RCPT TO:<{rcpt}>")
    if not reply.startswith("250"):
        await client.cmd("RSET")
        return reply
    assert (await client.cmd("DATA")).startswith("354")
    return await client.cmd(data + b".")


@TWO_WORKERS
async def test_allowed_senders_change_for_the_next_mail_on_an_open_connection(
        configured: Start, sink: Sink, workers: int) -> None:
    """A connection opened (and a message sent on it) before SIGHUP: its next MAIL FROM is
    checked against the new allowed_senders, and it was not dropped."""
    run = await configured(workers, allowed_senders=["*@a.example"])
    client = await RawClient.connect(run.relay.port)
    try:
        assert (await client.cmd("EHLO client.test")).startswith("250")
        assert (await _transaction(client, "app@a.example", message(key="S-1"))).startswith("250")
        assert (await _transaction(client, "app@b.example", message(key="S-2"))).startswith("550")
        run.rewrite(allowed_senders=["*@b.example"])
        run.hangup()
        line = await run.reloaded()
        assert line["level"] == "INFO", line
        assert line["message"] == ("configuration reloaded: applied allowed_senders; needs a "
                                   "restart: none"), line
        assert (await _transaction(client, "app@a.example", message(key="S-3"))).startswith(
            "550 5.7.1")
        assert (await _transaction(client, "app@b.example", message(key="S-4"))).startswith("250")
    finally:
        await client.close()
    assert len(sink.handler.delivered) == 2
    assert len(run.reloads()) == 1  # one line for the whole relay, not one per worker


@WORKERS
async def test_a_broken_file_is_refused_and_changes_nothing(configured: Start,
                                                           workers: int) -> None:
    """Broken TOML + SIGHUP: one ERROR line saying why, the old settings stay (an open
    connection and a new one), the relay serves on; counted as refused."""
    run = await configured(workers, allowed_senders=["*@a.example"])
    client = await RawClient.connect(run.relay.port)
    try:
        assert (await client.cmd("EHLO client.test")).startswith("250")
        assert (await _transaction(client, "app@a.example", message(key="B-1"))).startswith("250")
        run.rewrite(extra="allowed_senders = [\n", allowed_senders=["*@b.example"])
        run.hangup()
        line = await run.reloaded()
        assert line["level"] == "ERROR", line
        assert line["message"].startswith("configuration reload refused: config file "), line
        assert "\n" not in line["message"]
        assert (await _transaction(client, "app@a.example", message(key="B-2"))).startswith("250")
        assert (await _transaction(client, "app@b.example", message(key="B-3"))).startswith("550")
    finally:
        await client.close()
    assert (await send(run.relay.port, ["user@example.net"], message(key="B-4"),
                       mail_from="app@a.example")).code == 250
    assert run.relay.metrics_port is not None
    samples = scrape(run.relay.metrics_port)
    reloads = {s[0]["result"]: s[1] for s in samples["relay_config_reloads_total"]}
    assert reloads == {"applied": 0.0, "refused": 1.0, "partial": 0.0}
    assert samples["relay_config_last_reload_timestamp_seconds"][0][1] == 0.0


def _peer_cert(port: int, *, starttls: bool) -> bytes:
    """The DER certificate the relay serves on a new connection: STARTTLS on the SMTP port,
    or the implicit-TLS port's handshake."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # compared with the expected certificate below
    client: smtplib.SMTP
    if starttls:
        client = smtplib.SMTP("127.0.0.1", port, timeout=10)
        client.ehlo("client.test")
        client.starttls(context=context)
    else:
        client = smtplib.SMTP_SSL("127.0.0.1", port, timeout=10, context=context)
    try:
        sock = client.sock
        assert isinstance(sock, ssl.SSLSocket)
        der = sock.getpeercert(binary_form=True)
        assert der is not None
        return der
    finally:
        client.quit()


def _der(cert_file: Path) -> bytes:
    """The DER form of the first certificate of a PEM chain file."""
    text = cert_file.read_text()
    end = text.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")
    return ssl.PEM_cert_to_DER_cert(text[:end])


@TWO_WORKERS
async def test_a_rotated_certificate_is_served_to_the_next_handshake(
        configured: Start, tmp_path: Path, workers: int) -> None:
    """Start with certificate A, replace the files with B, SIGHUP: every new STARTTLS and
    implicit-TLS handshake (several, so both workers answer some) is served B; a session that
    did STARTTLS before keeps working."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    pki_a, pki_b = make_pki(a), make_pki(b)
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(pki_a.cert, live / "cert.pem")
    shutil.copy(pki_a.key, live / "key.pem")
    run = await configured(workers, tls_cert=str(live / "cert.pem"),
                           tls_key=str(live / "key.pem"), tls_listen="127.0.0.1:0")
    assert run.tls_port
    port = run.relay.port
    assert await asyncio.to_thread(_peer_cert, port, starttls=True) == _der(pki_a.cert)
    assert await asyncio.to_thread(_peer_cert, run.tls_port, starttls=False) == _der(pki_a.cert)
    before = await RawClient.connect(port)
    assert (await before.cmd("EHLO client.test")).startswith("250")
    assert (await before.cmd("STARTTLS")).startswith("220")
    await before.writer.start_tls(pki_a.client_context, server_hostname="relay.test")
    shutil.copy(pki_b.cert, live / "cert.pem")
    shutil.copy(pki_b.key, live / "key.pem")
    run.hangup()
    line = await run.reloaded()
    assert line["message"] == ("configuration reloaded: applied tls_cert, tls_key; needs a "
                               "restart: none"), line
    for _ in range(4):
        assert await asyncio.to_thread(_peer_cert, port, starttls=True) == _der(pki_b.cert)
        assert await asyncio.to_thread(_peer_cert, run.tls_port, starttls=False) == \
            _der(pki_b.cert)
    try:
        assert (await before.cmd("EHLO client.test")).startswith("250")
        assert (await _transaction(before, "app@example.com", message(key="T-1"))).startswith(
            "250")
    finally:
        await before.close()


async def test_a_certificate_that_does_not_match_its_key_is_refused(
        configured: Start, tmp_path: Path) -> None:
    """The new certificate with the old key: refused (the pair does not load), the old
    certificate is still served."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    pki_a, pki_b = make_pki(a), make_pki(b)
    run = await configured(2, tls_cert=str(pki_a.cert), tls_key=str(pki_a.key))
    shutil.copy(pki_b.cert, pki_a.cert)
    run.hangup()
    line = await run.reloaded()
    assert line["level"] == "ERROR", line
    assert line["message"].startswith("configuration reload refused: "), line
    assert "tls" in line["message"]
    for _ in range(3):
        assert await asyncio.to_thread(_peer_cert, run.relay.port, starttls=True) != \
            _der(pki_b.cert)


def _cheap_hash(password: str) -> str:
    """A bcrypt hash of cost 4 (the relay's unknown-user dummy copies it: fast tests)."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()


def _login(port: int, user: str, password: str) -> int:
    """AUTH PLAIN over implicit TLS on a new connection; the reply code."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with smtplib.SMTP_SSL("127.0.0.1", port, timeout=10, context=context) as client:
        client.ehlo("client.test")
        try:
            code, _ = client.login(user, password)
        except smtplib.SMTPAuthenticationError as exc:
            return exc.smtp_code
        return code


@TWO_WORKERS
async def test_a_new_user_of_the_auth_file_logs_in_after_sighup(
        configured: Start, tmp_path: Path, workers: int) -> None:
    """A user added to the credentials file (same path) can AUTH once the relay reloaded."""
    pki = make_pki(tmp_path)
    users = tmp_path / "users"
    users.write_text(format_entry("alice", _cheap_hash("alice-pw")) + "\n")
    run = await configured(workers, tls_cert=str(pki.cert), tls_key=str(pki.key),
                           tls_listen="127.0.0.1:0", auth_file=str(users),
                           auth_failure_delay=0)
    assert await asyncio.to_thread(_login, run.tls_port, "alice", "alice-pw") == 235
    assert await asyncio.to_thread(_login, run.tls_port, "bob", "bob-pw") == 535
    with users.open("a") as out:
        out.write(format_entry("bob", _cheap_hash("bob-pw")) + "\n")
    run.hangup()
    line = await run.reloaded()
    assert line["message"] == "configuration reloaded: applied auth_file; needs a restart: none"
    for _ in range(3):  # both workers
        assert await asyncio.to_thread(_login, run.tls_port, "bob", "bob-pw") == 235
    assert await asyncio.to_thread(_login, run.tls_port, "alice", "alice-pw") == 235


@TWO_WORKERS
async def test_log_level_changes_to_debug(configured: Start, workers: int) -> None:
    """log_level INFO -> DEBUG: no DEBUG line before, DEBUG lines after (the next reload's)."""
    run = await configured(workers, log_level="INFO")
    run.hangup()
    assert (await run.reloaded(1))["message"].startswith("configuration reloaded: applied "
                                                         "nothing changed")
    assert not [e for e in run.relay.lines() if e.get("level") == "DEBUG"]
    run.rewrite(log_level="DEBUG")
    run.hangup()
    line = await run.reloaded(2)
    assert line["message"] == "configuration reloaded: applied log_level; needs a restart: none"
    run.hangup()
    await run.reloaded(3)
    debug = [e for e in run.relay.lines() if e.get("level") == "DEBUG"]
    assert debug, run.relay.lines()
    if workers > 1:  # every worker logs its own apply at DEBUG
        assert {e.get("worker") for e in debug if "worker" in e} == {0, 1}


@TWO_WORKERS
async def test_a_changed_listen_address_needs_a_restart(tmp_path: Path, sink: Sink,
                                                        workers: int) -> None:
    """listen (and workers) changed in the file: named "needs a restart" in the reload line,
    left as they are: the old port still serves, nothing listens on the new one."""
    old_port, new_port = free_port(), free_port()
    prefix = f"test:reload:{uuid.uuid4().hex}:"
    values: dict[str, Any] = {
        "listen": f"127.0.0.1:{old_port}", "upstream": f"127.0.0.1:{sink.port}",
        "store": REDIS_URL, "store_prefix": prefix, "metrics_listen": "off",
        "settle_journal": str(tmp_path / "owed.jsonl"), "workers": workers,
        "log_format": "json", "allowed_senders": ["*@a.example"]}
    path = tmp_path / "relay.toml"
    path.write_text(_toml(values))
    relay = _spawn_serve(tmp_path, ["--config", str(path)], None, workers)
    run = Configured(relay=relay, path=path, values=values)
    try:
        await until(lambda: len(relay.listening()) >= workers or relay.proc.poll() is not None,
                    30, "the relay's start")
        run.rewrite(listen=f"127.0.0.1:{new_port}", workers=workers + 1,
                    allowed_senders=["*@b.example"])
        run.hangup()
        line = await run.reloaded()
        assert line["message"] == ("configuration reloaded: applied allowed_senders; needs a "
                                   "restart: listen, workers"), line
        result = await send(old_port, ["user@example.net"], message(key="L-1"),
                            mail_from="app@b.example")
        assert result.code == 250
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", new_port)
        assert len(relay.listening()) == workers  # no worker restarted or added
    finally:
        await asyncio.to_thread(relay.stop)
        delete_prefix(REDIS_URL, prefix)


@ONE_PROCESS
async def test_duplicate_reply_switches_to_550_on_an_open_connection(
        configured: Start, sink: Sink, workers: int) -> None:
    """duplicate_reply "250" -> "550" by SIGHUP: on a connection opened before, the next
    duplicate is answered 550 5.7.1 instead of 250 (still not delivered again)."""
    run = await configured(workers, duplicate_reply="250")
    client = await RawClient.connect(run.relay.port)
    try:
        assert (await client.cmd("EHLO client.test")).startswith("250")
        data = message(key="D-1")
        assert (await _transaction(client, "app@example.com", data)).startswith("250")
        assert (await _transaction(client, "app@example.com", data)).startswith("250")
        run.rewrite(duplicate_reply="550")
        run.hangup()
        line = await run.reloaded()
        assert line["message"] == ("configuration reloaded: applied duplicate_reply; needs a "
                                   "restart: none"), line
        assert (await _transaction(client, "app@example.com", data)).startswith("550 5.7.1")
        assert (await _transaction(client, "app@example.com", message(key="D-2"))).startswith(
            "250")
    finally:
        await client.close()
    assert sink.handler.copies_to("user@example.net") == 2


@ONE_PROCESS
async def test_a_fingerprint_setting_never_changes_live(configured: Start, sink: Sink,
                                                        workers: int) -> None:
    """store_prefix and dedupe_headers changed in the file: named "needs a restart", and a
    copy of a message sent before the reload is still suppressed (the key derivation kept)."""
    run = await configured(workers)
    data = message(key="F-1")
    assert (await send(run.relay.port, ["user@example.net"], data)).code == 250
    run.rewrite(store_prefix=f"test:reload:{uuid.uuid4().hex}:",
                dedupe_headers=["X-Other-Key"], dedup_window=7200)
    run.hangup()
    line = await run.reloaded()
    assert line["message"] == ("configuration reloaded: applied dedup_window; needs a "
                               "restart: store_prefix, dedupe_headers"), line
    assert (await send(run.relay.port, ["user@example.net"], data)).code == 250
    assert sink.handler.copies_to("user@example.net") == 1


@WORKERS
async def test_two_quick_sighups_reload_one_after_the_other(configured: Start,
                                                           workers: int) -> None:
    """Two SIGHUPs at once: two complete reloads, logged one after the other."""
    run = await configured(workers, allowed_senders=["*@a.example"])
    run.rewrite(allowed_senders=["*@b.example"])
    run.hangup()
    run.hangup()
    first = await run.reloaded(1)
    assert first["message"] == ("configuration reloaded: applied allowed_senders; needs a "
                                "restart: none")
    # the second SIGHUP's reload (if the kernel did not merge the two) runs right after the
    # first: let it end before the file changes again (a reload takes well under a second)
    await asyncio.sleep(1.5)
    settled = len(run.reloads())
    run.rewrite(allowed_senders=["*@c.example"])  # a marker: logged after the reloads before
    run.hangup()
    await until(lambda: len(run.reloads()) > settled and "applied allowed_senders" in
                run.reloads()[-1]["message"], 15,
                "the marker reload")
    between = run.reloads()[1:settled]
    # the kernel may merge two pending SIGHUPs into one; a second reload found nothing new
    assert all(e["message"].startswith("configuration reloaded: applied nothing changed")
               for e in between), between


async def test_sighup_during_start_up_is_applied_once_the_relay_serves(tmp_path: Path) -> None:
    """SIGHUP while worker 0 starts (a sitecustomize holds it 1.5 s before the relay's imports):
    nothing ends; the relay serves with both workers, then reloads the file once."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import os, time\nif 'DEDUP_RELAY_WORKER' in os.environ:\n    time.sleep(1.5)\n")
    path = tmp_path / "relay.toml"
    path.write_text(_toml({"upstream": "maildir:md", "store": "sqlite:///dedup.db",
                           "metrics_listen": "off", "allowed_senders": ["*@a.example"]}))
    relay = _spawn_serve(tmp_path, [
        "--workers", "2", "--listen", "127.0.0.1:0", "--config", str(path),
        "--log-format", "json"],
        {"PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")])}, 2)
    run = Configured(relay=relay, path=path, values={})
    try:
        await until(lambda: relay.proc.poll() is not None or bool(relay.children()), 30)
        path.write_text(path.read_text().replace("a.example", "b.example"))
        relay.proc.send_signal(signal.SIGHUP)
        await until(lambda: len(relay.listening()) >= 2 or relay.proc.poll() is not None, 30)
        line = await run.reloaded()
        assert line["message"] == ("configuration reloaded: applied allowed_senders; needs a "
                                   "restart: none"), line
        assert relay.proc.poll() is None
    finally:
        code = relay.stop()
    assert code == 0, relay.log_path.read_text()


async def test_dedup_relay_reload_signals_the_pid_file_s_process(
        configured: Start, tmp_path: Path) -> None:
    """`dedup-relay reload --config F` reads pid_file from the relay's settings and sends
    SIGHUP to the supervisor it names; the relay reloads; the file goes at exit."""
    pid_file = tmp_path / "relay.pid"
    run = await configured(2, pid_file=str(pid_file), allowed_senders=["*@a.example"])
    assert pid_file.read_text().strip() == str(run.relay.proc.pid)
    run.rewrite(allowed_senders=["*@b.example"])
    result = await asyncio.to_thread(run_cli, "reload", "--config", str(run.path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (f"sent SIGHUP to {run.relay.proc.pid}; the relay logs "
                                     "whether it applied the configuration")
    line = await run.reloaded()
    assert line["message"].startswith("configuration reloaded: applied allowed_senders")
    by_env = await asyncio.to_thread(run_cli, "reload", cwd=tmp_path,
                                     env={"RELAY_PID_FILE": str(pid_file)})
    assert by_env.returncode == 0, by_env.stderr
    await run.reloaded(2)
    assert await asyncio.to_thread(run.relay.stop) == 0
    assert not pid_file.exists()
    gone = await asyncio.to_thread(run_cli, "reload", "--pid-file", str(pid_file), cwd=tmp_path)
    assert gone.returncode == 1
    assert "no pid file" in gone.stderr


def test_dedup_relay_reload_refuses_what_is_no_relay(tmp_path: Path) -> None:
    """No pid given (2); a pid file naming a process that is gone (1) or that is no
    dedup-relay (1): a clear message each, and no signal sent."""
    none = run_cli("reload", cwd=tmp_path)
    assert none.returncode == 2
    assert "give --pid PID, or the relay's pid_file" in none.stderr
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pid_file = tmp_path / "other.pid"
        pid_file.write_text(f"{other.pid}\n")
        foreign = run_cli("reload", "--pid-file", str(pid_file), cwd=tmp_path)
        assert foreign.returncode == 1
        assert "not a dedup-relay process" in foreign.stderr
        assert other.poll() is None  # not signalled (SIGHUP would have ended it)
    finally:
        other.kill()
        other.wait()
    stale = run_cli("reload", "--pid", str(other.pid), cwd=tmp_path)
    assert stale.returncode == 1
    assert "no such process" in stale.stderr


@TWO_WORKERS
async def test_allowed_networks_apply_to_the_next_connection(configured: Start,
                                                             workers: int) -> None:
    """allowed_networks without loopback: a new connection is refused (421); after SIGHUP
    with loopback added, new connections are greeted."""
    run = await configured(workers, allowed_networks=["192.0.2.0/24"])
    reader, writer = await asyncio.open_connection("127.0.0.1", run.relay.port)
    try:
        assert (await asyncio.wait_for(reader.readline(), 10)).startswith(b"421 4.7.0")
    finally:
        writer.close()
    run.rewrite(allowed_networks=["192.0.2.0/24", "127.0.0.0/8"])
    run.hangup()
    line = await run.reloaded()
    assert line["message"] == ("configuration reloaded: applied allowed_networks; needs a "
                               "restart: none"), line
    for _ in range(4):
        result = await send(run.relay.port, ["user@example.net"], message(key="N-1"))
        assert result.code == 250


def _settings(**values: Any) -> Settings:
    return Settings(**{"upstream": "maildir:md", **values})


def test_what_cannot_change_live(tmp_path: Path) -> None:
    """TLS or AUTH switched on or off needs a restart (the listeners offer STARTTLS and AUTH
    as they started); a certificate replaced at the same path is applied; a secret file with
    a new content is named, never applied."""
    pki = make_pki(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text("one")
    plain = _settings(fingerprint_secret_file=secret)
    with_tls = _settings(fingerprint_secret_file=secret, tls_cert=pki.cert, tls_key=pki.key)
    before = file_digests(plain)
    switched = compare(plain, with_tls, before, file_digests(with_tls))
    assert (switched.applied, switched.restart) == ((), ("tls_cert", "tls_key"))
    assert switched.merged.tls_cert is None
    tls_digests = file_digests(with_tls)
    pki.cert.write_text(pki.cert.read_text() + "\n")  # the same path, a new content
    secret.write_text("two")
    rotated = compare(with_tls, with_tls, tls_digests, file_digests(with_tls))
    assert rotated.applied == ("tls_cert",)
    assert rotated.restart == ("fingerprint_secret_file",)
    assert rotated.describe() == ("applied tls_cert; needs a restart: "
                                  "fingerprint_secret_file")


def test_upstream_secrets_and_certificates_replaced_in_place_are_named(tmp_path: Path) -> None:
    """The smarthost's CA bundle, client certificate and key, and the OAuth2 client secret and
    CA are read once at start: one replaced at its path is named "needs a restart", not
    ignored. The refresh token's file is not: the relay itself writes a rotated token there
    (relay.upstream.oauth.FormGrant), which is no change of configuration."""
    pki = make_pki(tmp_path)
    secret, refresh = tmp_path / "client-secret", tmp_path / "refresh-token"
    secret.write_text("s1")
    refresh.write_text("r1")
    running = _settings(
        upstream="127.0.0.1:2525", upstream_ca_file=pki.ca_file, upstream_client_cert=pki.cert,
        upstream_client_key=pki.key, upstream_auth="xoauth2", upstream_user="relay@example.com",
        oauth_token_url="https://127.0.0.1:8443/token", oauth_client_id="relay",
        oauth_client_secret_file=secret, oauth_refresh_token_file=refresh,
        oauth_ca_file=pki.ca_file)
    before = file_digests(running)
    for path in (pki.ca_file, pki.cert, pki.key):
        path.write_text(path.read_text() + "\n")
    secret.write_text("s2")
    refresh.write_text("r2")
    changed = compare(running, running, before, file_digests(running))
    assert changed.applied == ()
    assert set(changed.restart) == {
        "upstream_ca_file", "upstream_client_cert", "upstream_client_key",
        "oauth_client_secret_file", "oauth_ca_file"}


@WORKERS
async def test_a_reload_leaves_the_sqlite_locks_so_another_process_keeps_the_wal(
        configured: Start, sink: Sink, tmp_path: Path, workers: int) -> None:
    """A reload must not open the SQLite file the relay has open: closing that descriptor
    drops every POSIX lock the process holds on the file, and the next process to close its
    own connection (`stats`, `inspect`) then deletes the live WAL: what the relay wrote after
    is invisible to others and lost at its next crash (a duplicate then)."""
    db = tmp_path / "store.db"
    url = f"sqlite:///{db}"
    run = await configured(workers, store=url)
    run.hangup()
    await run.reloaded()
    assert run_cli("stats", "--json", "--config", str(run.path), cwd=tmp_path).returncode == 0
    assert db.with_name(db.name + "-wal").exists(), "the live WAL was deleted"
    assert (await send(run.relay.port, ["user@example.net"], message(key="after-reload"))).code \
        == 250
    seen = run_cli("inspect", "--config", str(run.path), "--rcpt", "user@example.net",
                   "--template", "welcome", "--key", "after-reload", cwd=tmp_path)
    assert seen.returncode == 0 and json.loads(seen.stdout)["state"] == "sent", seen


async def test_a_worker_applies_what_its_supervisor_read_not_the_file_as_it_is_now(
        configured: Start, sink: Sink) -> None:
    """The file changed after the supervisor's last reading (a second write, a ConfigMap swap):
    a SIGHUP that reaches a worker applies its supervisor's checked reading, never the file
    itself, so workers cannot split from each other and from what the supervisor logged and
    counted. The supervisor's own reload then applies the file to all."""
    run = await configured(2, duplicate_reply="250")
    data = message(key="split-1")
    assert (await send(run.relay.port, ["user@example.net"], data)).code == 250
    run.rewrite(duplicate_reply="550")
    for pid in run.relay.worker_pids().values():
        os.kill(pid, signal.SIGHUP)
    await until(lambda: sum("new configuration not applied" in str(e.get("message", ""))
                            or "new configuration applied" in str(e.get("message", ""))
                            for e in run.relay.lines()) >= 2
                or run.relay.proc.poll() is not None, 15, "the workers' apply")
    for _ in range(4):  # new connections: both workers answer
        assert (await send(run.relay.port, ["user@example.net"], data)).code == 250
    run.hangup()
    line = await run.reloaded()
    assert line["message"].startswith("configuration reloaded: applied duplicate_reply"), line
    for _ in range(4):
        assert (await send(run.relay.port, ["user@example.net"], data)).code == 550
