"""The workers' refresh-token lock (``.<file>.lock`` beside ``oauth_refresh_token_file``) against
a loopback HTTPS token endpoint that rotates refresh tokens and revokes the family on reuse: a
lock that is a symbolic link is never followed, a lock owned by another user (``nobody``) is
never used, and while several workers share the token no refresh runs without the lock (its
own reason, ``relay_oauth_token_failures_total{reason="lock"}``); a relay of one worker
refreshes unlocked with a WARNING."""

from __future__ import annotations

import logging
import os
import pwd
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from relay.ops.metrics import PrometheusMetrics
from relay.upstream.oauth import TOKEN_FAILURES, FormGrant, OAuthConfig, TokenError, TokenProvider
from relay.upstream.oauth_lock import check_lock
from tests.support.oauth import TokenEndpoint, start_token_endpoint

pytestmark = pytest.mark.timeout(30)

VICTIM = "a file the relay must never write\n"


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


def worker(endpoint: TokenEndpoint, token_file: Path, *, shared: bool = True,
           metrics: PrometheusMetrics | None = None) -> TokenProvider:
    """One worker's token provider over the refresh token in ``token_file``."""
    return TokenProvider(FormGrant(OAuthConfig(
        token_url=endpoint.url, client_id="c", refresh_token=token_file.read_text().strip(),
        ca_file=endpoint.ca_file, timeout_s=5.0, refresh_token_file=token_file,
        shared=shared)), on_failure=None if metrics is None else metrics.oauth_token_failure)


def held(token_file: Path) -> str:
    """The refresh token ``token_file`` holds."""
    return token_file.read_text().strip()


def lock_of(token_file: Path) -> Path:
    return token_file.with_name(f".{token_file.name}.lock")


def foreign_lock(token_file: Path) -> Path:
    """The lock file, made beforehand and owned by ``nobody``."""
    lock = lock_of(token_file)
    lock.write_text("")
    nobody = pwd.getpwnam("nobody")
    os.chown(lock, nobody.pw_uid, nobody.pw_gid)
    return lock


def symlinked_lock(token_file: Path, tmp_path: Path) -> Path:
    """The lock path made a symbolic link to a victim file; the victim."""
    victim = tmp_path / "victim"
    victim.write_text(VICTIM)
    lock_of(token_file).symlink_to(victim)
    return victim


async def test_a_lock_owned_by_another_user_fails_a_shared_refresh_without_asking(
        endpoint: TokenEndpoint, token_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Workers sharing the token never refresh unlocked: the refresh fails with its own
    reason and kind, nothing reaches the endpoint (the token family stays valid), the metric
    counts it, and the ERROR line names the lock and its owner."""
    foreign_lock(token_file)
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry=registry)
    metrics.declare_token_failures(TOKEN_FAILURES)
    with pytest.raises(TokenError, match="token refresh lock unusable") as refused:
        await worker(endpoint, token_file, metrics=metrics).token()
    assert refused.value.kind == "lock"
    assert endpoint.fetches == 0 and not endpoint.family_revoked
    assert registry.get_sample_value("relay_oauth_token_failures_total",
                                     {"reason": "lock"}) == 1
    assert registry.get_sample_value("relay_oauth_token_failures_total",
                                     {"reason": "busy"}) == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "owned by uid" in errors[0] and str(lock_of(token_file)) in \
        errors[0]
    assert held(token_file) == "rt-0"


async def test_a_symlinked_lock_is_not_followed_and_its_target_is_untouched(
        endpoint: TokenEndpoint, token_file: Path, tmp_path: Path) -> None:
    """A link planted as the lock: the shared refresh fails (``lock``), the file the link
    names keeps its content, and the link stays a link."""
    victim = symlinked_lock(token_file, tmp_path)
    with pytest.raises(TokenError) as refused:
        await worker(endpoint, token_file).token()
    assert refused.value.kind == "lock" and endpoint.fetches == 0
    assert victim.read_text() == VICTIM
    assert lock_of(token_file).is_symlink()


async def test_a_relay_of_one_worker_refreshes_unlocked_with_a_warning(
        endpoint: TokenEndpoint, token_file: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """No other refresher: the lock's problem is a WARNING, the refresh runs (and rotates the
    token into its file), the link's target is still untouched."""
    victim = symlinked_lock(token_file, tmp_path)
    assert await worker(endpoint, token_file, shared=False).token() == "tok-1"
    assert held(token_file) == endpoint.refresh_in_force == "rt-1"
    assert victim.read_text() == VICTIM
    assert any(r.levelno == logging.WARNING and "unlocked" in r.getMessage()
               for r in caplog.records)


async def test_a_lock_with_another_hard_link_is_not_used(
        endpoint: TokenEndpoint, token_file: Path, tmp_path: Path) -> None:
    """A hard link to a file of the relay's user, planted as the lock: not truncated."""
    victim = tmp_path / "victim"
    victim.write_text(VICTIM)
    os.link(victim, lock_of(token_file))
    with pytest.raises(TokenError, match="lock unusable"):
        await worker(endpoint, token_file).token()
    assert victim.read_text() == VICTIM


async def test_the_relays_own_lock_still_serialises_the_refreshes(
        endpoint: TokenEndpoint, token_file: Path) -> None:
    """The lock the relay made itself (mode 0600, its user's) is used: two workers refresh in
    turn, each with the token the other rotated, and the family stays valid."""
    first, second = worker(endpoint, token_file), worker(endpoint, token_file)
    assert await first.token() == "tok-1"
    assert await second.token() == "tok-2"
    assert [f["refresh_token"] for f in endpoint.forms] == ["rt-0", "rt-1"]
    assert not endpoint.family_revoked
    assert lock_of(token_file).stat().st_mode & 0o777 == 0o600
    assert check_lock(token_file) is None


def test_check_lock_names_each_problem(token_file: Path, tmp_path: Path) -> None:
    """check-config's look at the lock: missing in a writable folder is fine; a link, another
    user's file, a folder that is no file are named."""
    assert check_lock(token_file) is None
    lock = lock_of(token_file)
    lock.mkdir()
    assert "not a regular file" in str(check_lock(token_file))
    lock.rmdir()
    symlinked_lock(token_file, tmp_path)
    assert "symbolic link" in str(check_lock(token_file))
    lock.unlink()
    foreign_lock(token_file)
    assert "owned by uid" in str(check_lock(token_file))
