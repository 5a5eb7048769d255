"""`check-config` checks what `serve` checks before it binds (one function,
relay.settings.check_settings): the files the settings name, not only their values."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.credentials import format_entry, hash_password
from tests.support.cli import run_cli
from tests.support.pki import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A certificate and key for the TLS settings (trustme, no network)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A valid credentials file (one argon2id entry)."""
    path = tmp_path_factory.mktemp("auth") / "users"
    path.write_text(format_entry("app@example.com", hash_password("pw-1")) + "\n")
    yield path


def _tls(pki: Pki) -> tuple[str, ...]:
    return ("--tls-cert", str(pki.cert), "--tls-key", str(pki.key))


# (flags after `--upstream maildir:md`, what the one line says, the flag it names)
CASES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "TLS files that do not exist": (
        ("--tls-cert", "nope.pem", "--tls-key", "nope.key"), "No such file", "--tls-cert"),
    "a certificate file that is no PEM": (
        ("--tls-cert", "{garbage}", "--tls-key", "{garbage}"), "cannot load", "--tls-key"),
    "a key that is not the certificate's": (
        ("--tls-cert", "{cert}", "--tls-key", "{other_key}"), "cannot load", "--tls-cert"),
    "a credentials file that does not exist": (
        ("{tls}", "--auth-file", "nope-users"), "cannot read the auth file", "--auth-file"),
    "a credentials line without a hash": (
        ("{tls}", "--auth-file", "{bad_users}"), "line 1", "--auth-file"),
    "an upstream password file that does not exist": (
        ("--upstream-user", "u", "--upstream-password-file", "nope-pw"), "No such file",
        "--upstream-password-file"),
    "a CA file of the store URL that does not exist": (
        ("--store", "rediss://127.0.0.1:6380/0?ssl_ca_certs=/nope/ca.pem"),
        "ssl_ca_certs=/nope/ca.pem: no such file", "--store"),
    "a CA file of the store URL that holds no certificate": (
        ("--store", "rediss://127.0.0.1:6380/0?ssl_ca_certs={garbage}"),
        "not a PEM CA certificate file", "--store"),
    "an empty fingerprint secret (an unset template variable)": (
        ("--fingerprint-secret", ""), "must not be empty", "--fingerprint-secret"),
    "no dedupe header (dedup silently off)": (
        ("--dedupe-headers", ""), "at least one header", "--dedupe-headers"),
    "a hostname with a line break (it goes into the Received: header)": (
        ("--hostname", "evil\r\n250 injected"), "is not a domain name", "--hostname"),
    "a hostname with a blank": (("--hostname", "mx example"), "is not a domain name", "--hostname"),
    "the metrics listener on the SMTP listener's address": (
        ("--listen", "127.0.0.1:2599", "--metrics-listen", "127.0.0.1:2599"),
        "would listen on one address", "--metrics-listen"),
    "the implicit-TLS listener on a wildcard of the SMTP port": (
        ("{tls}", "--listen", "127.0.0.1:2599", "--tls-listen", "0.0.0.0:2599"),
        "would listen on one address", "--tls-listen"),
    "a SQLite store that is another kind of file": (
        ("--store", "sqlite:///{garbage}"), "is not a SQLite database", "--store"),
    "a SQLite store under a file": (
        ("--store", "sqlite:///{garbage}/dedup.db"), "cannot be made", "--store"),
    "a settle journal under a file": (
        ("--settle-journal", "{garbage}/owed.jsonl"), "cannot be made", "--settle-journal"),
    "a fingerprint secret file that does not exist": (
        ("--fingerprint-secret-file", "{garbage}.missing"), "No such file",
        "--fingerprint-secret-file"),
    "an empty fingerprint secret file (a secret not mounted yet)": (
        ("--fingerprint-secret-file", "{empty}"), "is empty", "--fingerprint-secret-file"),
    "a fingerprint secret both inline and in a file": (
        ("--fingerprint-secret", "s3cret", "--fingerprint-secret-file", "{garbage}"),
        "not both", "--fingerprint-secret-file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_config_and_serve_refuse_the_same_unusable_files(
        tmp_path: Path, pki: Pki, case: str) -> None:
    """check-config exits 78 where serve exits 78 too, before it opens the store or binds a
    port, with the same line naming the setting's flag; neither prints a traceback."""
    other = make_pki(tmp_path)  # a second key pair: its key does not match pki.cert
    (tmp_path / "garbage.txt").write_text("neither PEM nor SQLite\n" * 40)
    (tmp_path / "bad-users").write_text("app@example.com\n")
    (tmp_path / "empty-secret").write_text(" \n")
    args, says, flag = CASES[case]
    values = {"garbage": str(tmp_path / "garbage.txt"), "cert": str(pki.cert),
              "other_key": str(other.key), "bad_users": str(tmp_path / "bad-users"),
              "empty": str(tmp_path / "empty-secret")}
    argv: list[str] = []
    for arg in args:
        argv += list(_tls(pki)) if arg == "{tls}" else [arg.format(**values)]
    common = ("--upstream", "maildir:md", "--metrics-listen", "off", "--listen", "127.0.0.1:0")
    checked = run_cli("check-config", *common, *argv, cwd=tmp_path)
    served = run_cli("serve", *common, *argv, cwd=tmp_path)
    for result in (checked, served):
        assert result.returncode == 78, result
        assert says in result.stderr and f"{flag}, RELAY_" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert checked.stderr == served.stderr
    assert not (tmp_path / "data").exists()  # serve opened no store


def test_check_config_accepts_a_complete_tls_and_auth_setup(
        tmp_path: Path, pki: Pki, users: Path) -> None:
    """Real certificate, key and credentials file: exit 0."""
    result = run_cli("check-config", "--upstream", "maildir:md", *_tls(pki), "--auth-file",
                     str(users), "--auth-required", "--tls-listen", "127.0.0.1:4650",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "configuration ok" in result.stdout


def test_check_config_refuses_event_loop_uvloop_when_uvloop_does_not_import(
        tmp_path: Path) -> None:
    """event_loop = uvloop without uvloop (a sitecustomize blocks its import): serve refuses to
    start (69), so check-config does not say "configuration ok" but exits 78 naming
    event_loop; auto and asyncio still pass."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['uvloop'] = None\n")
    env = {"PYTHONPATH": str(shim)}
    args = ("--upstream", "maildir:md", "--store", "sqlite:///dedup.db")
    result = run_cli("check-config", *args, "--event-loop", "uvloop", cwd=tmp_path, env=env)
    assert result.returncode == 78, result
    assert "event_loop" in result.stderr and "uvloop does not import" in result.stderr
    served = run_cli("serve", *args, "--event-loop", "uvloop", "--workers", "1",
                     "--listen", "127.0.0.1:0", "--metrics-listen", "off", cwd=tmp_path,
                     env=env)
    assert served.returncode == 69, served
    for loop in ("auto", "asyncio"):
        ok = run_cli("check-config", *args, "--event-loop", loop, cwd=tmp_path, env=env)
        assert ok.returncode == 0, ok
