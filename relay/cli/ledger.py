"""Audit ledger commands (design.md §6.7): ``dedup-relay history`` (the ledger rows of
one fingerprint, oldest first, or of a lookup by recipient, Message-ID, queue id, template or
period, newest first: :func:`relay.admin.search.ledger_query`, the console's rule) and
``dedup-relay in-doubt`` (the in-doubt decisions no later row
resolved, with what an operator needs to look them up in the smarthost's log).

Both read the relay's own settings (``--config``, ``RELAY_*`` env vars, ``--store``,
``--ledger``), so a key given as ``--rcpt/--template/--key`` is the store key the relay uses.
Exit codes (:class:`relay.cli.exit_codes.ExitCode`): 0 done (also when no row matched), 2 bad
input, 3 the ledger failed, did not answer, or its schema is missing or old (the message names
``dedup-relay db upgrade --ledger``), 78 invalid configuration or no ledger configured.
Lines print what clients and smarthosts sent (Message-IDs, replies) through
:func:`relay.cli.terminal.shown`: no control character reaches the terminal; ``--json``
escapes them as JSON does.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

from relay.admin.search import DEFAULT_DAYS, Lookup, LookupProblem, LookupRefused, ledger_query
from relay.cli.admin import (
    admin_settings,
    announce_ledger,
    ledger_option,
    quiet_logging,
    selected_keys,
    selection_options,
    store_options,
)
from relay.cli.exit_codes import ExitCode, epilog
from relay.cli.options import fail
from relay.cli.terminal import shown
from relay.core.errors import StoreError
from relay.settings import Settings, setting_names
from relay.store.postgres.migrations import SchemaError

if TYPE_CHECKING:  # the postgres extra: imported once a ledger is configured (its setting
    # refuses a postgresql:// URL, exit 78, when the driver does not import)
    from relay.store.postgres.ledger_query import LedgerQuery
    from relay.store.postgres.ledger_read import HistoryRow, InDoubtRow, LedgerReader

_T = TypeVar("_T")

DEFAULT_LIMIT = 1000
"""Most rows a command prints unless ``--limit`` says otherwise."""

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_DURATION_S = 100 * 366 * 86400.0
"""The longest ``--older-than`` (100 years): beyond PostgreSQL's intervals, and any row."""
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*", re.IGNORECASE)


if TYPE_CHECKING:  # generic from click 8.2 on; the relay runs on click 8.1.7 too
    _FloatParam = click.ParamType[float, object]
else:
    _FloatParam = click.ParamType


class Duration(_FloatParam):
    """A duration in seconds from ``90s``, ``30m``, ``1h``, ``2d`` or a bare number of hours
    (as ``stats --older-than HOURS`` takes it); never negative."""

    name = "duration"

    def convert(self, value: object, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        """``value`` in seconds; a usage error (exit 2) for anything else."""
        if isinstance(value, int | float):
            seconds = float(value) * 3600.0
        else:
            found = _DURATION.fullmatch(str(value))
            if found is None:
                self.fail(f"{value!r} is no duration: a number with s, m, h or d (a bare "
                          "number counts hours), e.g. 30m or 1h", param, ctx)
            seconds = float(found.group(1)) * _UNITS.get(found.group(2).lower() or "h", 3600.0)
        if seconds > MAX_DURATION_S:
            self.fail(f"{value!r} is longer than {MAX_DURATION_S // 86400:.0f} days (the "
                      "ledger keeps nothing that old)", param, ctx)
        return seconds


def iso(at: datetime) -> str:
    """``at`` as ISO 8601 UTC to the millisecond: ``2026-12-02T01:07:39.725Z``."""
    return at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def history_json(row: HistoryRow) -> dict[str, object]:
    """One ledger row as ``history --json`` prints it: ``outcome``, ``at`` (``decided_at``),
    ``reply`` first, then the rest of the row (``key``: the ``dedupe_key`` column)."""
    return {
        "outcome": row.outcome, "at": iso(row.decided_at), "reply": row.reply,
        "recorded_at": iso(row.recorded_at), "action": row.action, "store_key": row.store_key,
        "recipient": row.recipient, "template": row.template, "key": row.dedupe_key,
        "upstream_queue_id": row.upstream_queue_id, "upstream": row.upstream,
        "message_id": row.message_id, "queue_id": row.queue_id,
        "client_reply": row.client_reply, "instance": row.instance,
        "key_source": row.key_source, "key_reused": row.key_reused,
        "received_at": None if row.received_at is None else iso(row.received_at),
        "sending_at": None if row.sending_at is None else iso(row.sending_at),
    }


def in_doubt_json(row: InDoubtRow) -> dict[str, object]:
    """One unresolved in-doubt decision as ``in-doubt --json`` prints it (``age_s``: seconds
    since it was decided, by the database's clock)."""
    return {
        "store_key": row.store_key, "recipient": row.recipient, "template": row.template,
        "at": iso(row.decided_at), "age_s": round(row.age_s, 3),
        "upstream_queue_id": row.upstream_queue_id, "message_id": row.message_id,
        "queue_id": row.queue_id, "upstream": row.upstream, "instance": row.instance,
        "client_reply": row.client_reply, "reply": row.reply, "key": row.dedupe_key,
        "recorded_at": iso(row.recorded_at),
        "reconcile": {
            "looks": row.reconcile_looks or 0,
            "looked_at": None if row.reconcile_looked_at is None else iso(
                row.reconcile_looked_at),
            "answer": row.reconcile_answer, "given_up": row.reconcile_given_up},
    }


def register(main: click.Group) -> None:
    """Add ``history`` and ``in-doubt`` to the ``dedup-relay`` group."""

    @main.command("history", epilog=epilog())
    @store_options
    @ledger_option
    @selection_options
    @click.option("--message-id", help="look up by the message's Message-ID (with or "
                                       "without its angle brackets)")
    @click.option("--queue-id", help="look up by the relay's queue id or the smarthost's")
    @click.option("--since", metavar="TIME", help="decided at or after TIME (ISO 8601: "
                  "2026-12-05 or 2026-12-05T14:30, UTC unless it names an offset) [default "
                  f"with --rcpt or --template alone: {DEFAULT_DAYS} days back]")
    @click.option("--until", metavar="TIME", help="decided before TIME (ISO 8601, as --since)")
    @click.option("--json", "as_json", is_flag=True,
                  help="print a JSON array of the rows (for scripts) instead of lines")
    @click.option("--limit", type=click.IntRange(min=1), default=DEFAULT_LIMIT,
                  show_default=True, help="print at most this many rows (a fingerprint's "
                                          "oldest, a lookup's newest)")
    def history_command(config_file: Path | None, store: str | None, ledger: str | None,
                        rcpt: str | None, templates: tuple[str, ...], keys: tuple[str, ...],
                        auth_user: str | None, store_key: str | None, message_id: str | None,
                        queue_id: str | None, since: str | None, until: str | None,
                        as_json: bool, limit: int) -> None:
        """Print the audit ledger's rows of one fingerprint (--rcpt with --key, or
        --store-key), oldest first: every decision the relay took for it (outcome, upstream
        reply, queue id, Message-ID) and every release or mark-sent (while
        fingerprint_secret_previous is set, its rows under that secret's key too). Without a
        key, look messages up by what support holds (--rcpt alone, --message-id, --queue-id,
        a --template, --since/--until; every one given must match): their rows, newest
        first, as the console's history page lists them."""
        settings = admin_settings(config_file, store, ledger)
        quiet_logging("text")
        looked_up = (message_id, queue_id, since, until)
        if keys or store_key:
            if any(looked_up):
                fail(ExitCode.USAGE, "--message-id, --queue-id, --since and --until look "
                                     "messages up; a fingerprint (--key or --store-key) is "
                                     "printed whole: give one or the other")
            chosen = selected_keys(settings, rcpt, templates, keys, auth_user, store_key)
            rows = _run_on_ledger(settings,
                                  lambda reader: reader.history(*chosen, limit=limit))
            _say_if_cut(len(rows), limit)
            _print_history(rows, as_json, shown(chosen[0]))
            return
        query = _lookup(settings, rcpt, templates, auth_user, *looked_up)
        page = _run_on_ledger(settings, lambda reader: reader.search(query, limit=limit))
        if page.next is not None:
            click.echo(f"dedup-relay: showing the newest {limit} rows (--limit; narrow with "
                       "--since/--until)", err=True)
        _print_history(page.rows, as_json, "this lookup")

    @main.command("in-doubt", epilog=epilog())
    @store_options
    @ledger_option
    @click.option("--older-than", "older_than_s", type=Duration(), default="0s",
                  metavar="DURATION",
                  help="only decisions at least this old: 30m, 1h, 2d (a bare number counts "
                       "hours, as for stats) [default: 0, all]")
    @click.option("--json", "as_json", is_flag=True,
                  help="print a JSON array (for scripts) instead of lines")
    @click.option("--limit", type=click.IntRange(min=1), default=DEFAULT_LIMIT,
                  show_default=True, help="print at most this many (the oldest)")
    def in_doubt_command(config_file: Path | None, store: str | None, ledger: str | None,
                         older_than_s: float, as_json: bool, limit: int) -> None:
        """List the in-doubt (unknown) decisions no later row resolved (not sent again,
        released or marked sent), oldest first, with the upstream queue id and Message-ID to
        look up in the smarthost's log; then settle each with `dedup-relay mark-sent` (it was
        delivered) or `dedup-relay release` (it was not)."""
        settings = admin_settings(config_file, store, ledger)
        quiet_logging("text")
        rows, last_look = _run_on_ledger(settings, lambda reader: _in_doubt_and_last_look(
            reader, older_than_s=older_than_s, limit=limit))
        _say_if_cut(len(rows), limit)
        if as_json:
            click.echo(json.dumps([in_doubt_json(row) for row in rows]))
            return
        if not rows:
            click.echo("dedup-relay: no unresolved in-doubt decisions in the ledger", err=True)
            click.echo(f"dedup-relay: {_last_look_line(last_look)}", err=True)
            return
        for row in rows:
            click.echo(shown(_in_doubt_line(row)))
            click.echo(shown(f"    {_reconcile_line(row)}"))
        click.echo(f"\n{_last_look_line(last_look)}")
        click.echo(
            f"{len(rows)} in-doubt decision(s): the upstream took the message and its answer "
            "was lost. Look each up in the smarthost's log by its queue id or Message-ID, "
            "then:\n"
            "  delivered:     dedup-relay mark-sent --store-key KEY --reason '...'\n"
            "  not delivered: dedup-relay release --store-key KEY --reason '...'")


def _print_history(rows: list[HistoryRow], as_json: bool, asked: str) -> None:
    """``rows`` as a JSON array, or one line each (``asked``: what found none, on stderr)."""
    if as_json:
        click.echo(json.dumps([history_json(row) for row in rows]))
        return
    if not rows:
        click.echo(f"dedup-relay: no rows for {asked} in the ledger", err=True)
        return
    for row in rows:
        click.echo(shown(_history_line(row)))


def _lookup(settings: Settings, rcpt: str | None, templates: tuple[str, ...],
            auth_user: str | None, message_id: str | None, queue_id: str | None,
            since: str | None, until: str | None) -> LedgerQuery:
    """The ledger query of a lookup's options (:func:`relay.admin.search.ledger_query`, the
    console's rule); exits 2 with the reason when it asks nothing the ledger can answer."""
    if auth_user:
        fail(ExitCode.USAGE, "--auth-user goes with --rcpt and --key (a fingerprint): a "
                             "lookup by recipient finds every sender's rows")
    if len(templates) > 1:
        fail(ExitCode.USAGE, "give one --template to look up by (several are for --key)")
    try:
        return ledger_query(settings, Lookup(
            rcpt=rcpt, message_id=message_id, queue_id=queue_id,
            template=templates[0] if templates else None, since=since, until=until),
            now=datetime.now(tz=UTC))
    except LookupRefused as exc:
        if exc.problem is LookupProblem.EMPTY:
            fail(ExitCode.USAGE, "give --rcpt and --key (and --template) or --store-key for "
                                 "one fingerprint, or look up by --rcpt, --message-id, "
                                 "--queue-id, --template, --since or --until")
        fail(ExitCode.USAGE, f"--{exc.field.replace('_', '-')}: {exc}" if exc.field
             else str(exc))


def _ledger_url(settings: Settings) -> str:
    """The ledger's URL; exits 78 when none is configured."""
    if settings.ledger is None:
        fail(ExitCode.CONFIG, "no audit ledger configured: pass its URL with "
                              f"{setting_names('ledger')} (postgresql://USER@HOST:PORT/DB)")
    announce_ledger(settings.ledger)
    return settings.ledger


def _run_on_ledger(settings: Settings, action: Callable[[LedgerReader], Awaitable[_T]]) -> _T:
    """Open the ledger ``settings`` name, run ``action`` on it, close it; exit 78 when none is
    configured, 3 when it fails or its schema is missing or old."""
    url = _ledger_url(settings)
    from relay.store.postgres.ledger_read import LedgerReader

    async def run() -> _T:
        async with await LedgerReader.open(url, timeout_s=settings.ledger_timeout) as reader:
            return await action(reader)

    try:
        return asyncio.run(run())
    except StoreError as exc:
        fail(ExitCode.STORE_FAILED, f"audit ledger failed: {exc}")
    except SchemaError as exc:
        fail(ExitCode.STORE_FAILED, f"audit ledger: {exc}")


def _say_if_cut(rows: int, limit: int) -> None:
    if rows >= limit:
        click.echo(f"dedup-relay: showing the first {limit} rows (--limit)", err=True)


def _or_dash(text: str | None) -> str:
    return text if text else "-"


def _history_line(row: HistoryRow) -> str:
    """``AT  OUTCOME  RECIPIENT  reply: ...  [queue id, Message-ID, upstream, instance]``."""
    extra = [f"{name} {value}" for name, value in (
        ("upstream-queue-id", row.upstream_queue_id), ("message-id", row.message_id),
        ("upstream", row.upstream), ("queue-id", row.queue_id), ("key-from", row.key_source),
        ("key", "reused for other content" if row.key_reused else ""),
        ("by", row.instance))
        if value]
    return (f"{iso(row.decided_at)}  {row.outcome:<16} {_or_dash(row.recipient):<24} "
            f"reply: {_or_dash(row.reply)}" + (f"  [{', '.join(extra)}]" if extra else ""))


def _in_doubt_line(row: InDoubtRow) -> str:
    """``AT (AGE ago)  STORE_KEY  RECIPIENT  queue id ...  Message-ID ...  via UPSTREAM``."""
    return (f"{iso(row.decided_at)} ({_age(row.age_s)} ago)  {row.store_key}  "
            f"{_or_dash(row.recipient)}  upstream-queue-id {_or_dash(row.upstream_queue_id)}  "
            f"message-id {_or_dash(row.message_id)}  queue-id {_or_dash(row.queue_id)}  "
            f"via {_or_dash(row.upstream)}  by {_or_dash(row.instance)}")


async def _in_doubt_and_last_look(reader: LedgerReader, *, older_than_s: float, limit: int
                                  ) -> tuple[list[InDoubtRow], datetime | None]:
    """The in-doubt rows and when the reconciler last looked at any."""
    return (await reader.in_doubt(older_than_s=older_than_s, limit=limit),
            await reader.last_look())


def _reconcile_line(row: InDoubtRow) -> str:
    """What the reconciler did with ``row``: ``reconciler: looked 3 times, last AT: ANSWER``,
    ``reconciler: gave up ...`` or ``reconciler: not looked at yet``."""
    if row.reconcile_given_up:
        return ("reconciler: gave up (no evidence within reconcile_give_up): decide by hand"
                + ("" if not row.reconcile_looks else f", after {row.reconcile_looks} looks"))
    if not row.reconcile_looks or row.reconcile_looked_at is None:
        return "reconciler: not looked at yet"
    return (f"reconciler: looked {row.reconcile_looks} time(s), last "
            f"{iso(row.reconcile_looked_at)}: {_or_dash(row.reconcile_answer)}")


def _last_look_line(at: datetime | None) -> str:
    """When the reconciler last looked at any in-doubt record, for the operator."""
    if at is None:
        return ("the reconciler has not looked at any in-doubt record (no [[reconcile_source]] "
                "configured, or not yet)")
    return f"the reconciler last looked at {iso(at)}"


def _age(seconds: float) -> str:
    """``seconds`` as ``45s``, ``12m``, ``3h05m`` or ``2d04h``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
