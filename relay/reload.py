"""Configuration reload on SIGHUP: read the settings again, apply what can change live, name
what needs a restart.

:class:`SettingsSource` re-reads the settings as ``serve`` read them at start (the same flags,
the environment, the same ``--config`` file) and checks the files they name
(:func:`relay.settings.check_settings`). :class:`Reloader` compares them with the running ones:
the settings each section lists as live (:data:`relay.settings.RELOADABLE`) are applied, any
other whose value changed is named as needing a restart and left as it is.
:func:`apply_changes` hands them to the running :class:`relay.app.Relay`, which applies each
section's to its part (from the next message, MAIL, AUTH, connection or TLS handshake on;
open connections stay). The settings that shape the fingerprint (``fingerprint_secret*``,
``store_prefix``, ``dedupe_headers``, ``template_headers``, ``scope_by_auth``...) never change
live.

One process (``workers`` = 1) reloads with :func:`relay_hangup` and logs one line; with
workers the supervisor validates and logs, and each worker applies with :func:`worker_hangup`
(DEBUG, or ERROR when its own apply fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from relay.app import Relay
from relay.core.errors import ConfigError
from relay.settings import (
    FILE_SETTINGS,
    RELOADABLE,
    AccessSettings,
    Settings,
    check_settings,
    load_settings,
)

log = logging.getLogger("relay.reload")


@dataclass(frozen=True)
class SettingsSource:
    """Where the running settings came from: ``serve``'s flags (field name -> value or None)
    and its ``--config`` file (or RELAY_CONFIG); the environment is read again as it is."""

    config_file: Path | None
    flags: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """Where the settings are read from, for a log line."""
        file = f"the file {self.config_file}" if self.config_file is not None else "no file"
        return f"{file}, the RELAY_* environment and serve's flags"

    def read(self) -> Settings:
        """The settings as ``serve`` would load them now (flags beat env beat file), with the
        files they name checked (not the store's: it cannot change live, and this process may
        have the SQLite file open, see :func:`relay.settings.check_settings`). Raises
        :class:`ConfigError` (one line per problem). Blocking: reads files, loads the TLS
        pair, parses the credentials file (~100 ms)."""
        settings = load_settings(dict(self.flags), self.config_file)
        check_settings(settings, store=False)
        return settings


@dataclass(frozen=True)
class SnapshotSource:
    """A worker's source (``workers`` > 1): the settings its supervisor read and checked,
    pickled to ``path`` before it sent SIGHUP. Every worker applies that one reading, so a file
    changed between the supervisor's read and a worker's cannot split the relay (some workers
    on the old rules, some on the new) while the supervisor reports one result."""

    path: Path

    def describe(self) -> str:
        """Where the settings are read from, for a log line."""
        return f"the supervisor's checked reading ({self.path})"

    def read(self) -> Settings:
        """The settings the supervisor wrote last. Raises :class:`ConfigError` when there is
        none or it does not load."""
        try:
            settings = pickle.loads(self.path.read_bytes())  # noqa: S301 (our supervisor's)
        except (OSError, pickle.PickleError, EOFError) as exc:
            raise ConfigError(f"cannot read the supervisor's settings {self.path}: {exc}"
                              ) from exc
        if not isinstance(settings, Settings):
            raise ConfigError(f"{self.path} holds no settings")
        return settings


def write_snapshot(path: Path, settings: Settings) -> None:
    """Write ``settings`` for the workers' :class:`SnapshotSource` (atomically: a worker never
    reads half a file). Raises OSError."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(pickle.dumps(settings))
    os.replace(partial, path)


@dataclass(frozen=True)
class Changes:
    """What a reload found: ``applied``, the reloadable settings whose value (or file content)
    changed; ``restart``, the other settings whose value changed (left as they are); ``merged``,
    the running settings with the reloadable ones replaced; ``digests`` of its files."""

    applied: tuple[str, ...]
    restart: tuple[str, ...]
    merged: Settings
    digests: Mapping[str, str | None]

    def describe(self) -> str:
        """``applied a, b; needs a restart: c`` (``nothing changed`` / ``none`` when empty)."""
        return (f"applied {', '.join(self.applied) or 'nothing changed'}; "
                f"needs a restart: {', '.join(self.restart) or 'none'}")


def file_digests(settings: Settings) -> dict[str, str | None]:
    """SHA-256 (hex) of the content of each file of :data:`FILE_SETTINGS` that ``settings``
    names; None when unset or unreadable. Never raises."""
    digests: dict[str, str | None] = {}
    for name in FILE_SETTINGS:
        path = getattr(settings, name)
        digest = None
        if path is not None:
            with contextlib.suppress(OSError):
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        digests[name] = digest
    return digests


def compare(running: Settings, new: Settings, before: Mapping[str, str | None],
            after: Mapping[str, str | None]) -> Changes:
    """The :class:`Changes` from ``running`` to ``new``; ``before`` and ``after`` are the
    :func:`file_digests` of each. TLS switched on or off, and AUTH switched on or off, need a
    restart (the listeners offer STARTTLS and AUTH as they started)."""
    applied: list[str] = []
    restart: list[str] = []
    update: dict[str, Any] = {}

    def changed(name: str) -> bool:
        return bool(getattr(running, name) != getattr(new, name)
                    or (name in before and before.get(name) != after.get(name)))

    # TLS or AUTH switched on or off, the console's HTTPS switched on or off
    switched = AccessSettings.restart_needed(running, new) | running.console_restart_needed(new)
    for name in Settings.model_fields:
        if not changed(name):
            continue
        if name in switched:
            restart.append(name)
        elif name in RELOADABLE:
            applied.append(name)
            update[name] = getattr(new, name)
        else:
            restart.append(name)
    merged = running.model_copy(update=update)
    digests = {name: (after if name in update else before).get(name) for name in FILE_SETTINGS}
    return Changes(tuple(applied), tuple(restart), merged, digests)


def _valid(settings: Settings) -> None:
    """Raise :class:`ConfigError` unless ``settings`` (running ones with the reloadable ones
    replaced) hold together: a new window shorter than the running lease, for example."""
    try:
        Settings.model_validate(dict(settings))
    except ValidationError as exc:
        raise ConfigError("; ".join(str(e["msg"]).removeprefix("Value error, ")
                                    for e in exc.errors())) from None


class Reloader:
    """The running settings of one process and what their files held; :meth:`prepare` reads
    the source again, :meth:`commit` makes what it found the running settings."""

    def __init__(self, source: SettingsSource | SnapshotSource, running: Settings) -> None:
        self.source = source
        self.running = running
        self._digests: Mapping[str, str | None] = file_digests(running)

    def prepare(self) -> Changes:
        """Read and check the settings again; the changes to apply. Raises
        :class:`ConfigError` (the file, a setting, a file it names, or the settings together
        with those that cannot change live). Blocking (see :meth:`SettingsSource.read`)."""
        new = self.source.read()
        changes = compare(self.running, new, self._digests, file_digests(new))
        if changes.applied:
            _valid(changes.merged)
        return changes

    def commit(self, changes: Changes) -> None:
        """The settings of ``changes`` run now."""
        self.running = changes.merged
        self._digests = changes.digests


def one_line(exc: Exception) -> str:
    """A multi-line :class:`ConfigError` text as one log line (problems joined by ``; ``)."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


async def apply_changes(relay: Relay, changes: Changes) -> None:
    """Apply ``changes`` to the running ``relay`` (:meth:`relay.app.Relay.apply`). Raises
    :class:`ConfigError` when a file does not load; then nothing was applied."""
    await relay.apply(changes.merged, frozenset(changes.applied))


def relay_hangup(reloader: Reloader) -> Callable[[Relay], Awaitable[None]]:
    """The SIGHUP action of a relay in one process (``workers`` = 1), for
    :func:`relay.serving.run`: one INFO line ``configuration reloaded: ...`` or one ERROR line
    ``configuration reload refused: <why>`` (then nothing changed), counted in the relay's
    ``relay_config_reloads_total``."""

    async def hangup(relay: Relay) -> None:
        log.debug("SIGHUP: reading the settings again from %s", reloader.source.describe())
        try:
            changes = await asyncio.to_thread(reloader.prepare)
            await apply_changes(relay, changes)
        except ConfigError as exc:
            log.error("configuration reload refused: %s", one_line(exc))
            relay.count_reload(applied=False)
            return
        reloader.commit(changes)
        log.info("configuration reloaded: %s", changes.describe())
        relay.count_reload(applied=True)

    return hangup


def worker_hangup(reloader: Reloader, acknowledge: Callable[[bool], None]
                  ) -> Callable[[Relay], Awaitable[None]]:
    """The SIGHUP action of a worker (``workers`` > 1): its supervisor checked the file and
    logs the reload; the worker applies the reloadable settings of the same file, logs at
    DEBUG (ERROR when its own apply fails, nothing changed then) and calls ``acknowledge``
    with whether it applied them."""

    async def hangup(relay: Relay) -> None:
        try:
            changes = await asyncio.to_thread(reloader.prepare)
            changes = dataclasses.replace(changes, restart=())  # the supervisor names those
            await apply_changes(relay, changes)
        except ConfigError as exc:
            log.error("new configuration not applied in this worker: %s", one_line(exc))
            acknowledge(False)
            return
        reloader.commit(changes)
        log.debug("new configuration applied in this worker: %s", changes.describe())
        acknowledge(True)

    return hangup
