"""Admin commands: ``dedup-relay fingerprint``, ``inspect``, ``release`` and ``mark-sent``
(design.md §6.5), ``stats`` (records by state), and ``hash-password`` for the credentials
file.

They read the relay's own settings (``--config``, ``RELAY_*`` env vars, ``--store``), so the
key they compute is the one the relay uses; the upstream is not needed. Those that read the
store say which one on stderr first (``store: URL (kind), prefix P``). ``--store-key`` must
start with the relay's ``store_prefix`` (a store shared with an application holds its keys
too). Exit codes (:class:`relay.cli.exit_codes.ExitCode`): 0 done, 1 nothing done (inspect:
absent; release: nothing deleted; release, mark-sent: the record changed since it was read,
said on stderr), 2 bad input, 3 the store failed, 4 refused: the record is in
flight (``--force``), 78 invalid configuration.

With an audit ledger configured (``--ledger``, ``RELAY_LEDGER`` or ``ledger`` in the file),
``release`` and ``mark-sent`` also write their row there (:mod:`relay.cli.ledger` reads them):
the ledger must answer, with its schema current, before the store is touched (else exit 3 and
nothing done: an operator's action is never left unrecorded); a row that fails to land after
the action is said on stderr, exit 3. A release or mark-sent refused because the record
changed writes no row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar, cast

import click

from relay.admin import (
    Decision,
    FingerprintInput,
    InFlightError,
    LedgerRefused,
    Outcome,
    Selection,
    SelectionError,
    SelectionProblem,
    changed_meanwhile,
    count_states,
    decide,
    describe,
    located,
    open_ledger,
    os_user,
    recipient_key_for,
    stats_report,
    stats_table,
    store_label,
)
from relay.admin import selected_keys as select_keys
from relay.cli.exit_codes import ExitCode, epilog
from relay.cli.options import config_option, fail, load
from relay.core.errors import (
    ConfigError,
    InvalidAddressError,
    InvalidDedupKeyError,
    StartupError,
    StoreError,
)
from relay.core.interfaces import FingerprintStore, LedgerAction, State
from relay.core.keys import header_values
from relay.ops.logs import setup_logging
from relay.settings import (
    CONSOLE_ROLES,
    DEFAULT_STORE_URL,
    AdminSettings,
    Settings,
    postgres_files,
    redact_url,
    setting_names,
)

_T = TypeVar("_T")


def store_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--store", default=None,
                        help=f"store URL, as for serve [default: {DEFAULT_STORE_URL}; env: "
                             "RELAY_STORE]")(func)
    return config_option(func)


def selection_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--rcpt", help="envelope recipient (RCPT TO address)"),
        click.option("--template", "templates", multiple=True,
                     help="X-Template value (repeat for several occurrences)"),
        click.option("--key", "keys", multiple=True,
                     help="X-Dedupe-Key value (repeat for several occurrences)"),
        click.option("--auth-user", help="the sender's AUTH identity (with scope_by_auth)"),
        click.option("--store-key", help="the store key itself (instead of --rcpt/--key)"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def ledger_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--ledger", default=None, metavar="URL",
                        help="the audit ledger's URL, as for serve (postgresql://USER@HOST:"
                             "PORT/DB) [env: RELAY_LEDGER]")(func)


def admin_settings(config_file: Path | None, store: str | None, ledger: str | None = None
              ) -> Settings:
    return load(config_file, {"store": store, "ledger": ledger}, base=AdminSettings)


_SELECTION_WORDS = {
    SelectionProblem.BOTH: "give either --store-key or --rcpt/--template/--key, not both",
    SelectionProblem.FOREIGN: "{store_key!r} is no fingerprint of this relay: its keys start "
                              "with {prefix!r} (store_prefix)",
    SelectionProblem.INCOMPLETE: "give --rcpt and --key (and --template when the message has "
                                 "one), or --store-key",
}
"""How the command line words a refused selection (:class:`relay.admin.SelectionError`; a
recipient or key the relay refuses is said in the relay's own words)."""


def selected_keys(settings: Settings, rcpt: str | None, templates: tuple[str, ...],
                  keys: tuple[str, ...], auth_user: str | None, store_key: str | None
                  ) -> tuple[str, ...]:
    """The store keys the selection options name (:func:`relay.admin.selected_keys`: the
    fingerprint's key, then its key under ``fingerprint_secret_previous`` while that is
    set); exits 2 with the reason when they name none, 78 when a secret's file cannot be
    read."""
    try:
        return select_keys(settings, Selection(store_key=store_key, rcpt=rcpt,
                                               templates=templates, keys=keys,
                                               auth_user=auth_user))
    except SelectionError as exc:
        words = _SELECTION_WORDS.get(exc.problem)
        fail(ExitCode.USAGE, str(exc) if words is None
             else words.format(store_key=store_key, prefix=settings.store_prefix))
    except ConfigError as exc:
        fail(ExitCode.CONFIG, f"invalid configuration:\n{exc}")


def selected_key(settings: Settings, rcpt: str | None, templates: tuple[str, ...],
                 keys: tuple[str, ...], auth_user: str | None, store_key: str | None) -> str:
    """The fingerprint's store key the selection options name (:func:`selected_keys`'s
    first)."""
    return selected_keys(settings, rcpt, templates, keys, auth_user, store_key)[0]


def _computed(settings: Settings, given: FingerprintInput) -> dict[str, str]:
    """The fingerprint and store key of ``given`` (:func:`relay.admin.recipient_key_for`),
    with ``previous_key`` while a previous secret is set; exits 2 with its reason for input
    the relay refuses, 78 when a secret's file cannot be read."""
    try:
        found = recipient_key_for(settings, given)
    except (InvalidAddressError, InvalidDedupKeyError, ValueError) as exc:
        fail(ExitCode.USAGE, str(exc))
    except ConfigError as exc:
        fail(ExitCode.CONFIG, f"invalid configuration:\n{exc}")
    computed = {"fingerprint": found.fingerprint, "key": found.key}
    if found.previous is not None:
        computed["previous_key"] = found.previous
    return computed


def _window(settings: Settings, templates: tuple[str, ...]) -> float:
    """The dedup window (seconds) the relay gives a message with ``templates``: its
    ``[[template_policy]]`` entry's, else ``dedup_window``."""
    normalized = header_values((), templates, max_chars=settings.max_key_chars).templates
    return settings.window_for(normalized)


def register(main: click.Group) -> None:
    """Add the admin commands to the ``dedup-relay`` group."""

    @main.command("fingerprint", epilog=epilog())
    @store_options
    @click.option("--rcpt", required=True, help="envelope recipient (RCPT TO address)")
    @click.option("--template", "templates", multiple=True,
                  help="X-Template value (repeat for several occurrences)")
    @click.option("--key", "keys", multiple=True, required=True,
                  help="X-Dedupe-Key value (repeat for several occurrences)")
    @click.option("--auth-user", help="the sender's AUTH identity (with scope_by_auth)")
    def fingerprint_command(config_file: Path | None, store: str | None, rcpt: str,
                            templates: tuple[str, ...], keys: tuple[str, ...],
                            auth_user: str | None) -> None:
        """Print the fingerprint and store key the relay uses for one recipient (and, while
        fingerprint_secret_previous is set, its store key under that secret)."""
        settings = admin_settings(config_file, store)
        click.echo(json.dumps(_computed(settings, FingerprintInput(
            rcpt=rcpt, templates=templates, keys=keys, auth_user=auth_user))))

    @main.command("inspect", epilog=epilog())
    @store_options
    @selection_options
    def inspect_command(config_file: Path | None, store: str | None, rcpt: str | None,
                        templates: tuple[str, ...], keys: tuple[str, ...],
                        auth_user: str | None, store_key: str | None) -> None:
        """Print what the store holds for a fingerprint (exit 1 when nothing): under its key
        or, while fingerprint_secret_previous is set and its key holds nothing, under its key
        of that secret."""
        settings = admin_settings(config_file, store)
        quiet_logging("text")
        chosen = selected_keys(settings, rcpt, templates, keys, auth_user, store_key)
        key, record = _run_on_store(settings, lambda store: located(store, chosen))
        click.echo(json.dumps(describe(key, record, settings.lease)))
        if record.state is State.ABSENT:
            sys.exit(int(ExitCode.NOT_FOUND))

    @main.command("release", epilog=epilog())
    @store_options
    @ledger_option
    @selection_options
    @_decision_options
    def release_command(config_file: Path | None, store: str | None, ledger: str | None,
                        rcpt: str | None, templates: tuple[str, ...], keys: tuple[str, ...],
                        auth_user: str | None, store_key: str | None, reason: str,
                        force: bool, log_format: str) -> None:
        """Delete a fingerprint, so the next attempt is relayed (audited; with a ledger
        configured, also a `released` row there, or nothing done when it does not answer)."""
        settings, chosen = _decision_setup(config_file, store, ledger, rcpt, templates, keys,
                                           auth_user, store_key, reason, log_format)
        outcome = _run_audited(settings, Decision(
            LedgerAction.RELEASE, chosen[0], reason, who=os_user(), force=force,
            given=Selection(rcpt=rcpt, templates=templates, keys=keys),
            previous_key=chosen[1] if len(chosen) > 1 else None))
        click.echo(json.dumps({"released": outcome.done,
                               "previous": describe(outcome.key, outcome.before,
                                                    settings.lease)}))
        _fail_if_unrecorded(outcome.unrecorded, "released")
        if not outcome.done:
            if outcome.changed:  # else there was nothing to delete
                _say_changed("released")
            sys.exit(int(ExitCode.NOT_FOUND))

    @main.command("mark-sent", epilog=epilog())
    @store_options
    @ledger_option
    @selection_options
    @_decision_options
    def mark_sent_command(config_file: Path | None, store: str | None, ledger: str | None,
                          rcpt: str | None, templates: tuple[str, ...], keys: tuple[str, ...],
                          auth_user: str | None, store_key: str | None, reason: str,
                          force: bool, log_format: str) -> None:
        """Record a fingerprint as SENT for the dedup window: the upstream did deliver it, so
        retries are duplicates (audited; with a ledger configured, also a `marked_sent` row
        there, or nothing done when it does not answer)."""
        settings, chosen = _decision_setup(config_file, store, ledger, rcpt, templates, keys,
                                           auth_user, store_key, reason, log_format)
        window_s = settings.dedup_window if store_key is not None else _window(settings, templates)
        outcome = _run_audited(settings, Decision(
            LedgerAction.MARK_SENT, chosen[0], reason, who=os_user(), force=force,
            window_s=window_s, keep_expiry=store_key is not None,
            given=Selection(rcpt=rcpt, templates=templates, keys=keys),
            previous_key=chosen[1] if len(chosen) > 1 else None))
        click.echo(json.dumps({"marked_sent": outcome.done,
                               "previous": describe(outcome.key, outcome.before,
                                                    settings.lease)}))
        _fail_if_unrecorded(outcome.unrecorded, "marked sent")
        if not outcome.done:
            _say_changed("marked sent")
            sys.exit(int(ExitCode.NOT_FOUND))

    _register_stats(main)
    _register_hash_password(main)


PROGRESS_EVERY = 100_000
"""Keys between two progress lines of ``stats`` on stderr."""


def _register_stats(main: click.Group) -> None:
    @main.command("stats", epilog=epilog())
    @store_options
    @click.option("--json", "as_json", is_flag=True,
                  help="print one JSON object (for scripts) instead of a table")
    @click.option("--older-than", "older_than_h", type=click.FloatRange(min=0), default=24,
                  show_default=True, metavar="HOURS",
                  help="count the in-doubt records at least this many hours old")
    @click.option("--max-keys", type=click.IntRange(min=1), default=1_000_000,
                  show_default=True,
                  help="Redis: stop the scan after this many keys (the answer then says "
                       "complete: false)")
    @click.option("--progress/--no-progress", default=None,
                  help=f"a line on stderr every {PROGRESS_EVERY} keys scanned [default: when "
                       "stderr is a terminal]")
    def stats_command(config_file: Path | None, store: str | None, as_json: bool,
                      older_than_h: float, max_keys: int, progress: bool | None) -> None:
        """Count the store's fingerprint records by state (pending, sending, sent, unknown),
        the records in doubt and the oldest of them. Redis: a bounded SCAN of the relay's
        key prefix; SQLite: one query."""
        settings = admin_settings(config_file, store)
        quiet_logging("text")
        shown = sys.stderr.isatty() if progress is None else progress
        counts = _run_on_store(settings, lambda store: count_states(
            store, settings, older_than_h=older_than_h, max_keys=max_keys,
            progress=_ProgressLine() if shown else None))
        if not counts.complete:
            click.echo(f"dedup-relay: stopped after {counts.scanned} keys (--max-keys): the "
                       "counts are partial", err=True)
        if as_json:
            click.echo(json.dumps(stats_report(settings, counts, older_than_h)))
        else:
            click.echo(stats_table(counts, older_than_h))


class _ProgressLine:
    """``progress`` of a count: a line on stderr each time another PROGRESS_EVERY keys were
    scanned."""

    def __init__(self) -> None:
        self._shown = 0

    def __call__(self, scanned: int) -> None:
        if scanned // PROGRESS_EVERY > self._shown:
            self._shown = scanned // PROGRESS_EVERY
            click.echo(f"dedup-relay: scanned {scanned} keys ...", err=True)


def _register_hash_password(main: click.Group) -> None:
    @main.command("hash-password", epilog=epilog())
    @click.option("--user", required=True, help="the AUTH user name (for example app@example.com)")
    @click.option("--scheme", type=click.Choice(["argon2", "bcrypt"]), default="argon2",
                  show_default=True)
    @click.option("--password-stdin", is_flag=True,
                  help="read the password from standard input instead of prompting")
    @click.option("--role", type=click.Choice(CONSOLE_ROLES), default=None,
                  help="a console user's role: prints `user:hash:role` for "
                       "--console-auth-file (viewer reads, operator also releases and marks "
                       "sent)")
    def hash_password_command(user: str, scheme: str, password_stdin: bool,
                              role: str | None) -> None:
        """Print a `user:hash` line for --auth-file, or with --role a `user:hash:role` line
        for --console-auth-file (the password never appears in argv)."""
        from relay.credentials import Scheme, format_entry, hash_password

        if password_stdin:
            password = sys.stdin.readline().rstrip("\r\n")
        else:
            password = click.prompt("Password", hide_input=True, confirmation_prompt=True)
        if not password:
            fail(ExitCode.USAGE, "an empty password is not allowed")
        try:
            click.echo(format_entry(user, hash_password(password, scheme=cast(Scheme, scheme)),
                                    role))
        except ValueError as exc:
            fail(ExitCode.USAGE, str(exc))


def _decision_options(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--reason", required=True,
                     help="why (kept in the audit line, e.g. 'upstream log: not delivered')"),
        click.option("--force", is_flag=True,
                     help="act on a record that is in flight (PENDING, or SENDING within the "
                          "lease): its attempt may still deliver, so this can send twice"),
        click.option("--log-format", type=click.Choice(["json", "text"]), default="json",
                     show_default=True, help="format of the audit line on stderr"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _decision_setup(config_file: Path | None, store: str | None, ledger: str | None,
                    rcpt: str | None, templates: tuple[str, ...], keys: tuple[str, ...],
                    auth_user: str | None, store_key: str | None, reason: str,
                    log_format: str) -> tuple[Settings, tuple[str, ...]]:
    """Settings, logging and the selected keys of a release / mark-sent
    (:func:`selected_keys`); exits 2 on bad input."""
    settings = admin_settings(config_file, store, ledger)
    if not reason.strip():
        fail(ExitCode.USAGE, "--reason must say why (it goes into the audit line)")
    quiet_logging(log_format)
    logging.getLogger("relay.audit").setLevel(logging.INFO)
    return settings, selected_keys(settings, rcpt, templates, keys, auth_user, store_key)


def announce_ledger(url: str) -> None:
    """Say which ledger a command uses (stderr, password masked); exit 78 unless the files
    its URL names (``sslrootcert``, ``passfile``...) are readable, as ``check-config`` and
    ``serve`` require (before any connection)."""
    click.echo(f"dedup-relay: ledger: {redact_url(url)}", err=True)
    try:
        postgres_files(url)
    except ConfigError as exc:
        fail(ExitCode.CONFIG, f"{setting_names('ledger')}: {exc}")


def quiet_logging(log_format: str) -> None:
    """Only errors from the store's start-up checks: a command's output is its answer."""
    setup_logging("ERROR", log_format)


def _say_changed(done: str) -> None:
    """On stderr, why an action did nothing: the record changed under its compare
    (:func:`relay.admin.changed_meanwhile`)."""
    click.echo(f"dedup-relay: refused: {changed_meanwhile(done)}", err=True)


def _fail_if_unrecorded(error: StoreError | None, done: str) -> None:
    """Exit 3 when the audit row of an action that was done did not land."""
    if error is not None:
        fail(ExitCode.STORE_FAILED, f"the record was {done}, but its audit row was not "
                                    f"written to the ledger: {error}")


def _run_audited(settings: Settings, decision: Decision) -> Outcome:
    """``decision`` done on the relay's store (:func:`relay.admin.decide`), with the audit
    ledger when one is configured: the ledger must answer (schema current) before the store
    is touched, else exit 3 with nothing done; then its row is written (an error of that
    write is in the outcome)."""
    if settings.ledger is not None:
        announce_ledger(settings.ledger)
    ledger = None if settings.ledger is None else open_ledger(settings)
    try:
        return _run(settings, lambda: decide(settings, decision, store=_opened(settings),
                                             ledger=ledger,
                                             instance=f"{settings.hostname}/cli"))
    except LedgerRefused as exc:
        fail(ExitCode.STORE_FAILED, f"audit ledger failed, nothing done (an operator action "
                                    f"is not left unrecorded): {exc}")


@contextlib.asynccontextmanager
async def _opened(settings: Settings) -> AsyncIterator[FingerprintStore]:
    """The relay's store, opened for one command and closed after it."""
    store = await settings.open_store(window_s=settings.dedup_window)
    try:
        yield store
    finally:
        await store.close()


def _run_on_store(settings: Settings, action: Callable[[FingerprintStore], Awaitable[_T]]) -> _T:
    """Open the relay's store, run ``action`` on it, close it; exit 3 when the store fails."""

    async def run() -> _T:
        async with _opened(settings) as store:
            return await action(store)

    return _run(settings, run)


def _run(settings: Settings, run: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Say which store is used, run ``run()`` in an event loop; exit 3 when the store fails
    (2, 4 and 78 for the other refusals)."""
    path = settings.store_data_file  # an embedded store's file (SQLite's), None for a server
    if path is not None and not path.is_file():  # opening would make an empty one: "absent"
        fail(ExitCode.CONFIG, f"no database at {path}: run where the relay runs, or pass "
                               f"the relay's store ({setting_names('store')})")
    click.echo(f"dedup-relay: store: {store_label(settings)}", err=True)
    try:
        return asyncio.run(run())
    except StoreError as exc:
        fail(ExitCode.STORE_FAILED, f"store failed: {exc}")
    except InFlightError as exc:
        fail(ExitCode.IN_FLIGHT, f"refused: {exc}")
    except ConfigError as exc:  # e.g. a Redis database number the server does not have
        fail(ExitCode.CONFIG, f"invalid configuration:\n{exc}")
    except StartupError as exc:  # a PostgreSQL store whose schema is missing or old
        fail(ExitCode.STORE_FAILED, f"store failed: {exc}")
