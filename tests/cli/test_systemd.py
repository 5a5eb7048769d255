"""contrib/systemd/: the unit is one systemd accepts (`systemd-analyze verify`, where systemd is
installed), starts the relay's own command, gives it the settings, time and rights it needs,
and is hardened; the example env file holds valid settings whose paths the unit lets it write."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import smtplib
import subprocess
import sys
from pathlib import Path

import pytest

from relay.cli.exit_codes import ExitCode
from relay.cli.group import main as cli_main
from relay.core.cancellation import AFTER_DOT_WAIT_S
from relay.settings import Settings
from relay.store.sqlite.kind import sqlite_path_from_url
from tests.support.cli import wait_for_port
from tests.support.net import free_port
from tests.support.pki import make_pki

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "contrib" / "systemd" / "dedup-relay.service"
ENV_FILE = REPO / "contrib" / "systemd" / "dedup-relay.env"
DEFAULT = {name: field.default for name, field in Settings.model_fields.items()}

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """``{section: {key: [value, ...]}}`` of a unit file: every assignment of a key kept in
    order (SystemCallFilter= and friends add up), comments and blank lines dropped."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = unit.setdefault(line.strip("[]"), {})
            continue
        assert section is not None, f"assignment before a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line}"
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


def service() -> dict[str, list[str]]:
    """The [Service] section of the shipped unit."""
    return parse_unit(UNIT.read_text())["Service"]


def one(key: str) -> str:
    """The single value of ``key`` in [Service]."""
    values = service()[key]
    assert len(values) == 1, (key, values)
    return values[0]


def seconds(value: str) -> float:
    """A systemd time span without spaces (``45``, ``45s``, ``1min``, ``1min30s``) in seconds."""
    units = {"": 1.0, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)([a-z]*)", value)
    assert parts and "".join(n + u for n, u in parts) == value, value
    return sum(float(n) * units[u] for n, u in parts)


def env_file() -> dict[str, str]:
    """The NAME=value lines of the example env file."""
    out = {}
    for line in ENV_FILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            out[name.strip()] = value.strip()
    return out


def test_unit_starts_serve_with_the_config_file_and_reloads_with_sighup() -> None:
    """Type=notify (readiness from the main process only); ExecStart runs the console script's
    `serve --config FILE` (a command and an option the CLI has); ExecReload sends SIGHUP to the
    main process; the env file is read."""
    svc = service()
    assert one("Type") == "notify" and one("NotifyAccess") == "main"
    argv = shlex.split(one("ExecStart"))
    assert Path(argv[0]).name == "dedup-relay" and argv[0].startswith("/")
    assert argv[1] == "serve" and argv[1] in cli_main.commands
    serve_options = {o for p in cli_main.commands["serve"].params for o in p.opts}
    assert "--config" in serve_options and argv[argv.index("--config") + 1].startswith("/")
    assert shlex.split(one("ExecReload")) in (["/bin/kill", "-HUP", "$MAINPID"],
                                              ["/bin/kill", "-s", "HUP", "$MAINPID"])
    assert svc["EnvironmentFile"] == ["-/etc/dedup-relay/dedup-relay.env"]


def test_unit_does_not_restart_an_invalid_configuration() -> None:
    """Restart=on-failure, except on EX_CONFIG (78) and a refused flag (2), which a restart
    cannot heal; EX_UNAVAILABLE (69: the store not reachable yet) is restarted."""
    assert one("Restart") == "on-failure"
    prevented = {int(code) for code in one("RestartPreventExitStatus").split()}
    assert {ExitCode.CONFIG, ExitCode.USAGE} <= prevented
    assert ExitCode.UNAVAILABLE not in prevented


def test_unit_stop_outlasts_the_relays_own_shutdown() -> None:
    """SIGTERM goes to the supervisor alone (KillMode=mixed: it forwards it to its workers), and
    systemd's SIGKILL comes after the supervisor's own bound on its workers' graceful shutdown
    (shutdown_grace + the wait for replies to final dots + 4 x store_timeout + 10 s,
    relay/supervision/supervisor.py), itself above shutdown_grace."""
    assert one("KillSignal") == "SIGTERM"
    assert one("KillMode") == "mixed"
    supervisor_bound = (DEFAULT["shutdown_grace"] + AFTER_DOT_WAIT_S
                        + 4 * DEFAULT["store_timeout"] + 10.0)
    assert seconds(one("TimeoutStopSec")) > supervisor_bound > DEFAULT["shutdown_grace"]


def test_unit_runs_as_its_own_user_with_only_the_bind_capability() -> None:
    """A dynamic (or dedicated) user, its state in StateDirectory as the working directory, and
    CAP_NET_BIND_SERVICE (port 25, 465) as the only capability, ambient and bounding."""
    svc = service()
    assert svc.get("DynamicUser") == ["yes"] or svc.get("User") not in (None, ["root"])
    state = one("StateDirectory")
    assert one("WorkingDirectory") == f"/var/lib/{state}"
    assert one("AmbientCapabilities") == "CAP_NET_BIND_SERVICE"
    assert one("CapabilityBoundingSet") == "CAP_NET_BIND_SERVICE"
    assert "PrivateUsers" not in svc  # in a user namespace of its own it could not bind port 25


def test_unit_has_the_usual_hardening() -> None:
    """The options of `systemd-analyze security`'s usual list, each set to what confines."""
    svc = service()
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices",
                "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
                "ProtectControlGroups", "RestrictNamespaces", "LockPersonality",
                "MemoryDenyWriteExecute", "RestrictSUIDSGID", "RestrictRealtime"):
        assert svc.get(key) == ["yes"], key
    assert one("ProtectSystem") == "strict"
    assert one("SystemCallArchitectures") == "native"
    assert svc["SystemCallFilter"][0] == "@system-service"
    assert set(one("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert one("UMask") == "0077"


def test_env_file_settings_are_valid_and_write_under_the_state_directory() -> None:
    """Every name in the example env file is a RELAY_* setting, the values are valid together,
    and the files the relay writes (SQLite store, settle journal) are absolute paths under the
    unit's StateDirectory: ProtectSystem=strict leaves nothing else writable."""
    env = env_file()
    assert all(name.startswith("RELAY_") for name in env)
    values = {name[len("RELAY_"):].lower(): value for name, value in env.items()}
    assert set(values) <= set(Settings.model_fields)
    settings = Settings.model_validate({**values, "upstream": "maildir:/tmp/x"})
    state = Path("/var/lib") / one("StateDirectory")
    written = [Path(settings.settle_journal)]
    if settings.store.startswith("sqlite:"):
        written.append(Path(sqlite_path_from_url(settings.store)))
    assert written and all(p.is_absolute() and p.is_relative_to(state) for p in written), written


def test_unit_credentials_example_names_settings() -> None:
    """The commented LoadCredential example sets RELAY_*_FILE settings that exist, to %d/NAME
    of a credential it loads."""
    text = UNIT.read_text()
    loaded = set(re.findall(r"^#?LoadCredential=([\w-]+):", text, re.M))
    pointed = re.findall(r"^#?Environment=RELAY_(\w+)=%d/([\w-]+)$", text, re.M)
    assert pointed
    for name, credential in pointed:
        assert name.lower() in Settings.model_fields and name.endswith("_FILE")
        assert credential in loaded


# --- systemd itself --------------------------------------------------------------------------

ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")


def verify(unit_text: str, tmp_path: Path) -> list[str]:
    """Problems `systemd-analyze verify` finds in ``unit_text`` with ExecStart pointed at this
    venv's dedup-relay (verify needs the binary to exist): its exit status, and every line it
    prints about this unit (lines about other units of the machine are its own business)."""
    script = Path(sys.executable).with_name("dedup-relay")
    assert script.exists(), script
    unit = tmp_path / "dedup-relay.service"
    unit.write_text(unit_text.replace("/opt/dedup-relay/bin/dedup-relay", str(script)))
    assert ANALYZE is not None
    done = subprocess.run([ANALYZE, "verify", "--man=no", str(unit)], capture_output=True,
                          text=True, timeout=30, check=False)
    lines = (done.stdout + done.stderr).splitlines()
    problems = [line for line in lines if unit.name in line]
    if done.returncode != 0:
        problems.append(f"exit status {done.returncode}")
    return problems


@needs_systemd
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    """systemd parses every line of the unit without a warning and would start it."""
    assert verify(UNIT.read_text(), tmp_path) == []


@needs_systemd
@pytest.mark.parametrize(("line", "broken"), [
    ("KillMode=mixed", "KilMode=mixed"),  # unknown key: systemd ignores it, exit status 0
    ("Restart=on-failure", "Restart=on-failur"),  # bad value: ignored, exit status 0
    ("[Service]", "[Servic]"),  # no ExecStart: refused, exit status 1
])
def test_verify_finds_a_broken_unit(tmp_path: Path, line: str, broken: str) -> None:
    """The check above fails on a unit with one key broken (warnings count, not only the exit
    status)."""
    text = UNIT.read_text()
    assert f"\n{line}\n" in text
    assert verify(text.replace(f"\n{line}\n", f"\n{broken}\n"), tmp_path) != []


@needs_systemd
def test_systemd_analyze_security_rates_the_unit_ok(tmp_path: Path) -> None:
    """`systemd-analyze security --offline` rates the unit's exposure at most 2.0 of 10 ("OK";
    an unhardened service is 9.6, "UNSAFE")."""
    unit = tmp_path / "dedup-relay.service"
    unit.write_text(UNIT.read_text())
    assert ANALYZE is not None
    done = subprocess.run([ANALYZE, "security", "--offline=true", "--no-pager", str(unit)],
                          capture_output=True, text=True, timeout=30, check=False)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    if found is None and "offline" in done.stderr:
        pytest.skip(f"this systemd-analyze has no --offline: {done.stderr.strip()}")
    assert found is not None, done.stdout + done.stderr
    assert float(found.group(1)) <= 2.0, done.stdout


# --- MemoryDenyWriteExecute ------------------------------------------------------------------

# PR_SET_MDWE (Linux 6.3): no mapping may become writable and executable, the rule the unit's
# MemoryDenyWriteExecute=yes enforces with seccomp; kept across execve. Exit 3: no such prctl
# here; exit 4: set, but a W+X mapping still succeeded.
MDWE_EXEC = """
import ctypes, mmap, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) != 0:
    sys.exit(3)
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    sys.exit(4)
except PermissionError:
    pass
os.execv(sys.argv[1], sys.argv[1:])
"""

# what AUTH computes: an argon2id and a bcrypt hash, each checked
HASHES = """
import argon2, bcrypt
ph = argon2.PasswordHasher()
assert ph.verify(ph.hash("pw"), "pw")
assert bcrypt.checkpw(b"pw", bcrypt.hashpw(b"pw", bcrypt.gensalt(4)))
"""


def test_relay_serves_without_writable_executable_memory(tmp_path: Path) -> None:
    """argon2 and bcrypt hash and check a password, and the relay as the unit runs it
    (supervisor and 2 workers on uvloop, SQLite) relays a message after STARTTLS and an AUTH
    checked against an argon2id hash, with W+X
    memory refused: MemoryDenyWriteExecute=yes breaks neither (a JIT or a libffi closure
    would)."""
    probe = subprocess.run([sys.executable, "-c", MDWE_EXEC, sys.executable, "-c", HASHES],
                           timeout=30, check=False)
    if probe.returncode == 3:
        pytest.skip("this kernel has no PR_SET_MDWE (Linux >= 6.3)")
    assert probe.returncode == 0
    assert service()["MemoryDenyWriteExecute"] == ["yes"]
    port, pki = free_port(), make_pki(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", MDWE_EXEC, sys.executable, "-m", "relay", "serve",
         "--listen", f"127.0.0.1:{port}", "--upstream", f"maildir:{tmp_path / 'maildir'}",
         "--metrics-listen", "off", "--workers", "2", "--event-loop", "uvloop",
         "--auth-file", str(auth_file(tmp_path)), "--auth-required",
         "--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--store",
         f"sqlite:///{tmp_path / 'fp.db'}", "--settle-journal", str(tmp_path / "j.jsonl")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(port, proc)
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
            client.starttls(context=pki.client_context)
            client.login("a", "pw")  # argon2id, checked by a worker
            client.sendmail("app@example.com", ["user@example.net"],
                            b"Subject: hi\r\nX-Dedupe-Key: mdwe-1\r\n\r\nhello\r\n")
        assert len(list((tmp_path / "maildir" / "new").iterdir())) == 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def auth_file(tmp_path: Path) -> Path:
    """An AUTH file with an argon2 and a bcrypt hash (both libraries load at start)."""
    import argon2
    import bcrypt

    path = tmp_path / "users"
    path.write_text(f"a:{argon2.PasswordHasher().hash('pw')}\n"
                    f"b:{bcrypt.hashpw(b'pw', bcrypt.gensalt(4)).decode()}\n")
    return path
