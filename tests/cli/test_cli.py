"""The command line as an operator runs it: a real `dedup-relay` process, real sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.cli import EXAMPLE_CONFIG, run_cli, smtp_send, start_relay, wait_for_port
from tests.support.clients import message
from tests.support.net import free_port, maildir_files


def test_serve_with_defaults_delivers_once(serve: tuple[int, int, subprocess.Popen[str]],
                                           tmp_path: Path) -> None:
    """`dedup-relay serve` with no --store uses the embedded SQLite file and dedups sends."""
    port, metrics_port, proc = serve
    first = smtp_send(port, message(key="CLI-1"))
    second = smtp_send(port, message(key="CLI-1"))
    assert first[0] == 250
    assert second[0] == 250 and b"suppressed" in second[1]
    files = maildir_files(tmp_path / "maildir")
    assert len(files) == 1
    assert b"Delivered-To: user@example.net\r\n" in files[0]
    assert b"X-Dedupe-Key: CLI-1" in files[0]
    assert (tmp_path / "data" / "dedup-relay.db").is_file()
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
    body = scrape.read().decode()
    assert 'relay_messages_total{result="relayed"} 1.0' in body
    assert 'relay_messages_total{result="suppressed"} 1.0' in body
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    log = proc.stderr.read() if proc.stderr else ""
    assert "embedded sqlite" in log
    assert "user@example.net" not in log  # recipients are masked in logs by default


def test_fingerprints_survive_a_restart(tmp_path: Path) -> None:
    """The embedded store is a file: after a restart the same message is still suppressed."""
    for expected_files in (1, 1):
        port = free_port()
        proc = start_relay(tmp_path, port, "maildir:md")
        try:
            wait_for_port(port, proc)
            assert smtp_send(port, message(key="RESTART-1"))[0] == 250
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=90)  # waits, and closes the pipes
        assert len(maildir_files(tmp_path / "md")) == expected_files


def test_check_config_accepts_the_example_file(tmp_path: Path) -> None:
    """The shipped example config is valid."""
    result = run_cli("check-config", "--config", str(EXAMPLE_CONFIG), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "configuration ok" in result.stdout


def test_example_config_names_every_setting() -> None:
    """The README calls the example file the list of every setting: each field is in it
    (set, or commented out for the optional secrets and paths)."""
    import re
    import tomllib

    from relay.settings import Settings

    text = EXAMPLE_CONFIG.read_text()
    named = (set(tomllib.loads(text)) | set(re.findall(r"^#\s*([a-z_]+)\s*=", text, re.M))
             | set(re.findall(r"^#\s*\[\[([a-z_]+)\]\]", text, re.M)))
    assert set(Settings.model_fields) - named == set()


def test_check_config_rejects_a_lease_too_short_to_renew(tmp_path: Path) -> None:
    """check-config exits 78 (EX_CONFIG) and names both settings, as flag and env var, when a
    lease lapses before two renewals."""
    result = run_cli("check-config", "--upstream", "127.0.0.1:25", "--lease", "5",
                     cwd=tmp_path, env={"RELAY_STORE_TIMEOUT": "2"})
    assert result.returncode == 78
    assert "lease (5 s) must be at least three times store_timeout (2 s)" in result.stderr
    assert "--lease, RELAY_LEASE" in result.stderr
    assert "--store-timeout, RELAY_STORE_TIMEOUT" in result.stderr


def test_check_config_takes_a_lease_shorter_than_the_upstream_timeout(tmp_path: Path) -> None:
    """A lease shorter than the upstream timeout is valid: a working attempt renews it."""
    result = run_cli("check-config", "--upstream", "127.0.0.1:25", "--lease", "60",
                     "--upstream-timeout", "600", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_check_config_requires_an_upstream(tmp_path: Path) -> None:
    """Without --upstream (or RELAY_UPSTREAM) check-config exits 78 saying upstream is missing."""
    result = run_cli("check-config", cwd=tmp_path)
    assert result.returncode == 78
    assert "upstream: required (--upstream, RELAY_UPSTREAM or `upstream` in the file)" in (
        result.stderr)


def test_env_vars_and_flags_priority(tmp_path: Path) -> None:
    """RELAY_ env vars are read, and a flag beats the env var."""
    env = {"RELAY_UPSTREAM": "maildir:from-env", "RELAY_STORE": "redis://127.0.0.1:6379/0"}
    by_env = run_cli("check-config", cwd=tmp_path, env=env)
    assert by_env.returncode == 0, by_env.stderr
    assert "upstream maildir:from-env" in by_env.stdout
    by_flag = run_cli("check-config", "--upstream", "maildir:from-flag", cwd=tmp_path, env=env)
    assert "upstream maildir:from-flag" in by_flag.stdout


def test_check_config_rejects_a_bad_store_url(tmp_path: Path) -> None:
    """A store URL of another scheme is refused with a readable message."""
    result = run_cli("check-config", "--upstream", "maildir:x", "--store", "mysql://h/db",
                     cwd=tmp_path)
    assert result.returncode == 78
    assert "store must be one of: redis://, rediss://, redis+cluster://" in result.stderr
    assert "; sqlite:///PATH" in result.stderr and "; postgresql://" in result.stderr


def test_check_config_names_an_unknown_file_key_as_written(tmp_path: Path) -> None:
    """A misspelt key in the TOML file is named as written and called unknown."""
    (tmp_path / "relay.toml").write_text('upstream = "maildir:x"\nlisten_port = 25\n')
    result = run_cli("check-config", "--config", "relay.toml", cwd=tmp_path)
    assert result.returncode == 78
    assert "listen_port: unknown setting" in result.stderr


@pytest.mark.parametrize(("setting", "value"), [
    ("RELAY_DEDUPE_HEADERS", "X-Dedupe-Key,X-Clé"), ("RELAY_TEMPLATE_HEADERS", "X-Modèle"),
    ("RELAY_DEDUPE_HEADERS", "X Dedupe Key"), ("RELAY_TEMPLATE_HEADERS", "X-Template:"),
])
def test_a_header_name_that_is_no_field_name_is_refused_at_start_up(
        tmp_path: Path, setting: str, value: str) -> None:
    """A key or template header name that is no RFC 5322 field name (non-ASCII, a blank, a
    colon) stops check-config and serve with exit 78 and the setting's name, no traceback."""
    for command in ("check-config", "serve"):
        result = run_cli(command, "--upstream", "maildir:md", "--metrics-listen", "off",
                         "--listen", "127.0.0.1:0", cwd=tmp_path, env={setting: value})
        assert result.returncode == 78, result
        assert setting.removeprefix("RELAY_").lower() in result.stderr
        assert "not an RFC 5322 header field name" in result.stderr
        assert "Traceback" not in result.stderr


def test_a_misspelt_env_var_is_warned_about(tmp_path: Path) -> None:
    """RELAY_UPSTREM_TLS is no setting: said on stderr instead of silently ignored."""
    result = run_cli("check-config", "--upstream", "maildir:x", cwd=tmp_path,
                     env={"RELAY_UPSTREM_TLS": "tls"})
    assert result.returncode == 0
    assert "RELAY_UPSTREM_TLS is not a setting and is ignored" in result.stderr


def test_check_config_hides_every_store_password(tmp_path: Path) -> None:
    """Neither the userinfo password nor a sentinel_password query parameter is printed."""
    url = "redis+sentinel://u:userpw@s1:26379,s2:26379/mymaster?sentinel_password=topsecret"
    result = run_cli("check-config", "--upstream", "maildir:x", "--store", url, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "userpw" not in result.stdout and "topsecret" not in result.stdout
    assert "sentinel_password=***" in result.stdout


@pytest.mark.parametrize(("args", "code", "message_part"), [
    (("--upstream-user", "u", "--upstream-password-file", "missing-file"), 78,
     "upstream_password_file: No such file or directory: missing-file"),
    (("--store", "sqlite:///not-a-db.txt"), 78, "not-a-db.txt is not a SQLite database"),
    (("--listen", "192.0.2.77:2525"), 69, "cannot start: cannot listen on 192.0.2.77:2525"),
])
def test_serve_start_up_mistakes_are_one_readable_line(
        tmp_path: Path, args: tuple[str, ...], code: int, message_part: str) -> None:
    """A missing password file, a store that is no database: exit 78 (EX_CONFIG); an address
    not on this host: exit 69 (EX_UNAVAILABLE); one readable line, no traceback."""
    (tmp_path / "not-a-db.txt").write_text("plain text, not sqlite\n" * 100)
    result = run_cli("serve", "--upstream", "maildir:md", "--metrics-listen", "off", *args,
                     cwd=tmp_path)
    assert result.returncode == code, result
    assert message_part in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_on_a_port_in_use_is_one_readable_line(tmp_path: Path) -> None:
    """Another process holds the SMTP port: exit 69 (EX_UNAVAILABLE), 'already in use' and the
    setting's flag and env var, no traceback."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_cli("serve", "--upstream", "maildir:md", "--metrics-listen", "off",
                         "--listen", f"127.0.0.1:{port}", cwd=tmp_path)
    assert result.returncode == 69, result
    assert "cannot start" in result.stderr and "in use" in result.stderr
    assert "(--listen, RELAY_LISTEN" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_signal_during_a_slow_start_stops_the_relay(tmp_path: Path) -> None:
    """SIGINT while the store does not answer yet: the relay stops instead of starting."""
    import socket

    with socket.socket() as silent:  # accepts connections, never answers: a hung Redis
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        env["RELAY_STORE_TIMEOUT"] = "30"
        smtp_port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "serve", "--upstream", "maildir:md",
             "--metrics-listen", "off", "--listen", f"127.0.0.1:{smtp_port}",
             "--store", f"redis://127.0.0.1:{silent.getsockname()[1]}/0"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            # the start-up store check is waiting once the relay connected to the store (a
            # fixed sleep was shorter than the imports on a loaded runner: SIGINT came first)
            silent.settimeout(80)
            store_conn, _ = silent.accept()
            assert proc.poll() is None
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=30)
            store_conn.close()
        finally:
            if proc.poll() is None:
                proc.kill()
            log = proc.communicate()[1]  # the rest of stderr; closes the pipes
    assert code == 0, log
    assert "signal received during start-up" in log
    assert "listening on" not in log


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("rediss://h:6380/0?password=x&ssl_cert_reqs=none",
     "rediss://h:6380/0?password=***&ssl_cert_reqs=none"),
    ("redis+sentinel://u:p@s1:1,s2:2/m?sentinel_password=t",
     "redis+sentinel://u:***@s1:1,s2:2/m?sentinel_password=***"),
    ("sqlite:////abs/x.db", "sqlite:////abs/x.db"),
    ("postgresql://relay@db:5432/audit", "postgresql://relay@db:5432/audit"),
    ("postgresql://relay:s3cret@db:5432/audit", "postgresql://relay:***@db:5432/audit"),
])
def test_redact_url_hides_passwords(url: str, shown: str) -> None:
    """Store URLs in logs and check-config output carry no password."""
    from relay.settings import redact_url

    assert redact_url(url) == shown


def test_redact_url_shows_where_a_relative_sqlite_file_is(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The default store is relative to the working directory: the log names the real file."""
    from relay.settings import redact_url

    monkeypatch.chdir(tmp_path)
    assert redact_url("sqlite:///data/dedup-relay.db") == f"sqlite:///{tmp_path}/data/dedup-relay.db"


def test_healthcheck_asks_healthz_or_the_smtp_greeting(
        serve: tuple[int, int, subprocess.Popen[str]], tmp_path: Path) -> None:
    """The image's HEALTHCHECK: 0 against a serving relay (metrics on, or off: SMTP 220),
    1 when nothing answers."""
    port, metrics_port, _ = serve
    by_metrics = run_cli("healthcheck", "--metrics-listen", f"0.0.0.0:{metrics_port}",
                         cwd=tmp_path)
    assert by_metrics.returncode == 0, by_metrics.stderr
    by_smtp = run_cli("healthcheck", "--metrics-listen", "off", "--listen",
                      f"127.0.0.1:{port}", cwd=tmp_path)
    assert by_smtp.returncode == 0, by_smtp.stderr
    nobody = run_cli("healthcheck", "--metrics-listen", f"127.0.0.1:{free_port()}",
                     cwd=tmp_path)
    assert nobody.returncode == 1 and "not healthy" in nobody.stderr
