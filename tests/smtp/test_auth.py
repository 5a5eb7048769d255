"""Inbound AUTH: the credentials file, and SASL PLAIN/LOGIN on the wire (RFC 4954, RFC 4616).

Wire tests serve RelaySMTP with a handler that exposes only the SASL mechanisms, on port 0 in
the test's own loop, and talk to it byte for byte with RawClient.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import argon2
import bcrypt
import pytest
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, Session
from prometheus_client import CollectorRegistry

from relay.core import replies
from relay.core.errors import ConfigError
from relay.credentials import Attempts, CredentialFile, VerifiedCache, format_entry, hash_password
from relay.credentials import users as users_file
from relay.ops.metrics import PrometheusMetrics
from relay.smtp.access import ConnectionGate, parse_networks
from relay.smtp.auth import SaslMechanisms
from relay.smtp.session import RelaySMTP
from tests.support.clients import RawClient
from tests.support.waiting import until

USER = "user@example.com"
PASSWORD = "pass"
BCRYPT_USER = "bcrypt@example.com"


def b64(data: bytes | str) -> str:
    """Base64 of ``data`` (str as UTF-8), as a client sends it."""
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


PLAIN_OK = b64(f"\0{USER}\0{PASSWORD}")  # AHVzZXJAZXhhbXBsZS5jb20AcGFzcw==
PLAIN_WRONG = b64(f"\0{USER}\0wrong")
PLAIN_UNKNOWN_USER = b64(f"\0nobody@example.com\0{PASSWORD}")
PLAIN_EMPTY_PASSWORD = b64(f"\0{USER}\0")
PLAIN_ONE_NUL = b64(f"{USER}\0{PASSWORD}")
PLAIN_NOT_UTF8 = b64(b"\0user@example.com\0p\xffss")


# ------------------------------------------------------------------------------------------
# credentials
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hashes:
    """Cheap hashes of PASSWORD (low cost, so that the wire tests stay fast)."""

    argon2: str
    bcrypt: str


@pytest.fixture(scope="module")
def hashes() -> Hashes:
    """An argon2id (t=1, m=1 MiB, p=1) and a bcrypt (cost 4) hash of PASSWORD."""
    cheap_argon2 = argon2.PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1)
    return Hashes(argon2=cheap_argon2.hash(PASSWORD),
                  bcrypt=bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode())


@pytest.fixture
def cred_path(tmp_path: Path, hashes: Hashes) -> Path:
    """A credentials file with USER (argon2) and BCRYPT_USER (bcrypt), both password PASSWORD."""
    path = tmp_path / "users"
    path.write_text(
        "# dedup-relay users\n\n"
        f"{format_entry(USER, hashes.argon2)}\n"
        f"{format_entry(BCRYPT_USER, hashes.bcrypt)}\n",
        encoding="utf-8")
    return path


@pytest.fixture
def credentials(cred_path: Path) -> CredentialFile:
    """The loaded credentials file of ``cred_path``."""
    return CredentialFile.load(cred_path)


@pytest.mark.parametrize(("scheme", "prefix"), [("argon2", "$argon2id$"), ("bcrypt", "$2b$")])
async def test_hash_password_entry_verifies(tmp_path: Path, scheme: Any, prefix: str) -> None:
    """hash_password makes argon2id (default) or bcrypt hashes that a loaded file verifies."""
    password_hash = hash_password(PASSWORD, scheme=scheme)
    assert password_hash.startswith(prefix)
    path = tmp_path / "users"
    path.write_text(format_entry(USER, password_hash) + "\n", encoding="utf-8")
    credentials = CredentialFile.load(path)
    assert await credentials.verify(USER, PASSWORD)
    assert not await credentials.verify(USER, "wrong")


@pytest.mark.parametrize(("password", "scheme"), [
    ("", "argon2"), ("", "bcrypt"), ("é" * 37, "bcrypt"), ("pass", "md5")])
def test_hash_password_refuses_unusable_input(password: str, scheme: Any) -> None:
    """hash_password refuses an empty password, >72 bytes for bcrypt, and unknown schemes."""
    with pytest.raises(ValueError):
        hash_password(password, scheme=scheme)


def test_format_entry_joins_user_and_hash(hashes: Hashes) -> None:
    """format_entry gives the one-line ``username:hash`` form that load() reads."""
    assert format_entry(USER, hashes.argon2) == f"{USER}:{hashes.argon2}"


@pytest.mark.parametrize("username", [
    "", "a:b", "a b", "a\tb", "a\x00b", "a\x7fb", "a\u2028b", "#admin"])
def test_format_entry_refuses_bad_usernames(username: str, hashes: Hashes) -> None:
    """A username that is empty, a comment, or holds ':', whitespace or controls is refused."""
    with pytest.raises(ValueError, match="username"):
        format_entry(username, hashes.argon2)


def test_format_entry_refuses_unknown_hash_without_echoing_it() -> None:
    """A hash that is neither bcrypt nor argon2 is refused, and the message does not quote it."""
    with pytest.raises(ValueError, match="neither bcrypt") as info:
        format_entry(USER, "$1$saltsalt$md5cryptvalue")
    assert "md5cryptvalue" not in str(info.value)


async def test_argon2_entry_verifies(credentials: CredentialFile) -> None:
    """A user with an argon2 hash is accepted with the right password."""
    assert await credentials.verify(USER, PASSWORD)


async def test_bcrypt_entry_verifies(credentials: CredentialFile) -> None:
    """A user with a bcrypt hash is accepted with the right password."""
    assert await credentials.verify(BCRYPT_USER, PASSWORD)


@pytest.mark.parametrize("prefix", ["$2a$", "$2y$"])
async def test_bcrypt_variant_prefixes_verify(tmp_path: Path, hashes: Hashes,
                                              prefix: str) -> None:
    """bcrypt hashes written as $2a$ or $2y$ (htpasswd, PHP) load and verify."""
    path = tmp_path / "users"
    path.write_text(f"{USER}:{prefix}{hashes.bcrypt[4:]}\n", encoding="utf-8")
    assert await CredentialFile.load(path).verify(USER, PASSWORD)


@pytest.mark.parametrize("user", [USER, BCRYPT_USER])
async def test_wrong_password_fails(credentials: CredentialFile, user: str) -> None:
    """A wrong password is refused for argon2 and bcrypt users alike."""
    assert not await credentials.verify(user, "wrong")


async def test_username_is_compared_exactly(credentials: CredentialFile) -> None:
    """The username match is exact: another case or a trailing blank is a different user."""
    assert not await credentials.verify("User@example.com", PASSWORD)
    assert not await credentials.verify(USER + " ", PASSWORD)


async def test_unknown_user_still_runs_a_hash_check(credentials: CredentialFile,
                                                    hashes: Hashes,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown user is checked against a dummy hash, so it costs a real verification."""
    checked: list[str] = []
    real = users_file._check_hash

    def spy(entry: Any, secret: bytes) -> bool:
        checked.append(entry.password_hash)
        return real(entry, secret)

    monkeypatch.setattr(users_file, "_check_hash", spy)
    assert not await credentials.verify("nobody@example.com", PASSWORD)
    assert len(checked) == 1
    assert checked[0] not in (hashes.argon2, hashes.bcrypt)
    # the dummy costs what the file's first entry costs
    assert checked[0].startswith("$argon2id$v=19$m=1024,t=1,p=1$")


async def test_hash_check_runs_off_the_event_loop_thread(
        credentials: CredentialFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocking hash check runs in a worker thread, never in the event loop's thread."""
    threads: list[threading.Thread] = []
    real = users_file._check_hash

    def spy(entry: Any, secret: bytes) -> bool:
        threads.append(threading.current_thread())
        return real(entry, secret)

    monkeypatch.setattr(users_file, "_check_hash", spy)
    assert await credentials.verify(USER, PASSWORD)
    assert threads and threads[0] is not threading.main_thread()


async def test_bcrypt_password_over_72_bytes_is_refused(tmp_path: Path) -> None:
    """A bcrypt user's password longer than 72 bytes never matches, even on a 72-byte prefix."""
    long_password = "x" * 72
    path = tmp_path / "users"
    password_hash = bcrypt.hashpw(long_password.encode(), bcrypt.gensalt(4)).decode()
    path.write_text(format_entry(USER, password_hash) + "\n", encoding="utf-8")
    credentials = CredentialFile.load(path)
    assert await credentials.verify(USER, long_password)
    assert not await credentials.verify(USER, long_password + "y")


async def test_load_skips_comments_and_blank_lines(tmp_path: Path, hashes: Hashes) -> None:
    """Blank lines, '#' comments, surrounding blanks and CRLF line ends are accepted."""
    path = tmp_path / "users"
    path.write_text(f"# users\r\n\r\n   \r\n  {USER}:{hashes.argon2}  \r\n# end\r\n",
                    encoding="utf-8")
    credentials = CredentialFile.load(path)
    assert len(credentials) == 1
    assert await credentials.verify(USER, PASSWORD)


@pytest.mark.parametrize(("line", "reason"), [
    ("no-colon-here-SECRETTEXT", "expected username:hash"),
    ("alice:$1$salt$SECRETTEXT", "neither bcrypt"),
    ("alice:SECRETTEXT", "neither bcrypt"),
    ("alice:$2b$12$SECRETTEXT", "bcrypt hash is malformed"),
    ("alice:$argon2id$SECRETTEXT", "argon2 hash is malformed"),
    ("al ice:$argon2id$SECRETTEXT", "username"),
    (":$argon2id$SECRETTEXT", "username"),
])
def test_load_rejects_a_bad_line_by_number(tmp_path: Path, hashes: Hashes, line: str,
                                           reason: str) -> None:
    """A malformed line raises ConfigError naming the file and line, never quoting the hash."""
    path = tmp_path / "users"
    path.write_text(f"# users\n{USER}:{hashes.argon2}\n{line}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=reason) as info:
        CredentialFile.load(path)
    assert f"{path}, line 3:" in str(info.value)
    assert "SECRETTEXT" not in str(info.value)


def test_load_rejects_a_duplicate_user(tmp_path: Path, hashes: Hashes) -> None:
    """A user listed twice raises ConfigError naming both lines, without either hash."""
    path = tmp_path / "users"
    path.write_text(f"{USER}:{hashes.argon2}\n\n{USER}:{hashes.bcrypt}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="duplicate user") as info:
        CredentialFile.load(path)
    message = str(info.value)
    assert f"{path}, line 3:" in message
    assert "first on line 1" in message
    assert hashes.argon2 not in message
    assert hashes.bcrypt not in message


@pytest.mark.parametrize(("content", "reason"), [
    (b"# nobody yet\n", "defines no user"),
    (b"user:\xff\xfe\n", "not UTF-8"),
])
def test_load_rejects_an_unusable_file(tmp_path: Path, content: bytes, reason: str) -> None:
    """A file with no user, or that is not UTF-8, raises ConfigError naming the file."""
    path = tmp_path / "users"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=reason) as info:
        CredentialFile.load(path)
    assert str(path) in str(info.value)


def test_load_of_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    """A missing credentials file raises ConfigError naming it."""
    path = tmp_path / "absent"
    with pytest.raises(ConfigError, match="cannot read") as info:
        CredentialFile.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("kwargs", [{"failure_delay_s": -1.0}, {"max_failures": 0}])
def test_sasl_refuses_nonsense_limits(credentials: CredentialFile,
                                      kwargs: dict[str, Any]) -> None:
    """A negative failure delay or a max_failures below 1 is a ValueError."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SaslMechanisms(credentials=credentials, **kwargs)


# ------------------------------------------------------------------------------------------
# wire
# ------------------------------------------------------------------------------------------


class AuthOnlyHandler:
    """An aiosmtpd handler offering only the relay's SASL mechanisms (and metrics)."""

    def __init__(self, sasl: SaslMechanisms) -> None:
        self.sasl = sasl
        self.metrics = PrometheusMetrics(registry=CollectorRegistry())
        self.sessions: set[SMTP] = set()  # RelaySMTP registers itself here
        self.servers: list[SMTP] = []

    async def auth_PLAIN(self, server: SMTP, args: list[str]) -> AuthResult:
        self.servers.append(server)
        return await self.sasl.auth_PLAIN(server, args)

    async def auth_LOGIN(self, server: SMTP, args: list[str]) -> AuthResult:
        self.servers.append(server)
        return await self.sasl.auth_LOGIN(server, args)

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        return "250 OK"  # aiosmtpd's answer without the hook; no test here sends a message


@dataclass
class AuthServer:
    """A running RelaySMTP with SASL: ``port``, and ``failures`` counted by on_failure."""

    port: int
    handler: AuthOnlyHandler
    failures: list[None] = field(default_factory=list)
    refused: list[None] = field(default_factory=list)

    async def client(self) -> RawClient:
        """A connected client that has sent EHLO."""
        client = await RawClient.connect(self.port)
        await client.cmd("EHLO client.test")
        return client


StartServer = Callable[..., Awaitable[AuthServer]]


@pytest.fixture
async def start_server(credentials: CredentialFile) -> AsyncIterator[StartServer]:
    """Factory: ``await start_server(**SaslMechanisms kwargs)``; no failure delay by default."""
    servers: list[asyncio.Server] = []

    async def start(**kwargs: Any) -> AuthServer:
        failures: list[None] = []
        refused: list[None] = []
        sasl = SaslMechanisms(credentials=credentials, on_failure=lambda: failures.append(None),
                              on_refused=lambda: refused.append(None),
                              **{"failure_delay_s": 0.0, **kwargs})
        handler = AuthOnlyHandler(sasl)
        gate = ConnectionGate(allowed=parse_networks(["127.0.0.0/8"]), max_total=50,
                              max_per_ip=50)
        server = await asyncio.get_running_loop().create_server(
            lambda: RelaySMTP(handler, metrics=handler.metrics, sessions=handler.sessions,
                              processing_timeout_s=60, gate=gate, hostname="auth.test",
                              auth_require_tls=False, decode_data=False,
                              enable_SMTPUTF8=True),
            "127.0.0.1", 0)
        servers.append(server)
        return AuthServer(server.sockets[0].getsockname()[1], handler, failures, refused)

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def auth_server(start_server: StartServer) -> AuthServer:
    """A server with the default limits and no failure delay."""
    return await start_server()


@pytest.fixture
async def client(auth_server: AuthServer) -> AsyncIterator[RawClient]:
    """A client of ``auth_server`` after EHLO; closed at the end of the test."""
    c = await auth_server.client()
    yield c
    await c.close()


async def test_ehlo_advertises_login_and_plain(auth_server: AuthServer) -> None:
    """EHLO advertises AUTH LOGIN PLAIN (over plain TCP only because the test allows it)."""
    c = await RawClient.connect(auth_server.port)
    assert "250-AUTH LOGIN PLAIN" in (await c.cmd("EHLO client.test")).split("\n")
    await c.close()


async def test_login_with_initial_username(client: RawClient,
                                           auth_server: AuthServer) -> None:
    """A: AUTH LOGIN <b64 user> is answered 334 Password: and then 235 2.7.0."""
    assert await client.cmd(f"AUTH LOGIN {b64(USER)}") == "334 UGFzc3dvcmQ6"
    assert await client.cmd(b64(PASSWORD)) == str(replies.AUTH_SUCCEEDED)
    assert auth_server.failures == []


async def test_login_challenges_are_exact_prompts(client: RawClient) -> None:
    """B: bare AUTH LOGIN prompts base64 'Username:' then 'Password:' (no NUL), then 235."""
    challenge = await client.cmd("AUTH LOGIN")
    assert challenge == "334 VXNlcm5hbWU6"
    assert base64.b64decode(challenge[4:]) == b"Username:"
    challenge = await client.cmd(b64(USER))
    assert challenge == "334 UGFzc3dvcmQ6"
    assert base64.b64decode(challenge[4:]) == b"Password:"
    assert await client.cmd(b64(PASSWORD)) == str(replies.AUTH_SUCCEEDED)


async def test_plain_without_initial_response_gets_empty_challenge(client: RawClient) -> None:
    """C: bare AUTH PLAIN is answered '334 ' (code and space) and then accepts the response."""
    assert await client.cmd("AUTH PLAIN") == "334 "
    assert await client.cmd(PLAIN_OK) == str(replies.AUTH_SUCCEEDED)


async def test_plain_with_initial_response(client: RawClient, auth_server: AuthServer) -> None:
    """D: AUTH PLAIN <b64> is answered 235 and the session holds the username."""
    assert PLAIN_OK == "AHVzZXJAZXhhbXBsZS5jb20AcGFzcw=="
    assert await client.cmd(f"AUTH PLAIN {PLAIN_OK}") == str(replies.AUTH_SUCCEEDED)
    session = auth_server.handler.servers[0].session
    assert session is not None
    assert session.authenticated
    assert session.auth_data == USER


@pytest.mark.parametrize("mechanism", ["plain", "Plain"])
async def test_mechanism_name_is_matched_without_case(client: RawClient, mechanism: str) -> None:
    """AUTH plain works like AUTH PLAIN (RFC 4422 3.1 names; lower-case clients exist)."""
    assert await client.cmd(f"AUTH {mechanism} {PLAIN_OK}") == str(replies.AUTH_SUCCEEDED)


async def test_login_mechanism_in_lower_case_gets_the_username_prompt(client: RawClient) -> None:
    """AUTH login starts the LOGIN exchange (334 VXNlcm5hbWU6, 'Username:')."""
    assert await client.cmd("AUTH login") == "334 VXNlcm5hbWU6"


async def test_plain_authzid_equal_to_authcid_is_accepted(client: RawClient) -> None:
    """An authzid equal to the authcid is accepted (RFC 4616: acting as oneself)."""
    blob = b64(f"{USER}\0{USER}\0{PASSWORD}")
    assert await client.cmd(f"AUTH PLAIN {blob}") == str(replies.AUTH_SUCCEEDED)


async def test_bcrypt_user_authenticates_on_the_wire(client: RawClient) -> None:
    """A bcrypt user authenticates with AUTH PLAIN like an argon2 one."""
    blob = b64(f"\0{BCRYPT_USER}\0{PASSWORD}")
    assert await client.cmd(f"AUTH PLAIN {blob}") == str(replies.AUTH_SUCCEEDED)


@pytest.mark.parametrize("command", ["AUTH LOGIN", "AUTH PLAIN"])
async def test_star_cancels_the_exchange(client: RawClient, auth_server: AuthServer,
                                         command: str) -> None:
    """E: '*' in answer to a challenge cancels with 501 5.7.0 and is not a failure."""
    assert (await client.cmd(command)).startswith("334 ")
    reply = await client.cmd("*")
    assert reply == str(replies.AUTH_CANCELLED)
    assert reply.startswith("501 5.7.0")
    assert auth_server.failures == []


@pytest.mark.parametrize("steps", [
    ["AUTH PLAIN !!notbase64!!"],
    ["AUTH LOGIN !!notbase64!!"],
    ["AUTH PLAIN", "!!notbase64!!"],
    ["AUTH LOGIN", b64(USER), "!!notbase64!!"],
])
async def test_bad_base64_is_501(client: RawClient, auth_server: AuthServer,
                                 steps: list[str]) -> None:
    """F: undecodable base64, on the AUTH line or as a response, is 501 5.5.2, not a failure."""
    for step in steps[:-1]:
        assert (await client.cmd(step)).startswith("334 ")
    reply = await client.cmd(steps[-1])
    assert reply == str(replies.AUTH_BAD_BASE64)
    assert reply.startswith("501 5.5.2")
    assert auth_server.failures == []


async def test_plain_lone_equals_is_empty_and_invalid(client: RawClient,
                                                      auth_server: AuthServer) -> None:
    """G: AUTH PLAIN = is an empty initial response (RFC 4954), refused 535 5.7.8."""
    reply = await client.cmd("AUTH PLAIN =")
    assert reply == str(replies.AUTH_FAILED)
    assert reply.startswith("535 5.7.8")
    assert auth_server.failures == [None]


@pytest.mark.parametrize("steps", [
    [f"AUTH PLAIN {PLAIN_WRONG}"],
    ["AUTH LOGIN", b64(USER), b64("wrong")],
    [f"AUTH PLAIN {PLAIN_UNKNOWN_USER}"],
    [f"AUTH PLAIN {PLAIN_EMPTY_PASSWORD}"],
    [f"AUTH PLAIN {PLAIN_ONE_NUL}"],
    [f"AUTH PLAIN {PLAIN_NOT_UTF8}"],
])
async def test_invalid_credentials_are_535(client: RawClient, auth_server: AuthServer,
                                           steps: list[str]) -> None:
    """Wrong password, unknown user, empty password, no authzid NUL or non-UTF-8 is 535 5.7.8."""
    for step in steps[:-1]:
        assert (await client.cmd(step)).startswith("334 ")
    assert await client.cmd(steps[-1]) == str(replies.AUTH_FAILED)
    assert auth_server.failures == [None]


async def test_plain_authzid_other_than_authcid_is_refused(client: RawClient,
                                                           auth_server: AuthServer) -> None:
    """An authzid other than the authcid is refused 535 even with the right password."""
    blob = b64(f"admin@example.com\0{USER}\0{PASSWORD}")
    assert await client.cmd(f"AUTH PLAIN {blob}") == str(replies.AUTH_FAILED)
    assert auth_server.failures == [None]


async def test_failures_slow_down_then_close_with_421(start_server: StartServer) -> None:
    """Each failure waits delay x failures; the max_failures-th is 421 4.7.0 and closes."""
    server = await start_server(failure_delay_s=0.05, max_failures=3)
    client = await server.client()
    wrong = f"AUTH PLAIN {PLAIN_WRONG}"
    for failures in (1, 2):
        started = time.monotonic()
        assert await client.cmd(wrong) == str(replies.AUTH_FAILED)
        assert time.monotonic() - started >= 0.9 * 0.05 * failures
    started = time.monotonic()
    assert await client.cmd(wrong) == str(replies.AUTH_TOO_MANY_FAILURES)
    assert time.monotonic() - started >= 0.9 * 0.05 * 3
    assert await asyncio.wait_for(client.reader.read(), 5) == b""  # closed by the server
    assert server.failures == [None, None, None]
    await client.close()


async def _client_from(server: AuthServer, local_host: str) -> RawClient:
    """A client of ``server`` from the loopback address ``local_host``, after EHLO."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port,
                                                   local_addr=(local_host, 0))
    client = RawClient(reader, writer)
    await client.reply()
    await client.cmd("EHLO client.test")
    return client


async def test_failure_budget_of_an_address_spans_connections(start_server: StartServer) -> None:
    """Reconnecting does not reset the budget: once an address spent it, even the right
    password from a new connection is 421 4.7.0, unchecked and counted as refused."""
    server = await start_server(max_failures=2)
    wrong = f"AUTH PLAIN {PLAIN_WRONG}"
    first = await server.client()
    assert await first.cmd(wrong) == str(replies.AUTH_FAILED)
    second = await server.client()
    assert await second.cmd(wrong) == str(replies.AUTH_TOO_MANY_FAILURES)
    third = await server.client()
    assert await third.cmd(f"AUTH PLAIN {PLAIN_OK}") == str(replies.AUTH_TOO_MANY_FAILURES)
    assert server.failures == [None, None]
    assert server.refused == [None]
    other = await _client_from(server, "127.0.0.2")  # another address, another user: fine
    blob = b64(f"\0{BCRYPT_USER}\0{PASSWORD}")
    assert await other.cmd(f"AUTH PLAIN {blob}") == str(replies.AUTH_SUCCEEDED)
    for client in (first, second, third, other):
        await client.close()


async def test_guesses_at_a_user_from_other_addresses_do_not_lock_its_owner_out(
        start_server: StartServer) -> None:
    """Failures at one user from many addresses, past max_failures, refuse no one: the right
    password from an address with budget left is accepted (235)."""
    server = await start_server(max_failures=2)
    for host in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
        client = await _client_from(server, host)
        assert await client.cmd(f"AUTH PLAIN {PLAIN_WRONG}") == str(replies.AUTH_FAILED)
        await client.close()
    owner = await _client_from(server, "127.0.0.5")
    assert await owner.cmd(f"AUTH PLAIN {PLAIN_OK}") == str(replies.AUTH_SUCCEEDED)
    assert len(server.failures) == 3
    assert server.refused == []
    await owner.close()


async def test_failures_at_a_user_slow_down_guesses_from_a_fresh_address(
        start_server: StartServer) -> None:
    """A wrong password at a user that failed twice elsewhere waits delay x 3, though its own
    address never failed."""
    server = await start_server(max_failures=5, failure_delay_s=0.2)
    for host in ("127.0.0.2", "127.0.0.3"):
        client = await _client_from(server, host)
        await client.cmd(f"AUTH PLAIN {PLAIN_WRONG}")
        await client.close()
    fresh = await _client_from(server, "127.0.0.4")
    started = time.monotonic()
    assert await fresh.cmd(f"AUTH PLAIN {PLAIN_WRONG}") == str(replies.AUTH_FAILED)
    assert time.monotonic() - started >= 0.9 * 0.2 * 3
    await fresh.close()


async def test_a_guess_whose_client_hangs_up_is_counted(start_server: StartServer) -> None:
    """A client that hangs up before its answer has still spent a guess of the budget."""
    server = await start_server(max_failures=2, failure_delay_s=1.0)
    for _ in range(2):
        client = await server.client()
        await client.write(f"AUTH PLAIN {PLAIN_WRONG}\r\n".encode())
        await asyncio.sleep(0.2)  # the check has started; the answer would come at 1 s
        await client.close()
    client = await server.client()
    assert await client.cmd(f"AUTH PLAIN {PLAIN_OK}") == str(replies.AUTH_TOO_MANY_FAILURES)
    await client.close()


async def test_a_guess_whose_client_hangs_up_is_counted_as_a_failure(
        start_server: StartServer) -> None:
    """A wrong password whose client hangs up before the delayed answer (3 s) is counted by
    on_failure (relay_auth_failures_total) once its check is done, not at the answer."""
    server = await start_server(max_failures=5, failure_delay_s=3.0)
    client = await server.client()
    await client.write(f"AUTH PLAIN {PLAIN_WRONG}\r\n".encode())
    await asyncio.sleep(0.05)
    await client.close()
    await until(lambda: bool(server.failures), within_s=2, what="the failure counted")
    assert server.failures == [None]


async def test_parallel_guesses_get_no_more_than_the_budget(start_server: StartServer) -> None:
    """Ten connections guessing at once from one address get at most max_failures checks."""
    server = await start_server(max_failures=3, failure_delay_s=0.2)
    clients = [await server.client() for _ in range(10)]
    answers = await asyncio.gather(*(c.cmd(f"AUTH PLAIN {PLAIN_WRONG}") for c in clients))
    assert answers.count(str(replies.AUTH_FAILED)) <= 2
    assert len(server.failures) == 3
    assert len(server.refused) == 7
    for client in clients:
        await client.close()


async def test_parallel_logins_with_the_right_password_are_all_accepted_after_one_check(
        start_server: StartServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An application opening twenty connections at once (a start, or the first minute after
    the verified cache expired) from one address: every login is 235, although more attempts
    than ``max_failures`` are in flight together (those past the budget wait for the ones
    being checked, whose success refunds it), and the twenty share one hash check."""
    calls = _counting_hash_checks(monkeypatch)
    server = await start_server(max_failures=3, failure_delay_s=0.2)
    clients = [await server.client() for _ in range(20)]
    answers = await asyncio.gather(*(c.cmd(f"AUTH PLAIN {PLAIN_OK}") for c in clients))
    assert answers == [str(replies.AUTH_SUCCEEDED)] * 20
    assert (server.failures, server.refused, len(calls)) == ([], [], 1)
    for client in clients:
        await client.close()


async def test_a_right_login_has_given_its_charge_back_when_its_check_is_over(
        start_server: StartServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """When a check is over (no longer holding up the address's other attempts), a success
    has already given its charge back: otherwise a new attempt landing between the two (the
    next connection of a busy application) found the budget spent with nothing in flight and
    was refused ``421`` although every earlier login had succeeded (the benchmark met it about
    once per 1500 logins)."""
    spent_when_over: list[int] = []
    real_checked = Attempts._checked

    def checked(self: Attempts, host: str, task: asyncio.Task[bool]) -> None:
        spent_when_over.append(self.spent(host))
        real_checked(self, host, task)

    monkeypatch.setattr(Attempts, "_checked", checked)
    server = await start_server(max_failures=5)
    clients = [await server.client() for _ in range(5)]
    answers = await asyncio.gather(*(c.cmd(f"AUTH PLAIN {PLAIN_OK}") for c in clients))
    assert answers == [str(replies.AUTH_SUCCEEDED)] * 5
    # each check, as it ends, sees its own charge gone (those still running may hold theirs)
    assert len(spent_when_over) == 5 and max(spent_when_over) <= 4
    assert spent_when_over[-1] == 0
    for client in clients:
        await client.close()


async def test_parallel_guesses_after_a_right_login_in_flight_still_get_the_budget(
        start_server: StartServer) -> None:
    """Waiting for attempts in flight does not widen the budget: one right login and ten
    wrong ones at once from one address: the right one is 235, at most ``max_failures``
    wrong ones are checked, the rest refused unchecked."""
    server = await start_server(max_failures=3, failure_delay_s=0.2)
    clients = [await server.client() for _ in range(11)]
    right = asyncio.create_task(clients[0].cmd(f"AUTH PLAIN {PLAIN_OK}"))
    await until(lambda: len(server.handler.servers) == 1, within_s=5, what="the right login")
    wrong = await asyncio.gather(*(c.cmd(f"AUTH PLAIN {PLAIN_WRONG}") for c in clients[1:]))
    assert await right == str(replies.AUTH_SUCCEEDED)
    assert wrong.count(str(replies.AUTH_FAILED)) <= 2
    assert len(server.failures) == 3
    assert len(server.refused) == 7
    for client in clients:
        await client.close()


async def test_a_right_password_is_answered_without_the_failure_delay(
    start_server: StartServer
) -> None:
    """A right password is answered once verified, well before the failure delay; a wrong one
    from another address waits the delay."""
    server = await start_server(failure_delay_s=1.0, max_failures=5)
    timings = {}
    for name, blob, host in (("right", PLAIN_OK, "127.0.0.2"), ("wrong", PLAIN_WRONG, "127.0.0.3")):
        client = await _client_from(server, host)
        started = time.monotonic()
        await client.cmd(f"AUTH PLAIN {blob}")
        timings[name] = time.monotonic() - started
        await client.close()
    assert timings["right"] < 0.5
    assert timings["wrong"] >= 0.95


def _counting_hash_checks(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """Count the calls of the hash check (one entry per bcrypt/argon2 verification)."""
    calls: list[None] = []
    real = users_file._check_hash

    def counted(entry: Any, secret: bytes) -> bool:
        calls.append(None)
        return real(entry, secret)

    monkeypatch.setattr(users_file, "_check_hash", counted)
    return calls


async def test_a_verified_password_is_not_hashed_again_within_its_time(
        credentials: CredentialFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second login with the same right password is answered without a hash check; a wrong
    one after it is still checked, and refused."""
    calls = _counting_hash_checks(monkeypatch)
    assert await credentials.verify(USER, PASSWORD)
    assert await credentials.verify(USER, PASSWORD)
    assert len(calls) == 1
    assert not await credentials.verify(USER, "wrong")
    assert not await credentials.verify(USER, PASSWORD + "x")
    assert len(calls) == 3


async def test_a_reload_of_the_auth_file_forgets_what_was_verified(
        credentials: CredentialFile, cred_path: Path, hashes: Hashes,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After the file is read again (a reload), a login is checked against the new file: the
    old password of a user whose line changed is refused."""
    assert await credentials.verify(USER, PASSWORD)
    new_hash = argon2.PasswordHasher(time_cost=1, memory_cost=1024, parallelism=1).hash("new")
    await asyncio.to_thread(cred_path.write_text, f"{format_entry(USER, new_hash)}\n"
                            f"{format_entry(BCRYPT_USER, hashes.bcrypt)}\n", encoding="utf-8")
    credentials.replace_with(await asyncio.to_thread(CredentialFile.load, cred_path))
    calls = _counting_hash_checks(monkeypatch)
    assert not await credentials.verify(USER, PASSWORD)
    assert await credentials.verify(USER, "new")
    assert await credentials.verify(BCRYPT_USER, PASSWORD)
    assert len(calls) == 3


def test_verified_credentials_expire_and_are_bounded() -> None:
    """An entry is forgotten ttl_s after its check, and the least recent goes past
    max_entries."""
    now = [0.0]
    cache = VerifiedCache(ttl_s=10.0, max_entries=2, clock=lambda: now[0])
    cache.add("a", "$h", b"p")
    now[0] = 9.9
    assert cache.holds("a", "$h", b"p")
    assert not cache.holds("a", "$h2", b"p")
    now[0] = 10.0
    assert not cache.holds("a", "$h", b"p")
    for user in ("a", "b", "c"):
        cache.add(user, "$h", b"p")
    assert len(cache) == 2
    assert not cache.holds("a", "$h", b"p")
    assert cache.holds("c", "$h", b"p")


async def test_second_auth_after_success_is_503(client: RawClient) -> None:
    """A second AUTH after a successful one is aiosmtpd's 503, with enhanced code 5.5.1."""
    assert await client.cmd(f"AUTH PLAIN {PLAIN_OK}") == str(replies.AUTH_SUCCEEDED)
    assert (await client.cmd(f"AUTH PLAIN {PLAIN_OK}")).startswith("503 5.5.1")


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture every logger at DEBUG, aiosmtpd's ``mail.log`` included."""
    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="mail.log"):
        yield caplog


async def test_logs_hold_no_password_or_blob(client: RawClient,
                                             debug_logs: pytest.LogCaptureFixture) -> None:
    """Even at DEBUG, no log record holds a password or an AUTH blob; the username is DEBUG."""
    wrong_blob = b64(b"\0user@example.com\0Hunter2-wrong")
    assert await client.cmd(f"AUTH PLAIN {wrong_blob}") == str(replies.AUTH_FAILED)
    assert await client.cmd("AUTH LOGIN") == "334 VXNlcm5hbWU6"
    assert await client.cmd(b64(USER)) == "334 UGFzc3dvcmQ6"
    assert await client.cmd(b64(PASSWORD)) == str(replies.AUTH_SUCCEEDED)
    for record in debug_logs.records:
        text = record.getMessage() + " " + repr(vars(record))
        for secret in ("Hunter2-wrong", wrong_blob, b64(PASSWORD), "'pass'"):
            assert secret not in text, record.name
        if USER in text and record.name == "relay.smtp.auth":
            assert record.levelno == logging.DEBUG


async def test_a_long_auth_response_line_is_read_whole(client: RawClient,
                                                       auth_server: AuthServer) -> None:
    """An AUTH PLAIN response of 1.6 KB (over the 1001-octet command line, within RFC 4954's
    12288) is checked like any other: 535 for a wrong password, not 451 and a traceback."""
    assert (await client.cmd("AUTH PLAIN")).startswith("334")
    reply = await client.cmd(b64(b"\0" + USER.encode() + b"\0" + b"x" * 1200))
    assert reply.startswith("535"), reply
    assert len(auth_server.failures) == 1
    assert (await client.cmd("NOOP")).startswith("250")


async def test_an_auth_response_line_over_12288_octets_is_refused_and_drained(
        client: RawClient) -> None:
    """A 20,000-octet AUTH response gets a 5yz and nothing of it is read as a command."""
    assert (await client.cmd("AUTH LOGIN")).startswith("334")
    reply = await client.cmd("QUIT" * 5000)
    assert reply[:1] == "5", reply
    assert (await client.cmd("NOOP")).startswith("250")
