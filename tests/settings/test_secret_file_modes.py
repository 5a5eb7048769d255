"""A secret file the settings name that is open to its group or to other users is warned about,
naming it (OpenSSH's rule for a private key): by every section (one rule), by ``check-config``
on stderr (exit 0) and in the start-up log of a real relay. A file of another user (root) the
relay reads through its group is left alone."""

from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import Any

import pytest

from relay.settings import Settings, file_warnings
from relay.settings.common import secret_file_exposure
from tests.support.cli import run_cli
from tests.support.relays import start_serve


def settings(**values: Any) -> Settings:
    return Settings(**values)


def secret(folder: Path, name: str, mode: int) -> Path:
    path = folder / name
    path.write_text(f"{name}-value\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize(("mode", "says"), [
    (0o600, None),
    (0o400, None),
    (0o640, "open to its group (mode 0640)"),
    (0o604, "open to other users (mode 0604)"),
    (0o644, "open to its group and other users (mode 0644)"),
    (0o620, "open to its group (mode 0620)"),
], ids=["0600", "0400", "0640", "0604", "0644", "0620"])
def test_a_secret_file_open_beyond_its_owner_is_named(tmp_path: Path, mode: int,
                                                      says: str | None) -> None:
    """Any permission for the group or others, read or write, is an exposure."""
    path = secret(tmp_path, "password", mode)
    exposure = secret_file_exposure(path)
    if says is None:
        assert exposure is None
    else:
        assert exposure is not None and says in exposure and str(path) in exposure


def test_another_users_file_read_through_the_relays_group_is_left_alone(
        tmp_path: Path) -> None:
    """A root-owned Kubernetes secret with ``fsGroup`` (mode 0440, the relay's group): its
    group may read it, it is how the relay does; others may not."""
    path = secret(tmp_path, "password", 0o440)
    os.chown(path, pwd.getpwnam("nobody").pw_uid, os.getegid())
    assert secret_file_exposure(path) is None
    path.chmod(0o444)
    assert "open to other users (mode 0444)" in str(secret_file_exposure(path))


def test_every_section_names_its_secret_files(tmp_path: Path) -> None:
    """The listener's key and users file, the smarthost passwords and client keys (global and
    an entry's), the fingerprint secret, the console's users file and key, and each OAuth2
    credential file: each loose one is one warning naming its setting."""
    def loose(name: str) -> Path:
        return secret(tmp_path, name, 0o644)

    common: dict[str, Any] = {
        "tls_cert": tmp_path / "cert.pem", "tls_key": loose("tls-key"),
        "auth_file": loose("users"), "fingerprint_secret_file": loose("fingerprint"),
        "upstream_password_file": loose("password"),
        "upstream_client_cert": tmp_path / "client.pem",
        "upstream_client_key": loose("client-key"),
        "console_listen": "127.0.0.1:0", "console_auth_file": loose("console-users"),
        "console_tls_cert": tmp_path / "cert.pem", "console_tls_key": loose("console-key"),
        "upstream": [{"address": "127.0.0.1:25", "name": "own",
                      "password_file": str(loose("own-password"))}]}
    generic = settings(**common, oauth_token_url="https://idp.example/token",
                       oauth_client_id="c", oauth_client_secret_file=loose("client-secret"),
                       oauth_refresh_token_file=loose("refresh-token"))
    named = [w.split(":", 1)[0] for w in file_warnings(generic)]
    assert sorted(named) == sorted([
        "tls_key", "auth_file", "upstream_password_file", "upstream_client_key", "upstream own",
        "oauth_client_secret_file", "oauth_refresh_token_file", "fingerprint_secret_file",
        "console_auth_file", "console_tls_key"]), named
    microsoft = settings(upstream="127.0.0.1:25", oauth_provider="microsoft",
                         oauth_certificate_file=loose("entra.pem"))
    google = settings(upstream="127.0.0.1:25", oauth_provider="google",
                      oauth_service_account_file=loose("sa.json"))
    federated = settings(upstream="127.0.0.1:25", oauth_provider="microsoft",
                         oauth_federated_token_file=loose("federated"))
    assert [w.split(":", 1)[0] for s in (microsoft, google, federated)
            for w in file_warnings(s)] == [
        "oauth_certificate_file", "oauth_service_account_file", "oauth_federated_token_file"]


def test_check_config_warns_about_a_loose_secret_file_and_still_approves(
        tmp_path: Path) -> None:
    """Exit 0 (serve would start), one ``warning:`` line naming the setting and the file."""
    password = secret(tmp_path, "password", 0o640)
    result = run_cli("check-config", "--upstream", "127.0.0.1:2525", "--listen", "127.0.0.1:0",
                     "--metrics-listen", "off", "--upstream-user", "u",
                     "--upstream-password-file", str(password), cwd=tmp_path)
    assert result.returncode == 0, result
    warnings = [line for line in result.stderr.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "upstream_password_file" in warnings[0]
    assert f"chmod go= {password}" in warnings[0]
    password.chmod(0o600)
    result = run_cli("check-config", "--upstream", "127.0.0.1:2525", "--listen", "127.0.0.1:0",
                     "--metrics-listen", "off", "--upstream-user", "u",
                     "--upstream-password-file", str(password), cwd=tmp_path)
    assert result.returncode == 0 and "warning:" not in result.stderr, result


async def test_a_relay_logs_a_loose_secret_file_at_start(tmp_path: Path) -> None:
    """The start-up log of `serve` holds one WARNING naming the fingerprint secret's file."""
    fingerprint = secret(tmp_path, "fingerprint", 0o604)
    relay = await start_serve(
        tmp_path, "--upstream", "maildir:md", "--metrics-listen", "off", "--store",
        f"sqlite:///{tmp_path}/store.db", "--fingerprint-secret-file", str(fingerprint),
        workers=1)
    relay.stop()
    warned = [e["message"] for e in relay.lines() if e.get("level") == "WARNING"]
    assert [w for w in warned if "fingerprint_secret_file" in w] == [
        f"fingerprint_secret_file: {fingerprint} is open to other users (mode 0604): it holds "
        f"a secret; make it readable by its owner only (chmod go= {fingerprint})"], warned
