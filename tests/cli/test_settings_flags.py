"""Every setting is a flag of `serve` and `check-config`, generated from the settings object,
with its description, default and env var in `--help`; a configuration error names flags and
env vars that exist; the exit codes are one named table shown in `--help`."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from pydantic import SecretStr

from relay.cli.exit_codes import ExitCode
from relay.cli.group import main
from relay.cli.options import SettingsCommand, load, settings_options
from relay.settings import FILE_ONLY_SETTINGS, Settings, UpstreamEntry, env_name, flag_name

# one valid value other than the default for every setting, as an operator types it, and
# what the settings then hold (a bool flag takes no value: None here)
SAMPLES: dict[str, tuple[str | None, object]] = {
    "listen": ("127.0.0.1:2600", "127.0.0.1:2600"),
    "hostname": ("relay.test", "relay.test"),
    "max_message_size": ("2048", 2048),
    "max_recipients": ("7", 7),
    "client_timeout": ("11", 11.0),
    "data_deadline": ("12.5", 12.5),
    "session_lifetime": ("13", 13.0),
    "max_idle_commands": ("14", 14),
    "bare_newline": ("reject", "reject"),
    "add_message_id": (None, False),  # --no-add-message-id
    "in_flight_wait": ("2.5", 2.5),
    "allowed_networks": ("10.0.0.0/8, 192.168.0.0/16", ("10.0.0.0/8", "192.168.0.0/16")),
    "allowed_senders": ("*@example.com", ("*@example.com",)),
    "max_connections": ("15", 15),
    "max_connections_per_ip": ("3", 3),
    "tls_cert": ("cert.pem", Path("cert.pem")),
    "tls_key": ("key.pem", Path("key.pem")),
    "tls_listen": ("127.0.0.1:4650", "127.0.0.1:4650"),
    "tls_min_version": ("TLSv1.3", "TLSv1.3"),
    "tls_handshake_timeout": ("4", 4.0),
    "tls_required": (None, True),
    "auth_file": ("users", Path("users")),
    "auth_required": (None, True),
    "auth_failure_delay": ("0.5", 0.5),
    "auth_max_failures": ("9", 9),
    "auth_failure_window": ("60", 60.0),
    "proxy_protocol": (None, True),
    "proxy_networks": ("10.1.0.0/16", ("10.1.0.0/16",)),
    "proxy_protocol_timeout": ("2.5", 2.5),
    "upstream": ("smtp.example.com:587", (UpstreamEntry(address="smtp.example.com:587"),)),
    "upstream_tls": ("starttls", "starttls"),
    "upstream_verify": (None, False),  # --no-upstream-verify
    "upstream_helo_name": ("mail.example.org", "mail.example.org"),
    "upstream_user": ("relay@example.com", "relay@example.com"),
    "upstream_password_file": ("pw.txt", Path("pw.txt")),
    "upstream_password": ("hunter2", "hunter2"),  # not with the file: a second invocation
    "upstream_timeout": ("601", 601.0),
    "upstream_command_timeout": ("61", 61.0),
    "upstream_connect_timeout": ("31", 31.0),
    "upstream_pool_size": ("0", 0),
    "workers": ("3", 3),
    "event_loop": ("asyncio", "asyncio"),
    "upstream_pool_idle": ("32", 32.0),
    "upstream_pool_max_messages": ("5", 5),
    "upstream_cooldown": ("5", 5.0),
    "upstream_cooldown_max": ("60", 60.0),
    "upstream_ca_file": ("ca.pem", Path("ca.pem")),
    "upstream_client_cert": ("client.pem", Path("client.pem")),
    "upstream_client_key": ("client.key", Path("client.key")),
    "upstream_auth": ("xoauth2", "xoauth2"),
    "oauth_provider": ("microsoft", "microsoft"),
    "oauth_token_url": ("https://127.0.0.1:8443/tenant/oauth2/v2.0/token",
                        "https://127.0.0.1:8443/tenant/oauth2/v2.0/token"),
    "oauth_client_id": ("relay-app", "relay-app"),
    "oauth_client_secret_file": ("secret.txt", Path("secret.txt")),
    "oauth_refresh_token_file": ("refresh.txt", Path("refresh.txt")),
    "oauth_scope": ("https://mail.google.com/", "https://mail.google.com/"),
    "oauth_ca_file": ("oauth-ca.pem", Path("oauth-ca.pem")),
    "oauth_certificate_file": ("entra.pem", Path("entra.pem")),
    "oauth_federated_token_file": ("federated.jwt", Path("federated.jwt")),
    "oauth_managed_identity": ("system", "system"),
    "oauth_service_account_file": ("google.json", Path("google.json")),
    "store": ("redis://127.0.0.1:6379/3", "redis://127.0.0.1:6379/3"),
    "store_prefix": ("app:fp:", "app:fp:"),
    "store_key_format": ("compact", "compact"),
    "store_timeout": ("3", 3.0),
    "dedup_window": ("7200", 7200.0),
    "lease": ("120", 120.0),
    "dedupe_headers": ("X-Key", ("X-Key",)),
    "template_headers": ("X-Tpl,X-Template", ("X-Tpl", "X-Template")),
    "max_key_chars": ("64", 64),
    "local_part_case_sensitive": (None, True),
    "fingerprint_secret": ("s3cret", "s3cret"),
    "fingerprint_secret_file": ("secret.txt", Path("secret.txt")),
    "fingerprint_secret_previous": ("0ld", "0ld"),
    "fingerprint_secret_previous_file": ("previous.txt", Path("previous.txt")),
    "missing_key": ("reject", "reject"),
    "strip_dedupe_headers": (None, True),
    "scope_by_auth": (None, True),
    "unknown_policy": ("hold", "hold"),
    "store_down": ("fail_open", "fail_open"),
    "dsn_on_partial_failure": (None, False),  # --no-dsn-on-partial-failure
    "metrics_listen": ("127.0.0.1:9800", "127.0.0.1:9800"),
    "health_interval": ("2", 2.0),
    "log_level": ("DEBUG", "DEBUG"),
    "log_format": ("text", "text"),
    "log_recipients": (None, True),
    "shutdown_grace": ("5", 5.0),
    "settle_journal": ("", ""),
    "duplicate_reply": ("550", "550"),
    "mode": ("shadow", "shadow"),
    "key_reuse": ("reject", "reject"),
    "pid_file": ("relay.pid", "relay.pid"),
    "ledger": ("postgresql://relay@db:5432/audit", "postgresql://relay@db:5432/audit"),
    "ledger_required": (None, True),
    "ledger_queue": ("50", 50),
    "ledger_retention": ("86400", 86400.0),
    "ledger_recipients": ("full", "full"),
    "ledger_keys": ("plain", "plain"),
    "in_doubt_alert_after": ("600", 600.0),
    "reconcile_interval": ("30", 30.0),
    "reconcile_give_up": ("7200", 7200.0),
    "console_listen": ("127.0.0.1:8725", "127.0.0.1:8725"),
    "console_auth_file": ("console-users", Path("console-users")),
    "console_tls_cert": ("console.pem", Path("console.pem")),
    "console_tls_key": ("console.key", Path("console.key")),
    "console_plain_http": (None, True),
    "console_session_timeout": ("600", 600.0),
    "console_url": ("https://relay-console.example.com/", "https://relay-console.example.com"),
}
SECOND_RUN = {"upstream_password", "fingerprint_secret_file",  # each excludes another setting
              "fingerprint_secret_previous_file", "console_plain_http"}
# the OAuth2 credentials exclude each other (and the microsoft provider of the first run takes
# neither the refresh token nor a service account): one run each, with its provider
OAUTH_RUNS: list[tuple[set[str], list[str]]] = [
    ({"oauth_refresh_token_file", "oauth_client_secret_file"}, []),
    ({"oauth_federated_token_file"}, ["--oauth-provider", "microsoft"]),
    ({"oauth_managed_identity"}, ["--oauth-provider", "microsoft"]),
    ({"oauth_service_account_file"}, ["--oauth-provider", "google"]),
]


def _argv(names: set[str]) -> list[str]:
    argv: list[str] = []
    for name in sorted(names):
        given, expected = SAMPLES[name]
        if given is None:  # a bool: --x for true, --no-x for false
            argv.append(flag_name(name) if expected else f"--no-{flag_name(name)[2:]}")
        else:
            argv += [flag_name(name), given]
    return argv


def _parsed(argv: list[str]) -> Settings:
    """The settings a command with the generated flags builds from ``argv`` (real click
    parsing, real validation; no env var or file involved)."""
    got: list[Settings] = []

    @click.command(cls=SettingsCommand)
    @settings_options
    def probe(config_file: Path | None, **flags: Any) -> None:
        got.append(load(config_file, flags))

    result = CliRunner().invoke(probe, argv, env={k: None for k in os.environ
                                                  if k.startswith("RELAY_")})
    assert result.exit_code == 0, result.output
    return got[0]


def test_every_setting_has_a_sample() -> None:
    """A new setting needs a row here (and then has its flag checked below)."""
    assert set(SAMPLES) == set(Settings.model_fields) - FILE_ONLY_SETTINGS


def test_every_setting_reaches_the_settings_through_its_flag() -> None:
    """Each generated flag sets its own field, as typed on the command line (several runs: the
    password file and the password itself exclude each other, as the OAuth2 credentials
    do)."""
    oauth = {name for names, _ in OAUTH_RUNS for name in names}
    runs = [(set(SAMPLES) - SECOND_RUN - oauth, []), (SECOND_RUN | {"upstream"}, []),
            *((names | {"upstream"}, extra) for names, extra in OAUTH_RUNS)]
    for names, extra in runs:
        settings = _parsed(_argv(names) + extra)
        for name in names:
            value = getattr(settings, name)
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            assert value == SAMPLES[name][1], name


def _help(*command: str) -> str:
    result = CliRunner().invoke(main, [*command, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())  # click wraps lines: compare the words


@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_help_shows_every_flag_with_its_default_and_env_var(command: str) -> None:
    """`serve --help` and `check-config --help` list a flag for every setting, with the field's
    description, its default (or "required") and its RELAY_ env var."""
    text = _help(command)
    squeezed = "".join(text.split())  # click also breaks lines after a hyphen
    for name, field in Settings.model_fields.items():
        if name in FILE_ONLY_SETTINGS:  # a table: no flag
            assert f"{flag_name(name)} " not in text, name
            continue
        assert f"{flag_name(name)} " in text, name
        assert "".join(str(field.description).split()) in squeezed, name
        assert f"; env: {env_name(name)}]" in text, name
    assert "[default: 900; env: RELAY_LEASE]" in text
    assert "[required; env: RELAY_UPSTREAM]" in text
    assert "--tls-required / --no-tls-required" in text
    assert "[default: this host's FQDN; env: RELAY_HOSTNAME]" in text


def test_the_flags_of_earlier_releases_still_exist() -> None:
    """The README, scripts and black-box checks use these names: none is renamed."""
    text = _help("serve")
    for flag in ("--listen", "--upstream", "--upstream-tls", "--upstream-user",
                 "--upstream-password-file", "--store", "--metrics-listen", "--upstream-timeout",
                 "--data-deadline", "--dedup-window", "--lease", "--log-format",
                 "--shutdown-grace", "--tls-cert", "--tls-key", "--tls-listen", "--auth-file",
                 "--allowed-networks", "--config"):
        assert f"{flag} " in text, flag


def _flags_of(text: str) -> set[str]:
    return set(re.findall(r"--[a-z][a-z-]+", text))


@pytest.mark.parametrize(("args", "env"), [
    (("--lease", "-1"), {}),
    (("--lease", "abc"), {}),
    (("--lease", "4"), {}),  # a rule between settings: lease >= 3 x store_timeout
    (("--dedup-window", "60"), {}),  # a rule: the window not shorter than the lease
    (("--unknown-policy", "later"), {}),
    (("--upstream-tls", "ssl"), {}),
    (("--tls-required",), {}),  # needs tls_cert and tls_key
    (("--auth-required",), {}),  # needs auth_file
    ((), {"RELAY_MAX_RECIPIENTS": "many"}),
    ((), {"RELAY_STORE_TIMEOUT": "400"}),  # the rule again, set from the environment
    (("--metrics-listen", "9725"), {}),
    (("--tls-cert", "missing.pem", "--tls-key", "missing.key"), {}),  # checked files
])
def test_a_configuration_error_names_flags_that_exist(
        tmp_path: Path, args: tuple[str, ...], env: dict[str, str]) -> None:
    """Exit 78 (EX_CONFIG); every flag the message names is one `serve --help` lists and
    every env var one the settings read (none named `--settings` or `RELAY_SETTINGS`)."""
    known_flags = _flags_of(_help("serve"))
    known_env = {env_name(n) for n in Settings.model_fields} | {"RELAY_CONFIG"}
    result = CliRunner().invoke(main, ["check-config", "--upstream", "maildir:md", *args],
                                env={**{k: None for k in os.environ if k.startswith("RELAY_")},
                                     **env})
    assert result.exit_code == ExitCode.CONFIG, result.output
    named = _flags_of(result.stderr)
    assert named, result.stderr
    assert named <= known_flags, named - known_flags
    assert set(re.findall(r"RELAY_[A-Z_]+", result.stderr)) <= known_env, result.stderr


def test_exit_codes_are_one_table_shown_in_help() -> None:
    """The sysexits numbers where they apply; the table is in the group's and each command's
    `--help`."""
    assert (ExitCode.CONFIG, ExitCode.UNAVAILABLE) == (os.EX_CONFIG, os.EX_UNAVAILABLE)
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4, 69, 78]
    for command in ((), ("serve",), ("check-config",), ("inspect",), ("release",)):
        text = _help(*command)
        assert "Exit codes: 0 ok 1 not found" in text, command
        assert "69 cannot start" in text and "78 invalid configuration" in text, command


def test_a_flag_the_command_does_not_have_is_a_usage_error(tmp_path: Path) -> None:
    """Exit 2 (usage), not 78: the settings were never read."""
    result = CliRunner().invoke(main, ["check-config", "--upstream", "maildir:md", "--lease-s",
                                       "60"])
    assert result.exit_code == ExitCode.USAGE
    assert "No such option" in result.output


def test_the_docs_list_the_same_exit_codes() -> None:
    """The exit-code table of docs/configuration.md has one row per ExitCode, no more."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    section = page.split("## Exit codes", 1)[1].split("\n#", 1)[0]
    assert [int(c) for c in re.findall(r"^\| `(\d+)` \|", section, re.M)] == [
        int(c) for c in ExitCode]
