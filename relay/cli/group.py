"""The ``dedup-relay`` command group: ``serve``, ``check-config`` and ``healthcheck``
(:mod:`relay.cli.serve`), ``hash-password`` and the admin commands ``fingerprint``,
``inspect``, ``release``, ``mark-sent`` (:mod:`relay.cli.admin`), ``reload``
(:mod:`relay.cli.reload`), ``db upgrade`` (:mod:`relay.cli.db`), ``history`` and ``in-doubt``
(:mod:`relay.cli.ledger`), ``example`` (:mod:`relay.cli.example`), ``explain``
(:mod:`relay.cli.explain`).

The commands only turn flags into settings (:mod:`relay.cli.options`: one flag per setting,
also settable as an env var ``RELAY_<NAME>`` and as a key in the ``--config`` TOML file) and call
:mod:`relay.app` or :mod:`relay.admin`. Exit codes: :class:`relay.cli.exit_codes.ExitCode`.
"""

from __future__ import annotations

import os

import click

from relay import __version__
from relay.cli.admin import register as register_admin_commands
from relay.cli.db import register as register_db_commands
from relay.cli.example import register as register_example_command
from relay.cli.exit_codes import ExitCode, epilog
from relay.cli.explain import register as register_explain_command
from relay.cli.ledger import register as register_ledger_commands
from relay.cli.reload import register as register_reload_command
from relay.cli.serve import register as register_serve_commands

__all__ = ["ExitCode", "main"]


@click.group(epilog=epilog(), context_settings={"max_content_width": 100})
@click.version_option(version=__version__, prog_name="dedup-relay")
def main() -> None:
    """dedup-relay: an SMTP relay that stops duplicate outbound email."""
    private_files()


def private_files() -> None:
    """Make every file this process and its workers create private to its user, whatever the
    umask it was started with: files 0600, directories 0700 at most (the SQLite store and its
    -wal/-shm, the settle journal and its lock, the pid file, the metrics directory and its
    files, a Maildir). The umask is the one place every creation passes through; a
    stricter umask is kept."""
    os.umask(os.umask(0o077) | 0o077)


register_serve_commands(main)
register_admin_commands(main)
register_reload_command(main)
register_db_commands(main)
register_ledger_commands(main)
register_example_command(main)
register_explain_command(main)
