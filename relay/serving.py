"""Serving one relay process: :func:`run` starts a :class:`relay.app.Relay`, serves until
SIGTERM or SIGINT, runs the configuration reload on each SIGHUP, then stops it gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

from relay.admin.reconciler import start_reconciler
from relay.app import Relay
from relay.core.errors import ConfigError, StartupError, StoreError
from relay.listen import Inherited
from relay.ops.metrics import ReconcileMetrics
from relay.ops.notify import keep_watchdog, notify, watchdog_interval_s
from relay.settings import Settings, redact_url

log = logging.getLogger("relay.app")


async def run(settings: Settings, *, inherited: Inherited | None = None,
              started: Callable[[Relay], None] | None = None,
              hangup: Callable[[Relay], Awaitable[None]] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully.

    The signal handlers are installed before start-up, so a signal during a slow start (a
    store that does not answer) stops the relay too. Raises :class:`StartupError` with one
    readable line when the relay cannot start, :class:`ConfigError` when a setting proves
    wrong only at start (a Redis database number the server does not have). ``inherited``: a
    worker's sockets (:class:`Inherited`); ``started`` is called once the relay serves.
    A relay that is not a worker runs the reconciler (:mod:`relay.admin.reconciler`) while it
    serves. ``hangup``: the configuration reload (:mod:`relay.reload`), run for each SIGHUP once the
    relay serves (one received during start-up waits for it), one at a time.
    """
    relay = Relay(settings, inherited=inherited)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    hangups: asyncio.Queue[None] = asyncio.Queue()
    if hangup is not None:
        loop.add_signal_handler(signal.SIGHUP, hangups.put_nowait, None)
    starting = asyncio.create_task(_start(relay))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("signal received during start-up: stopping")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
    else:
        try:
            starting.result()
        except (StartupError, ConfigError):
            stopping.cancel()
            await relay.stop()
            raise
        if started is not None:
            started(relay)
        reconciling = None if inherited is not None else start_reconciler(
            lambda: relay.settings, store=relay.store,
            metrics=lambda: ReconcileMetrics(registry=relay.registry),
            instance=f"{settings.hostname}/reconciler")
        watchdog = _announce_ready(inherited)
        reloads = None if hangup is None else asyncio.create_task(
            _reloads(relay, hangups, hangup))
        await stopping
        log.info("signal received: stopping")
        if inherited is None:
            notify("STOPPING=1")
        if watchdog is not None:
            watchdog.cancel()
        if reloads is not None:
            reloads.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reloads
        if reconciling is not None:
            await reconciling.stop()
    await relay.stop()


def _announce_ready(inherited: Inherited | None) -> asyncio.Task[None] | None:
    """A relay in one process (not a worker: its supervisor speaks for it) tells systemd it
    serves (``Type=notify``) and keeps its watchdog; the watchdog's task, if any."""
    if inherited is not None:
        return None
    notify("READY=1", "STATUS=serving")
    interval = watchdog_interval_s()
    return None if interval is None else asyncio.create_task(keep_watchdog(interval))


async def _reloads(relay: Relay, hangups: asyncio.Queue[None],
                   hangup: Callable[[Relay], Awaitable[None]]) -> None:
    """Run ``hangup`` once per SIGHUP queued in ``hangups``, each to its end before the next;
    an unexpected error is logged, never ends the relay."""
    while True:
        await hangups.get()
        try:
            await hangup(relay)
        except Exception:
            log.exception("configuration reload failed")


async def _start(relay: Relay) -> None:
    """``relay.start()`` with the operator's usual mistakes turned into :class:`StartupError`
    (a :class:`ConfigError` found only now, such as a Redis database number the server does not
    have, stays one)."""
    try:
        await relay.start()
    except StoreError as exc:
        if exc.op.startswith("ledger"):
            raise StartupError(f"cannot open the audit ledger "
                               f"{redact_url(relay.settings.ledger or '')}: {exc}") from exc
        raise StartupError(f"cannot open the store {redact_url(relay.settings.store)}: "
                           f"{exc}") from exc
    except OSError as exc:  # a port in use, an address not on this host, a name unknown
        raise StartupError(f"cannot listen or read a file: {exc}") from exc
