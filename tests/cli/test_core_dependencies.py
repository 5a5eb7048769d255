"""The relay runs with its core dependencies alone: without the ``postgres`` extra (asyncpg), the
``fast`` one (uvloop, hiredis) and the ``otel`` one (OpenTelemetry) a relay on the embedded
store serves and relays, and a setting (or an ``OTEL_*`` exporter) that needs a missing extra is
an invalid configuration (exit 78) that names the extra to install. The extras are made
unimportable in real ``python -m relay`` processes (a ``sitecustomize`` that puts None in
``sys.modules`` for them)."""

from __future__ import annotations

import os
import signal
import smtplib
import subprocess
import sys
from pathlib import Path

import pytest

from relay.cli.exit_codes import ExitCode
from tests.support.cli import wait_for_port
from tests.support.clients import message
from tests.support.net import free_port

EXTRAS = ("asyncpg", "uvloop", "hiredis", "opentelemetry", "msal", "google")
POSTGRES = "postgresql://relay@127.0.0.1:5432/relay"


@pytest.fixture
def core_only(tmp_path: Path) -> dict[str, str]:
    """The environment of a process in which the extras do not import."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in EXTRAS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env["PYTHONPATH"] = str(shim)
    return env


def relay(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relay", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_extras_really_do_not_import(core_only: dict[str, str], tmp_path: Path) -> None:
    """The shim works: each extra's import fails in the relay's interpreter."""
    script = (f"import importlib\nfor m in {EXTRAS!r}:\n    try:\n"
              "        importlib.import_module(m)\n        print('imported', m)\n"
              "    except ImportError:\n        pass\n")
    probe = subprocess.run(
        [sys.executable, "-c", script],
        env=core_only, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True)
    assert probe.stdout == ""


def test_a_relay_on_the_embedded_store_serves_without_the_extras(
        core_only: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "serve", "--listen", f"127.0.0.1:{port}",
         "--upstream", "maildir:md", "--metrics-listen", "off", "--workers", "1"],
        cwd=tmp_path, env=core_only, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(port, proc)
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
            client.sendmail("app@example.com", ["a@example.net"], message(key="core-1"))
        assert len(list((tmp_path / "md" / "new").iterdir())) == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "event loop asyncio" in err  # uvloop absent: the standard loop, as auto says


@pytest.mark.parametrize(("args", "setting"), [
    pytest.param(("check-config", "--upstream", "maildir:md", "--store", POSTGRES), "store",
                 id="store"),
    pytest.param(("check-config", "--upstream", "maildir:md", "--ledger", POSTGRES), "ledger",
                 id="ledger"),
    pytest.param(("history", "--ledger", POSTGRES, "--rcpt", "a@example.net", "--key", "k"),
                 "ledger", id="history"),
    pytest.param(("db", "upgrade", "--store", POSTGRES), "store", id="db-upgrade"),
])
def test_a_setting_that_needs_the_postgres_extra_names_it(
        core_only: dict[str, str], tmp_path: Path, args: tuple[str, ...], setting: str) -> None:
    done = relay(*args, env=core_only, cwd=tmp_path)
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert "pip install 'dedup-relay[postgres]'" in done.stderr
    assert setting in done.stderr


@pytest.mark.parametrize("command", ["serve", "check-config"])
@pytest.mark.parametrize("otel", [{"OTEL_TRACES_EXPORTER": "console"},
                                  {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}],
                         ids=["console", "otlp-endpoint"])
def test_tracing_configured_without_the_otel_extra_names_it(
        core_only: dict[str, str], tmp_path: Path, command: str, otel: dict[str, str]) -> None:
    done = relay(command, "--upstream", "maildir:md", "--metrics-listen", "off",
                 env={**core_only, **otel}, cwd=tmp_path)
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert "pip install 'dedup-relay[otel]'" in done.stderr
    assert "OTEL_" in done.stderr


@pytest.mark.parametrize("provider", [
    ("--oauth-provider", "microsoft", "--oauth-managed-identity", "system"),
    ("--oauth-provider", "google", "--oauth-service-account-file", "sa.json"),
], ids=["microsoft", "google"])
def test_an_oauth_provider_without_the_oauth_extra_names_it(
        core_only: dict[str, str], tmp_path: Path, provider: tuple[str, ...]) -> None:
    done = relay("check-config", "--upstream", "smtp.example.com:587", "--upstream-auth",
                 "xoauth2", "--upstream-user", "relay@example.com", *provider,
                 env=core_only, cwd=tmp_path)
    assert done.returncode == ExitCode.CONFIG, done.stderr
    assert "pip install 'dedup-relay[oauth]'" in done.stderr
    assert "oauth_provider" in done.stderr
