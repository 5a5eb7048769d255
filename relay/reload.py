"""Configuration reload on SIGHUP (issue 11): read the settings again, apply what can change
live, name what needs a restart.

:class:`SettingsSource` re-reads the settings as ``serve`` read them at start (the same flags,
the environment, the same ``--config`` file) and checks the files they name
(:func:`relay.app.check_settings`). :class:`Reloader` compares them with the running ones:
the settings of :data:`RELOADABLE` are applied, any other whose value changed is named as
needing a restart and left as it is. :func:`apply_changes` applies them to a running
:class:`relay.app.Relay` (each from the next message, MAIL, AUTH, connection or TLS handshake
on; open connections stay). The settings that shape the fingerprint (``fingerprint_secret*``,
``store_prefix``, ``dedupe_headers``, ``template_headers``, ``scope_by_auth``...) never change
live: the dedup rules are swapped into the running :class:`relay.core.policy.Policy`, whose
other fields stay.

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
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from relay.app import Relay, build_policy, build_rate_limits, check_settings
from relay.config import Settings, load_settings
from relay.core.errors import ConfigError
from relay.core.policy import Policy
from relay.ops.logs import set_level
from relay.smtp.access import parse_networks
from relay.smtp.auth import CredentialFile
from relay.smtp.tls import server_context

log = logging.getLogger("relay.reload")

# the dedup rules (swapped into the running Policy), who may connect and send, AUTH users,
# the TLS certificate, the log level
POLICY_SETTINGS = ("template_policy", "mode", "dedup_window", "missing_key", "unknown_policy",
                   "duplicate_reply", "store_down")
RELOADABLE = (*POLICY_SETTINGS, "allowed_networks", "allowed_senders", "auth_file", "tls_cert",
              "tls_key", "log_level", "rate_limit")
# settings naming a file whose content may change in place (a rotated certificate): compared
# by a digest of the content as well as by the path
FILE_SETTINGS = ("tls_cert", "tls_key", "auth_file", "fingerprint_secret_file",
                 "upstream_password_file", "upstream_ca_file", "upstream_client_cert",
                 "upstream_client_key", "oauth_client_secret_file", "oauth_refresh_token_file",
                 "oauth_ca_file")


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
        have the SQLite file open, see :func:`relay.app.check_settings`). Raises
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

    switched = set()  # TLS or AUTH switched on or off
    if (running.tls_cert is None) != (new.tls_cert is None):
        switched |= {"tls_cert", "tls_key"}
    if (running.auth_file is None) != (new.auth_file is None):
        switched.add("auth_file")
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


@contextlib.contextmanager
def _memory_copy(data: bytes, name: str) -> Iterator[str]:
    """A path to a private in-memory copy of ``data`` (Linux memfd), so that a file read
    twice is the same both times; the bytes are not written to a disk. Raises OSError."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def rotate_certificate(context: ssl.SSLContext, cert: Path, key: Path,
                       min_version: str = "TLSv1.2") -> None:
    """Load the certificate chain ``cert`` and its ``key`` into the live server ``context``:
    every later handshake (STARTTLS, the implicit-TLS listener) is served the new chain; those
    done keep theirs. Each file is read once; the pair is first loaded into a fresh context,
    so a pair that does not load leaves ``context`` as it was. Raises :class:`ConfigError`."""
    try:
        cert_bytes, key_bytes = cert.read_bytes(), key.read_bytes()
    except OSError as exc:
        raise ConfigError(f"tls_cert/tls_key: cannot read {cert} / {key}: {exc}") from exc
    try:
        with _memory_copy(cert_bytes, "tls-cert") as cert_copy, \
                _memory_copy(key_bytes, "tls-key") as key_copy:
            server_context(Path(cert_copy), Path(key_copy), min_version)
            context.load_cert_chain(certfile=cert_copy, keyfile=key_copy)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("/proc/self/fd/", "fd ")
                          + f" (tls_cert {cert}, tls_key {key})") from exc
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert/tls_key: cannot load {cert} / {key}: {exc}") from exc


async def apply_changes(relay: Relay, changes: Changes) -> None:
    """Apply ``changes`` to the running ``relay``: the dedup rules from the next message on
    (a message in flight keeps its policy), ``allowed_networks`` from the next connection,
    ``allowed_senders`` from the next MAIL, the AUTH users from the next AUTH, the TLS
    certificate (read again every time: a file replaced in place) from the next handshake,
    the log level at once, the ``[[rate_limit]]`` rules from the next message. Raises
    :class:`ConfigError` when a file does not load; then nothing was applied."""
    merged = changes.merged
    credentials = None
    if relay.sasl is not None and merged.auth_file is not None \
            and "auth_file" in changes.applied:
        credentials = await asyncio.to_thread(CredentialFile.load, merged.auth_file)
    security = relay.security
    if security is not None and security.tls_context is not None \
            and merged.tls_cert is not None and merged.tls_key is not None:
        rotate_certificate(security.tls_context, merged.tls_cert, merged.tls_key,
                           merged.tls_min_version)
    if credentials is not None and relay.sasl is not None:
        relay.sasl.credentials.replace_with(credentials)
    if relay.core is not None and any(n in changes.applied for n in POLICY_SETTINGS):
        relay.core.policy = dedup_rules(relay.core.policy, merged)
    if relay.core is not None and "rate_limit" in changes.applied:
        relay.metrics.declare_rate_limits(r.label for r in merged.rate_limit)
        relay.core.rate_limits = build_rate_limits(merged)  # the store's counters stay
    if security is not None and "allowed_networks" in changes.applied:
        security.gate.set_allowed(parse_networks(merged.allowed_networks))
    if relay.handler is not None and "allowed_senders" in changes.applied:
        relay.handler.set_allowed_senders(merged.allowed_senders)
    set_level(merged.log_level)
    relay.settings = merged


def dedup_rules(running: Policy, merged: Settings) -> Policy:
    """``running`` (the relay's :class:`relay.core.policy.Policy`) with the dedup rules of
    ``merged`` (:data:`POLICY_SETTINGS`); every field that shapes the fingerprint (secret, key
    prefix and format, header names...) stays the running one's."""
    # the secret is not read again (its file may hold another key by now): the rules only
    rules = build_policy(merged.model_copy(update={"fingerprint_secret": None,
                                                   "fingerprint_secret_file": None}))
    return dataclasses.replace(
        running, window_s=rules.window_s, missing_key=rules.missing_key, unknown=rules.unknown,
        store_down=rules.store_down, duplicate_reply=rules.duplicate_reply, mode=rules.mode,
        templates=rules.templates)


def relay_hangup(reloader: Reloader) -> Callable[[Relay], Awaitable[None]]:
    """The SIGHUP action of a relay in one process (``workers`` = 1), for
    :func:`relay.app.run`: one INFO line ``configuration reloaded: ...`` or one ERROR line
    ``configuration reload refused: <why>`` (then nothing changed), counted in the relay's
    ``relay_config_reloads_total``."""

    async def hangup(relay: Relay) -> None:
        log.debug("SIGHUP: reading the settings again from %s", reloader.source.describe())
        try:
            changes = await asyncio.to_thread(reloader.prepare)
            await apply_changes(relay, changes)
        except ConfigError as exc:
            log.error("configuration reload refused: %s", one_line(exc))
            if relay.reloads is not None:
                relay.reloads.reloaded(applied=False, now=time.time())
            return
        reloader.commit(changes)
        log.info("configuration reloaded: %s", changes.describe())
        if relay.reloads is not None:
            relay.reloads.reloaded(applied=True, now=time.time())

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
