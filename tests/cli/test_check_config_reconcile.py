"""`check-config` on the [[reconcile_source]] tables (relay/settings/reconcile.py): exit 78
with one line naming the problem for a log that cannot be read, a command that cannot run, a
source naming an upstream not configured, two sources with one name, none or two of the
kinds, an empty command, and sources without an audit ledger; exit 0 for a valid set, the
reconciler named in its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import run_cli

LEDGER = 'ledger = "postgresql://relay@127.0.0.1:5432/test"\n'
HEAD = 'upstream = [{ address = "127.0.0.1:2587", name = "mx1" }, "127.0.0.1:2588"]\n'


def _config(tmp_path: Path, sources: str, *, ledger: bool = True) -> Path:
    log = tmp_path / "mail.log"
    log.write_text("")
    path = tmp_path / "relay.toml"
    text = HEAD + (LEDGER if ledger else "") + sources.format(log=log, dir=tmp_path)
    path.write_text(text)
    return path


def _source(name: str, body: str) -> str:
    return f'\n[[reconcile_source]]\nname = "{name}"\n{body}\n'


CASES = {
    "a log that does not exist": (
        _source("a", 'postfix_log = "{dir}/nope.log"'), "cannot read the log"),
    "a log that is a directory": (_source("a", 'exim_log = "{dir}"'), "cannot read the log"),
    "a command that is not there": (
        _source("a", 'command = ["{dir}/no-such-script"]'), "not found or not executable"),
    "an empty command": (_source("a", "command = []"), "command is empty"),
    "an upstream not configured": (
        _source("a", 'postfix_log = "{log}"\nupstreams = ["mx9"]'),
        "speaks for mx9, not in the upstream list"),
    "two sources with one name": (
        _source("a", 'postfix_log = "{log}"') + _source("a", 'exim_log = "{log}"'),
        "two sources have this name"),
    "no kind": (_source("a", 'upstreams = ["mx1"]'), "set exactly one of"),
    "two kinds": (
        _source("a", 'postfix_log = "{log}"\ncommand = ["/bin/true"]'),
        "got postfix_log, command"),
}


@pytest.mark.parametrize(("sources", "says"), list(CASES.values()), ids=list(CASES))
def test_check_config_refuses(tmp_path: Path, sources: str, says: str) -> None:
    done = run_cli("check-config", "--config", str(_config(tmp_path, sources)), cwd=tmp_path)
    assert done.returncode == 78, done
    assert says in done.stderr and "reconcile_source" in done.stderr, done.stderr


def test_sources_without_a_ledger_are_refused(tmp_path: Path) -> None:
    """The in-doubt list is the ledger's: no ledger, no reconciler, and check-config says
    why."""
    config = _config(tmp_path, _source("a", 'postfix_log = "{log}"'), ledger=False)
    done = run_cli("check-config", "--config", str(config), cwd=tmp_path)
    assert done.returncode == 78 and "no ledger is" in done.stderr, done


def test_a_valid_set_of_sources_is_accepted(tmp_path: Path) -> None:
    """A Postfix log for mx1 (by name), an Exim log for the other (by address) and a command
    for both: exit 0, the reconciler's interval and sources in the line."""
    sources = (_source("pf", 'postfix_log = "{log}"\nupstreams = ["mx1"]')
               + _source("ex", 'exim_log = "{log}"\nupstreams = ["127.0.0.1:2588"]')
               + _source("cmd", 'command = ["/bin/true", "--flag"]'))
    done = run_cli("check-config", "--reconcile-interval", "30", "--config",
                   str(_config(tmp_path, sources)), cwd=tmp_path)
    assert done.returncode == 0, done
    assert "reconciling every 30 s from pf, ex, cmd" in done.stdout, done.stdout
