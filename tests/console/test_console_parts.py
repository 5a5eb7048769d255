"""The console's rules one by one: its settings (what it needs, when it may serve plain
HTTP), the users file with roles and `hash-password --role`, sessions (idle time, the longest
life, a reload's removals), and the export's cells, dates and the sign-in's next page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from relay.console.errors import ConsoleError
from relay.console.export import csv_cell, parse_instant
from relay.console.sessions import MAX_AGE_S, MAX_PER_USER, Sessions
from relay.console.signin import local_path
from relay.console.times import age_words, when
from relay.core.errors import ConfigError
from relay.credentials import CredentialFile, format_entry
from relay.settings import CONSOLE_ROLES, load_settings
from tests.support.cli import run_cli
from tests.support.console import users_file

BCRYPT = "$2b$04$" + "a" * 53  # a well-formed bcrypt hash (never checked here)


def settings(**values: Any) -> Any:
    return load_settings({"upstream": "maildir:md", **values})


@pytest.mark.parametrize(("values", "refused"), [
    ({"console_listen": "127.0.0.1:8725"}, "needs console_auth_file"),
    ({"console_listen": "0.0.0.0:8725", "console_auth_file": "u"}, "passwords would cross"),
    ({"console_listen": "127.0.0.1:8725", "console_auth_file": "u",
      "console_tls_cert": "c.pem"}, "go together"),
    ({"console_listen": "127.0.0.1:9725", "console_auth_file": "u"}, "one address"),
    ({"console_listen": "127.0.0.1:x", "console_auth_file": "u"}, "console_listen"),
    ({"console_listen": "127.0.0.1:8725", "console_auth_file": "u", "console_tls_cert": "c",
      "console_tls_key": "k", "console_plain_http": True}, "contradict"),
])
def test_settings_a_console_refuses(values: dict[str, str], refused: str) -> None:
    """Each rule: the users file is needed; off this host without a certificate is refused;
    a certificate needs its key; another listener's address is taken (metrics on 9725); the
    address is HOST:PORT; plain HTTP and a certificate of its own exclude each other."""
    with pytest.raises(ConfigError, match=refused):
        settings(**values)


@pytest.mark.parametrize(("values", "certificate"), [
    ({"console_listen": "127.0.0.1:8725"}, None),
    ({"console_listen": "localhost:8725"}, None),
    ({"console_listen": "0.0.0.0:8725", "console_plain_http": True}, None),
    ({"console_listen": "0.0.0.0:8725", "tls_cert": "l.pem", "tls_key": "l.key"},
     (Path("l.pem"), Path("l.key"))),
    ({"console_listen": "0.0.0.0:8725", "tls_cert": "l.pem", "tls_key": "l.key",
      "console_tls_cert": "c.pem", "console_tls_key": "c.key"},
     (Path("c.pem"), Path("c.key"))),
    ({"console_listen": "127.0.0.1:8725", "tls_cert": "l.pem", "tls_key": "l.key",
      "console_plain_http": True}, None),
])
def test_the_certificate_a_console_serves(values: dict[str, Any],
                                          certificate: tuple[Path, Path] | None) -> None:
    """Plain HTTP on loopback or when asked; else its own certificate, or the listener's."""
    assert settings(console_auth_file="u", **values).console_certificate == certificate


def test_the_console_is_off_by_default() -> None:
    s = settings()
    assert s.console_address is None
    assert settings(console_listen="off").console_address is None


@pytest.mark.parametrize(("line", "problem"), [
    (f"ann:{BCRYPT}", "expected username:hash:role"),
    (f"ann:{BCRYPT}:", "expected username:hash:role"),
    (f"ann:{BCRYPT}:admin", "unknown role 'admin'"),
    ("ann:not-a-hash:viewer", "neither bcrypt"),
])
def test_a_users_file_with_roles_refuses(tmp_path: Path, line: str, problem: str) -> None:
    """A console users file line without a role, with an empty or unknown one, or with a bad
    hash is refused naming the line; the message never quotes the hash."""
    path = tmp_path / "users"
    path.write_text(f"# console users\n{line}\n")
    with pytest.raises(ConfigError, match=problem) as caught:
        CredentialFile.load(path, roles=CONSOLE_ROLES)
    assert "line 2" in str(caught.value) and BCRYPT not in str(caught.value)


def test_an_smtp_users_file_refuses_a_console_line(tmp_path: Path) -> None:
    """A console line in the SMTP users file is refused (its hash would hold ':role')."""
    path = tmp_path / "users"
    path.write_text(format_entry("ann", BCRYPT, "viewer") + "\n")
    with pytest.raises(ConfigError, match="malformed"):
        CredentialFile.load(path)


def test_roles_are_read_per_user(tmp_path: Path) -> None:
    users = CredentialFile.load(users_file(tmp_path), roles=CONSOLE_ROLES)
    assert (users.role("vera"), users.role("otto"), users.role("nobody")) == (
        "viewer", "operator", None)


def test_hash_password_with_a_role_writes_a_console_line(tmp_path: Path) -> None:
    """`hash-password --role operator` prints `user:hash:operator`, which the console's users
    file takes; an unknown role is a usage error."""
    done = run_cli("hash-password", "--user", "alice", "--role", "operator",
                   "--password-stdin", "--scheme", "bcrypt", cwd=tmp_path,
                   input_text="s3cret-pw\n")
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("alice:$2b$") and line.endswith(":operator")
    (tmp_path / "users").write_text(line + "\n")
    assert CredentialFile.load(tmp_path / "users", roles=CONSOLE_ROLES).role("alice") \
        == "operator"
    wrong = run_cli("hash-password", "--user", "alice", "--role", "admin", "--password-stdin",
                    cwd=tmp_path, input_text="s3cret-pw\n")
    assert wrong.returncode == 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_ends_when_idle_and_at_its_longest_life() -> None:
    """A session lives while requests come within ``idle_s``; one idle longer is gone (and
    said to have expired); an active one still ends after MAX_AGE_S; an unknown token finds
    nothing."""
    clock = Clock()
    sessions = Sessions(idle_s=60, clock=clock)
    token, _ = sessions.start("vera", "viewer")
    clock.now += 59
    assert sessions.find(token)[0] is not None
    clock.now += 61
    assert sessions.find(token) == (None, True)
    assert sessions.find(token) == (None, False)
    active, _ = sessions.start("otto", "operator")
    while clock.now < 1000 + 120 + MAX_AGE_S - 30:
        clock.now += 30
        assert sessions.find(active)[0] is not None
    clock.now += 60
    assert sessions.find(active)[0] is None
    assert sessions.find("guess")[0] is None and sessions.find(None)[0] is None


def test_sessions_are_bounded_and_a_reload_ends_the_removed_users() -> None:
    """Past ``max_sessions`` the least recently used ends; keep_only ends the sessions a
    reload's users file no longer allows."""
    sessions = Sessions(idle_s=60, clock=Clock(), max_sessions=2)
    first, _ = sessions.start("a", "viewer")
    second, _ = sessions.start("b", "viewer")
    sessions.find(first)
    third, _ = sessions.start("c", "operator")
    assert [sessions.find(t)[0] is not None for t in (first, second, third)] == [
        True, False, True]
    sessions.keep_only(lambda s: s.role == "operator")
    assert sessions.find(first)[0] is None and sessions.find(third)[0] is not None


@pytest.mark.parametrize(("value", "cell"), [
    ("=SUM(A1)", "'=SUM(A1)"), ("+1", "'+1"), ("-1", "'-1"), ("@cmd", "'@cmd"),
    ("\tx", "'\tx"), ("250 ok", "250 ok"), (None, ""), ("", ""),
    (datetime(2026, 12, 5, 14, 30, tzinfo=UTC), "2026-12-05T14:30:00.000Z"),
])
def test_a_csv_cell(value: object, cell: str) -> None:
    assert csv_cell(value) == cell


@pytest.mark.parametrize(("text", "at"), [
    ("2026-12-05", datetime(2026, 12, 5, tzinfo=UTC)),
    ("2026-12-05T14:30", datetime(2026, 12, 5, 14, 30, tzinfo=UTC)),
    ("2026-12-05T14:30+01:00", datetime(2026, 12, 5, 13, 30, tzinfo=UTC)),
])
def test_a_period_bound(text: str, at: datetime) -> None:
    assert parse_instant(text, what="from") == at


def test_a_period_bound_that_is_no_date() -> None:
    with pytest.raises(ConsoleError, match="no date"):
        parse_instant("yesterday", what="from")


@pytest.mark.parametrize(("target", "kept"), [
    ("/in-doubt", "/in-doubt"), ("/history?rcpt=a%40b", "/history?rcpt=a%40b"),
    ("//evil.example/x", "/history"), ("/\\evil.example", "/history"),
    ("https://evil.example/", "/history"), ("evil", "/history"), ("/\t/evil", "/history"),
    ("/x\r\nSet-Cookie: a=b", "/history"),
])
def test_the_page_after_sign_in_stays_on_the_console(target: str, kept: str) -> None:
    assert local_path(target) == kept


@pytest.mark.parametrize(("before", "after", "restart"), [
    ({}, {"tls_cert": "l.pem", "tls_key": "l.key"}, True),
    ({"console_tls_cert": "c.pem", "console_tls_key": "c.key"},
     {"console_tls_cert": "d.pem", "console_tls_key": "d.key"}, False),
    ({"console_tls_cert": "c.pem", "console_tls_key": "c.key"}, {"console_plain_http": True},
     True),
])
def test_a_reload_that_switches_the_consoles_https_needs_a_restart(
        before: dict[str, Any], after: dict[str, Any], restart: bool) -> None:
    """HTTPS switched on (the listener's certificate now set) or off (plain HTTP asked for)
    needs a restart; another certificate pair is taken live."""
    running = settings(console_listen="127.0.0.1:8725", console_auth_file="u", **before)
    new = settings(console_listen="127.0.0.1:8725", console_auth_file="u", **after)
    assert bool(running.console_restart_needed(new)) is restart


def test_one_user_signing_in_again_and_again_ends_only_their_own_sessions() -> None:
    """Past MAX_PER_USER sessions of one user their least recently used ends; another
    user's session, older than all of them, stays."""
    sessions = Sessions(idle_s=60, clock=Clock())
    theirs, _ = sessions.start("otto", "operator")
    tokens = [sessions.start("vera", "viewer")[0] for _ in range(MAX_PER_USER + 5)]
    assert sessions.find(theirs)[0] is not None
    assert [sessions.find(t)[0] is not None for t in tokens] == [False] * 5 + [
        True] * MAX_PER_USER


@pytest.mark.parametrize(("seconds", "words"), [
    (0, "just now"), (4.9, "just now"), (5, "5 seconds ago"), (61, "1 minute ago"),
    (3 * 3600 + 59, "3 hours ago"), (86400 * 2 + 5, "2 days ago"), (-120, "in 2 minutes"),
])
def test_an_age_in_words(seconds: float, words: str) -> None:
    assert age_words(seconds) == words


def test_every_time_is_shown_one_way() -> None:
    """UTC to the second with its age; the exact instant on hover; a day and a clock that a
    narrow column may put on two lines, never split; none is a dash."""
    at = datetime(2026, 12, 5, 14, 30, 0, 250000, tzinfo=UTC)
    shown = str(when(at, now=at + timedelta(hours=3)))
    assert shown == ('<time datetime="2026-12-05T14:30:00.250000Z" '
                     'title="2026-12-05T14:30:00.250000Z"><span>2026-12-05</span> '
                     '<span>14:30:00 UTC</span></time> <span class="age">(3 hours ago)</span>')
    assert str(when(None)) == "-"


@pytest.mark.parametrize(("value", "kept"), [
    ("https://console.example.com/", "https://console.example.com"),
    ("http://127.0.0.1:8725", "http://127.0.0.1:8725"),
    ("https://ops.example.com/relay/", "https://ops.example.com/relay"),
    ("", None),
])
def test_the_consoles_url_for_log_lines(value: str, kept: str | None) -> None:
    assert settings(console_url=value).console_url == kept


@pytest.mark.parametrize("value", [
    "console.example.com", "ftp://console.example.com", "https://", "https://a.example/?x=1",
    "https://a.example/#top", "https://user:pw@a.example", "https://a.example/a b",
])
def test_a_console_url_that_is_no_base_url_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="console_url"):
        settings(console_url=value)
