"""A server-side TLS layer that lets a half-closed client read its replies (design.md §5.1).

asyncio's :class:`asyncio.sslproto.SSLProtocol` (Python 3.11) closes the connection as soon as
the client is done sending: on its close_notify it starts the TLS shutdown, on a bare TCP EOF it
flushes and closes, and the replies the SMTP session still owes are dropped. An MTA that
pipelines the final dot and QUIT and then shuts down its sending side (Exim) therefore never read
its 250. :class:`HalfCloseTLSProtocol` passes the client's end of sending to the session as an
EOF and keeps the connection open for writing; the TLS shutdown starts when the session closes
its transport, after its last reply (RFC 5321 section 4.1.1.10 gives QUIT its reply; RFC 8446
section 6.1 lets a TLS 1.3 peer write after receiving close_notify).

It builds on asyncio's private TLS state machine (``_state``, ``_app_state``,
``_app_transport``): the tests of the STARTTLS half-close pin its behaviour on the Python the
project runs on.
"""

from __future__ import annotations

import asyncio
import logging
from asyncio import sslproto
from typing import Any, cast

log = logging.getLogger("relay.smtp.tls")


class HalfCloseTLSProtocol(sslproto.SSLProtocol):
    """:class:`asyncio.sslproto.SSLProtocol`, but the client's end of sending is an EOF for
    the application, not the end of the connection (see the module docstring)."""

    _peer_done = False  # the client sent close_notify or a TCP EOF

    # typeshed says None; asyncio's own method returns True in one branch, and the transport
    # keeps a half-closed socket open only on a true value
    def eof_received(self) -> bool | None:  # type: ignore[override]
        """A bare TCP EOF from the client: tell the application, keep the socket open for our
        replies (True), and skip the TLS unwrap later (no close_notify can come)."""
        state: Any = getattr(self, "_state", None)
        if state is not sslproto.SSLProtocolState.WRAPPED:
            result: bool | None = super().eof_received()
            return result
        self._eof_received = True
        self._call_eof_received()
        return True

    def _call_eof_received(self) -> None:
        """Tell the application once that the client is done sending (close_notify or EOF)."""
        self._peer_done = True
        con_made = sslproto.AppProtocolState.STATE_CON_MADE
        if getattr(self, "_app_state", None) is not con_made:
            return
        self._app_state = sslproto.AppProtocolState.STATE_EOF
        app_protocol = cast(asyncio.Protocol, self._app_protocol)
        try:
            app_protocol.eof_received()
        except Exception as exc:  # as asyncio handles a failing eof_received
            self._fatal_error(exc, "Error calling eof_received()")

    def _start_shutdown(self) -> None:
        """Start the TLS shutdown, unless only the client is done: then the application's own
        close (after its last reply) starts it."""
        app = getattr(self, "_app_transport", None)
        if self._peer_done and app is not None and not getattr(app, "_closed", True):
            return
        super()._start_shutdown()
