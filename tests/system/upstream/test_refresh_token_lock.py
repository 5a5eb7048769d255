"""The refresh-token lock with real relay processes: two workers (`serve --workers 2`) sharing
one refresh token, a loopback HTTPS token endpoint that rotates it and revokes the family on
reuse, and a lock file owned by another user (``nobody``): no worker refreshes unlocked, the
client is told 451 naming the lock, the metric counts it, and once the lock is the relay's
again mail flows with the family intact. ``check-config`` tests the lock the same way."""

from __future__ import annotations

import asyncio
import os
import pwd
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.cli import run_cli
from tests.support.clients import message, send
from tests.support.oauth import OAuthSinkHandler, TokenEndpoint, oauth_smtp, start_token_endpoint
from tests.support.relays import REDIS_URL, delete_prefix, start_serve

pytestmark = pytest.mark.timeout(90)

MAILBOX = "mailbox@example.com"


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[TokenEndpoint]:
    served = await start_token_endpoint(tmp_path)
    served.rotate = True
    yield served
    await served.stop()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "secrets" / "refresh-token"
    path.parent.mkdir()
    path.write_text("rt-0\n")
    path.chmod(0o600)
    return path


def make_foreign(lock: Path) -> None:
    """``lock`` made (or kept) and owned by ``nobody``."""
    lock.touch()
    nobody = pwd.getpwnam("nobody")
    os.chown(lock, nobody.pw_uid, nobody.pw_gid)


def held(token_file: Path) -> str:
    """The refresh token ``token_file`` holds."""
    return token_file.read_text().strip()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


async def test_two_workers_never_refresh_through_a_lock_of_another_user(
        tmp_path: Path, endpoint: TokenEndpoint, token_file: Path) -> None:
    """Six messages on six connections (to whichever worker takes each) while the lock is
    ``nobody``'s: each is answered 451 naming the lock, no refresh reaches the endpoint, the
    family is not revoked and ``relay_oauth_token_failures_total{reason="lock"}`` counts
    them; the lock given back to the relay's user, the next message is relayed."""
    handler = OAuthSinkHandler(endpoint=endpoint, user=MAILBOX)
    server = await asyncio.get_running_loop().create_server(
        lambda: oauth_smtp(handler), host="127.0.0.1", port=0)
    prefix = f"test:{uuid.uuid4().hex}:"
    relay = await start_serve(
        tmp_path, "--upstream", f"127.0.0.1:{server.sockets[0].getsockname()[1]}",
        "--store", REDIS_URL, "--store-prefix", prefix, "--metrics-listen", "127.0.0.1:0",
        "--settle-journal", str(tmp_path / "owed.jsonl"), "--upstream-pool-size", "0",
        "--upstream-auth", "xoauth2", "--upstream-user", MAILBOX,
        "--oauth-token-url", endpoint.url, "--oauth-client-id", "client-1",
        "--oauth-refresh-token-file", str(token_file), "--oauth-ca-file",
        str(endpoint.ca_file), workers=2)
    lock = token_file.with_name(".refresh-token.lock")
    try:
        make_foreign(lock)
        replies = [await send(relay.port, ["user@example.net"], message(f"K-{n}"))
                   for n in range(6)]
        assert {r.code for r in replies} == {451}, replies
        assert all("token refresh lock unusable" in r.text for r in replies), replies
        assert endpoint.fetches == 0 and not endpoint.family_revoked
        assert relay.metrics_port is not None
        assert 'relay_oauth_token_failures_total{reason="lock"} 6.0' in scrape(
            relay.metrics_port)
        os.chown(lock, os.geteuid(), os.getegid())
        assert (await send(relay.port, ["user@example.net"], message("K-after"))).code == 250
    finally:
        relay.stop()
        server.close()
        delete_prefix(REDIS_URL, prefix)
    assert endpoint.fetches == 1 and not endpoint.family_revoked
    assert held(token_file) == endpoint.refresh_in_force
    assert len(handler.delivered) == 1
    logged = await asyncio.to_thread(relay.log_path.read_text)
    assert "owned by uid" in logged and "rt-0" not in logged


@pytest.mark.parametrize(("workers", "planted", "code", "says"), [
    ("2", "foreign", 78, "owned by uid"),
    ("2", "link", 78, "symbolic link"),
    ("1", "foreign", 0, "refreshes unlocked"),
])
def test_check_config_tests_the_refresh_token_lock(
        tmp_path: Path, token_file: Path, workers: str, planted: str, code: int,
        says: str) -> None:
    """With several workers a lock they cannot use is a configuration error naming the
    setting; a relay of one worker is warned (it refreshes unlocked)."""
    lock = token_file.with_name(".refresh-token.lock")
    if planted == "foreign":
        make_foreign(lock)
    else:
        (tmp_path / "victim").write_text("victim\n")
        lock.symlink_to(tmp_path / "victim")
    result = run_cli(
        "check-config", "--upstream", "127.0.0.1:2525", "--metrics-listen", "off",
        "--listen", "127.0.0.1:0", "--workers", workers, "--upstream-auth", "xoauth2",
        "--upstream-user", MAILBOX, "--oauth-token-url", "https://127.0.0.1:1/t",
        "--oauth-client-id", "c", "--oauth-refresh-token-file", str(token_file), cwd=tmp_path)
    assert result.returncode == code, result
    assert says in result.stderr and str(lock) in result.stderr, result.stderr
    if code:
        assert "--oauth-refresh-token-file, RELAY_" in result.stderr
    else:
        assert "warning:" in result.stderr
