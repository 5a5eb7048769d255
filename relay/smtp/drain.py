"""The listener's part of a graceful shutdown (design.md §6.6): stop accepting, tell every
session, wait for the transactions inside DATA and for what is still pending, and past the
grace cut what is left. Logs as ``relay.app`` (the relay's stop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from relay.core.cancellation import AFTER_DOT_WAIT_S
from relay.smtp.handler import RelayHandler
from relay.smtp.implicit_tls import ImplicitTlsFactory

log = logging.getLogger("relay.app")

Pending = Callable[[], set[asyncio.Task[Any]]]
"""What a stop waits for besides the sessions: the messages being decided, the settles being
retried, the notices still being sent."""


async def drain(handler: RelayHandler, servers: Sequence[asyncio.Server],
                tls_factory: ImplicitTlsFactory | None, pending: Pending, *, grace_s: float,
                store_timeout_s: float) -> None:
    """1. Stop accepting connections (and end the implicit-TLS handshakes still running: one
    finishing now would start a session). 2. Idle sessions are told ``421 4.3.2`` and closed;
    sessions inside DATA finish that transaction, then get the same. 3. Wait up to
    ``grace_s`` seconds for them and for ``pending``. 4. Past the grace, cancel what is left
    (the core settles a cut transaction: released before its final dot, UNKNOWN past it),
    waiting for a transaction whose dot is out for its reply (at most
    :data:`AFTER_DOT_WAIT_S` and 4 store calls of ``store_timeout_s``), then close every
    session."""
    for server in servers:
        server.close()
    if tls_factory is not None:
        tls_factory.cancel_handshakes()
    for session in list(handler.sessions):
        session.begin_shutdown()
    if await _drained(handler, pending, grace_s):
        return
    left = pending()
    messages = len(handler.tasks)
    log.warning("shutdown grace over: cutting %d message(s) and %d settle retry loop(s) "
                "(what they still owe stays in the settle journal)",
                messages, len(left) - messages)
    for task in left:
        task.cancel()
    with contextlib.suppress(TimeoutError):
        # a transaction whose final dot is out waits for its reply first
        await asyncio.wait_for(asyncio.gather(*left, return_exceptions=True),
                               AFTER_DOT_WAIT_S + 4 * store_timeout_s)
    await _drained(handler, pending, 1.0)  # let the cut transactions' sessions send their 451
    for session in list(handler.sessions):
        session.close_now()


async def _drained(handler: RelayHandler, pending: Pending, grace_s: float) -> bool:
    """Wait until no session is inside DATA and nothing is pending; False past the grace."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while loop.time() < deadline:
        if not any(s.busy for s in handler.sessions) and not pending():
            return True
        await asyncio.sleep(0.05)
    return False
