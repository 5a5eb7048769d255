"""The SMTP session protocol: aiosmtpd's ``SMTP`` with the relay's wire rules.

Enhanced status codes on every reply (RFC 2034), strict paths (RFC 5321 section 4.1.2), a
``421 4.4.2`` before closing an idle client, 998-octet lines read in bounded memory
(:mod:`relay.smtp.data`), per-chunk DATA timeout and an overall DATA deadline, a session
lifetime and a cap on commands without a message, replies owed to a client that half-closed,
``BDAT`` answered ``521 5.5.1`` with the connection closed (CHUNKING is not offered; the
chunk after it is never read as commands), and the access rules of
:class:`relay.smtp.access.ConnectionGate` applied before the greeting. The hooks that decide
about mail are in :mod:`relay.smtp.handler`; a session knows its handler only
as the :class:`SessionHandler` Protocol, and gets its metrics and the session registry injected
(the handler module imports this one, never the reverse).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any, Protocol, cast

from aiosmtpd.smtp import MISSING, SMTP, Envelope, Session, TLSSetupException, syntax

from relay.core import replies
from relay.core.interfaces import Result, SmtpReply
from relay.smtp.access import ConnectionGate, Network
from relay.smtp.aiosmtpd_init import init_smtp
from relay.smtp.data import REJECT, ClientGone, CommandLineGuard, read_message
from relay.smtp.tls_halfclose import HalfCloseTLSProtocol

log = logging.getLogger("relay.smtp")

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1 controls
# the commands of a mail transaction, and QUIT: not counted against max_idle_commands
_TRANSACTION_COMMANDS = frozenset({b"MAIL", b"RCPT", b"DATA", b"QUIT"})
# past max_recipients: the envelope goes on, so not counted against max_idle_commands either
_RECIPIENT_LIMIT = str(replies.TOO_MANY_RECIPIENTS)
# RFC 5321 section 4.1.2: "<" [source route ":"] mailbox ">" then only parameters after a
# blank; a blank or bracket inside the path is allowed in a quoted local part only
_PATH = re.compile(r'<(?:"(?:[^"\\]|\\.)*"|[^<>"\s])*>(?:\s|$)')

# aiosmtpd's own wording of replies the catalogue words better (same codes)
_AIOSMTPD_REWORDED = {
    # a reply to a command, not the greeting: it takes an enhanced code (RFC 2034 section 3)
    "220 Ready to start TLS": "220 2.0.0 Ready to start TLS",
    "500 Line too long (see RFC5321 4.5.3.1.6)": str(replies.LINE_TOO_LONG),
    "552 Error: Too much mail data": str(replies.MESSAGE_TOO_BIG),
    "552 Error: message size exceeds fixed maximum message size": str(replies.MESSAGE_TOO_BIG),
}


def check_path_argument(arg: str | None, keyword: str) -> SmtpReply | None:
    """Check the raw argument of MAIL (``FROM:``) or RCPT (``TO:``) before aiosmtpd parses it.

    Returns the refusal, or None when aiosmtpd may go on. A path must be enclosed in angle
    brackets (RFC 5321 section 4.1.2: ``Path = "<" ... ">"``; aiosmtpd accepts a bare address)
    and may hold no control character (a lone CR in a quoted local part is a command-injection
    attempt, GHSA-v3q9-hj7j-63hq).
    """
    if arg is None or arg[: len(keyword)].upper() != keyword:
        return None  # aiosmtpd answers its own syntax error
    bad = replies.BAD_SENDER_SYNTAX if keyword == "FROM:" else replies.BAD_RECIPIENT_SYNTAX
    if _CONTROL.search(arg):  # anywhere, also next to the path (TAB, CR, NEL...)
        return bad
    rest = arg[len(keyword) :].strip(" ")
    if not rest.startswith("<"):
        return replies.PATH_NEEDS_BRACKETS
    if not _PATH.match(rest):  # no closing ">", or a blank outside a quoted string
        return bad
    return None


# The plain path "<" Dot-string "@" Domain ">" (RFC 5321 section 4.1.2) in ASCII atext and
# letter-digit-hyphen labels: aiosmtpd's parse (the email package's header parser) gives such an
# address back as written, so it need not run (it is a few % of a session's CPU)
_ATEXT = r"[A-Za-z0-9!#$%&'*+\-/=?^_`{|}~]+"
_PLAIN_PATH = re.compile(rf"<({_ATEXT}(?:\.{_ATEXT})*@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*)>")


def plain_path(arg: str) -> tuple[str, str] | None:
    """``(address, parameters)`` of a MAIL/RCPT argument after its keyword (``<a@x> SIZE=9``
    gives ``("a@x", "SIZE=9")``) when its path is a plain one, else None (then aiosmtpd's own
    parse decides). The result is what aiosmtpd 1.4.6's ``SMTP._getaddr`` returns for it."""
    match = _PLAIN_PATH.match(arg)
    if match is None:
        return None
    rest = arg[match.end() :]
    if rest and (rest[0] not in " \t" or "(" in rest):  # the header parser reads comments
        return None
    return match.group(1), rest.lstrip()


# RFC 3461 section 4: xtext = *( xchar / hexchar ), xchar = "!".."~" but "+" and "=",
# hexchar = "+" two upper-case hex digits (lower case accepted: aiosmtpd upper-cases parameters)
_XTEXT = re.compile(r"(?:[!-*,-<>-~]|\+[0-9A-Fa-f]{2})+")


def take_parameter(arg: str, keyword: str, name: str) -> tuple[str, list[str]]:
    """Split the ``name=value`` parameters off a MAIL/RCPT argument already checked by
    :func:`check_path_argument`.

    Returns ``(arg without them, their values in order)``; the name is matched without
    case (RFC 5321 section 4.1.2, ``esmtp-keyword``). ``"FROM:<a@x> AUTH=<> SIZE=9"`` with
    name ``AUTH`` gives ``("FROM:<a@x> SIZE=9", ["<>"])``.
    """
    rest = arg[len(keyword) :].strip(" ")
    match = _PATH.match(rest)
    if match is None:
        return arg, []
    path = rest[: match.end()].rstrip()
    kept: list[str] = []
    values: list[str] = []
    for param in rest[match.end() :].split():
        key, _eq, value = param.partition("=")
        if key.upper() == name:
            values.append(value)
        else:
            kept.append(param)
    return " ".join([keyword + path, *kept]), values


def xtext_ok(value: str) -> bool:
    """True when ``value`` is a non-empty xtext (RFC 3461 section 4), e.g. ``<>``."""
    return _XTEXT.fullmatch(value) is not None


class SessionHandler(Protocol):
    """The handler a session passes its commands to: :class:`relay.smtp.handler.RelayHandler`.

    The session calls ``handle_DATA`` once the message is read (:meth:`RelaySMTP.smtp_DATA`);
    aiosmtpd looks the other hooks up by name, each optional (``handle_EHLO``,
    ``handle_MAIL``, ``handle_RCPT``, ``handle_PROXY``, ``handle_exception``, ``auth_PLAIN``).
    """

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        """The reply line to the final dot for ``envelope`` (the message in its content)."""
        ...


class SessionMetrics(Protocol):
    """What a session reports (:class:`relay.core.interfaces.Metrics` has it)."""

    def session(self, delta: int) -> None:
        """Add ``delta`` (+1 or -1) to the number of open client sessions."""
        ...

    def message(self, result: Result) -> None:
        """Count one message by its ``result`` (a DATA refused while it arrived: invalid)."""
        ...

    def tls_handshake_failed(self, listener: str) -> None:
        """Count one failed client TLS handshake on ``listener`` (``starttls``, ``implicit``)."""
        ...


class SessionRegistry(Protocol):
    """The open sessions (a ``set``): a session adds itself when its connection is made and
    discards itself when it is lost, so a graceful shutdown finds them all."""

    def add(self, session: RelaySMTP, /) -> None:
        """Register ``session``."""
        ...

    def discard(self, session: RelaySMTP, /) -> None:
        """Unregister ``session`` (no error when it is not registered)."""
        ...


class RelaySMTP(SMTP):
    """aiosmtpd's SMTP protocol with the relay's wire rules (design.md §5.1)."""

    # 998 octets + CRLF + a dot doubled for transparency, which RFC 5321 section 4.5.3.1.6
    # does not count; the exact 998-octet rule is applied after unstuffing (smtp_data)
    line_length_limit = 1001

    def __init__(self, handler: SessionHandler, *, metrics: SessionMetrics,
                 sessions: SessionRegistry, processing_timeout_s: float,
                 gate: ConnectionGate, proxy_networks: tuple[Network, ...] | None = None,
                 implicit_tls: bool = False, data_deadline_s: float = 600.0,
                 session_lifetime_s: float = 3600.0, max_idle_commands: int = 100,
                 bare_newline: str = REJECT, **kwargs: Any) -> None:
        # aiosmtpd sees TLS only through its own STARTTLS layer, so on the implicit-TLS port
        # AUTH must not wait for it (auth_require_tls False); aiosmtpd's constructor would log
        # "auth_required == True but auth_require_tls == False" for every session although the
        # transport is TLS. Its constructor is replaced by one that introspects the session
        # and handler classes once, not per connection (relay.smtp.aiosmtpd_init)
        init_smtp(self, handler, **kwargs)
        self._data_deadline_s = data_deadline_s
        self._session_lifetime_s = session_lifetime_s
        self._max_idle_commands = max_idle_commands
        self._bare_newline = bare_newline
        self._idle_commands = 0
        self._answering: bytes | None = None  # the transaction command being answered
        self._timers: dict[str, asyncio.TimerHandle] = {}  # "lifetime", "data"
        self._close_after_data: SmtpReply | None = None
        self.gate = gate
        self.implicit_tls = implicit_tls
        self._proxy_networks = proxy_networks
        self._refusal: SmtpReply | None = None
        self._gate_counted = False  # the gate counts this connection (release it once)
        self._admitted_host: str | None = None  # the client address the gate counts it under
        self.client_host: str | None = None  # the client: the peer, or the PROXY source
        self._processing_timeout_s = processing_timeout_s
        self._client_timeout_s: float = kwargs.get("timeout", 300.0)
        self._in_helo = False
        self._ehlo_lines: list[str] | None = None  # EHLO's 250- lines, sent with its last
        self._receiving_data = self._in_data = False
        self.draining = False
        self._data_started = self._data_handled = False
        self._metrics = metrics
        self._sessions = sessions
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit or refuse the client, and count the session (once: STARTTLS calls this again)."""
        if not self._counted:
            self._counted = True
            self._metrics.session(1)
            self._sessions.add(self)
            self._refusal = self._admission(transport)
            self._start_timer("lifetime", self._session_lifetime_s, self._lifetime_over)
        super().connection_made(transport)

    def _admission(self, transport: asyncio.BaseTransport) -> SmtpReply | None:
        """The 421 refusal for this client, or None (then it is counted by the gate).

        A connection of the implicit-TLS port was admitted before its handshake
        (:meth:`admitted_before`). Behind a load balancer the balancer must be trusted; the
        client's own address is checked when the PROXY header arrives
        (RelayHandler.handle_PROXY, :meth:`admit_proxied`).
        """
        if self._gate_counted:
            return None
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else ""
        refusal = self.gate.enter(host, self._proxy_networks)
        if refusal is None:
            self.admitted_before(None if self._proxy_networks is not None else host)
        return refusal

    def admitted_before(self, host: str | None) -> None:
        """The gate counted this connection already (under ``host``); release it on close."""
        self._gate_counted = True
        self._admitted_host = self.client_host = host

    def admit_proxied(self, client: str) -> SmtpReply | None:
        """The PROXY header named ``client``: count it against the per-address limit."""
        refusal = self.gate.admit_host(client)
        if refusal is None:
            self._admitted_host = self.client_host = client
        return refusal

    def connection_lost(self, error: Exception | None) -> None:
        """Uncount the session and its connection. A session whose connection was never made
        (an implicit-TLS handshake that failed: asyncio's TLS layer still reports the loss to
        it) has nothing to end; the acceptor released its count and logged the failure."""
        if self.session is None:
            return
        if self._counted:
            self._counted = False
            self._metrics.session(-1)
            self._sessions.discard(self)
        if self._gate_counted:
            self._gate_counted = False
            self.gate.release(self._admitted_host)
        for timer in self._timers.values():
            timer.cancel()
        super().connection_lost(error)

    def eof_received(self) -> bool | None:
        """The client shut down its sending side (a half-close, or a close not yet seen as one).

        aiosmtpd cancels the session here, so an MTA that pipelines the final dot and QUIT and
        then shuts down (Exim) got no 250 for a message the relay had relayed. A half-closed
        client can still read: the commands it sent before the EOF are answered in order, then
        the session ends at the end of its stream (:class:`relay.smtp.data.CommandLineGuard`).
        Over STARTTLS the EOF is a close_notify or a bare TCP EOF, which
        :class:`relay.smtp.tls_halfclose.HalfCloseTLSProtocol` passes on the same way. On the
        implicit-TLS port asyncio's own TLS layer closes the connection itself: the message is
        still processed and logged, its reply cannot go out.
        """
        log.info("EOF from %s: answering what it sent, then closing", self._admitted_host or "?")
        keep_open = asyncio.StreamReaderProtocol.eof_received(self)  # the reader sees the EOF
        if self.session is not None and self.session.ssl is not None:
            return False  # True has no effect on a TLS transport (asyncio warns)
        return keep_open

    async def _handle_client(self) -> None:
        """Greet an admitted client; say ``421 4.7.0`` and close for a refused one.

        However the session ends, the connection is closed with it, so its slots are given
        back at once. aiosmtpd closes it when its command loop ends, but not when its wait for
        the PROXY header ends: a balancer's health check that connects and closes (FIN) held
        its slot until ``proxy_protocol_timeout`` (the EOF leaves a plain transport open).
        """
        if self._refusal is not None:
            await self.push(str(self._refusal))
            if self.transport is not None:
                self.transport.close()
            return
        try:
            await super()._handle_client()
        except asyncio.IncompleteReadError:  # only the header wait lets it out (data.py)
            peer = self.session.peer if self.session is not None else None
            log.debug("%s closed the connection before its PROXY header",  # every LB check
                      peer[0] if isinstance(peer, tuple) else "?")
        finally:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()

    async def smtp_AUTH(self, arg: str) -> None:
        """AUTH, answered ``502 5.5.1`` when the relay has no credentials configured.

        The mechanism name is matched without regard to case (``AUTH plain``): RFC 4422
        section 3.1 names mechanisms in upper case, and clients that send lower case exist;
        aiosmtpd alone would answer them 504.
        """
        if not self._auth_methods:
            await self.push(str(replies.AUTH_NOT_AVAILABLE))
            return
        mechanism, sep, rest = (arg or "").partition(" ")
        await super().smtp_AUTH(mechanism.upper() + sep + rest)

    async def push(self, status: str | bytes) -> None:
        """Send one reply line, with an RFC 3463 code added when aiosmtpd built it without.

        Bytes (aiosmtpd's AUTH ``334`` challenges) go out unchanged.
        """
        if isinstance(status, bytes):
            await super().push(status)
            return
        # aiosmtpd echoes client bytes in some replies ("command X not recognized"): a CR, LF
        # or NUL must never reach the wire inside a reply line
        status = _CONTROL.sub("?", _AIOSMTPD_REWORDED.get(status, status))
        if status.startswith("354"):
            self._data_started = True
        if not (self._in_helo and status.startswith("250")):
            status = replies.with_enhanced_code(status)
        if self._ehlo_lines is not None:  # one write for the whole EHLO reply, not one a line
            if status.startswith("250-"):
                self._ehlo_lines.append(status)
                return
            status = "\r\n".join([*self._ehlo_lines, status])
            self._ehlo_lines = None
        answering, self._answering = self._answering, None
        await super().push(status)
        if (answering in (b"MAIL", b"RCPT", b"DATA") and status[:1] in ("4", "5")
                and status != _RECIPIENT_LIMIT):
            # a refused MAIL/RCPT/DATA is no progress either; a recipient past the limit is
            # (the client sends the envelope it has, and its message follows)
            self._count_idle()

    def data_received(self, data: bytes) -> None:
        """While a DATA transfer runs, every chunk restarts the client timeout.

        aiosmtpd restarts its timer per command only, so a long but steady upload would be cut
        off; RFC 5321 section 4.5.3.2.5 times the DATA block per chunk.
        """
        if self._receiving_data:
            self._reset_timeout(self._client_timeout_s)
        super().data_received(data)

    @syntax("DATA")
    async def smtp_DATA(self, arg: str) -> None:
        """DATA: the body is read by :func:`relay.smtp.data.read_message` (line and size limits
        held while it arrives, in bounded memory), with the per-chunk timeout of
        :meth:`data_received` and ``data_deadline_s`` from the 354 to the final dot (then
        ``421 4.4.2`` and close). A session told to end meanwhile (shutdown, lifetime) ends
        once this transaction is answered.
        """
        self._receiving_data = self._in_data = True
        self._data_started = self._data_handled = False
        try:
            await self._data_transaction(arg)
        finally:
            self._receiving_data = self._in_data = False
            self._stop_timer("data")
        if self._data_started and not self._data_handled and self.transport is not None:
            # refused while reading (line too long, too big): counted like the handler's
            self._metrics.message(Result.INVALID)
        closing = replies.SHUTTING_DOWN if self.draining else self._close_after_data
        if closing is not None:  # the transaction is answered: now the session goes
            self._say_and_close(closing)

    async def _data_transaction(self, arg: str) -> None:
        """aiosmtpd's DATA checks and replies, around the relay's own body reader."""
        if await self.check_helo_needed() or await self.check_auth_needed("DATA"):
            return
        assert self.envelope is not None
        if not self.envelope.rcpt_tos:
            await self.push("503 Error: need RCPT command")
            return
        if arg:
            await self.push("501 Syntax: DATA")
            return
        await self.push("354 End data with <CR><LF>.<CR><LF>")
        self._start_timer("data", self._data_deadline_s, self._data_too_slow)
        try:
            content = await read_message(self._data_stream(), max_size=self.data_size_limit,
                                         bare_newline=self._bare_newline)
        except ClientGone:
            raise asyncio.CancelledError from None  # aiosmtpd's end for a gone client
        self._stop_timer("data")
        if isinstance(content, SmtpReply):
            self._set_post_data_state()  # type: ignore[no-untyped-call]  # aiosmtpd
            await self.push(str(content))
            return
        self.envelope.content = self.envelope.original_content = content
        status = await self._call_handler_hook("DATA")
        self._set_post_data_state()  # type: ignore[no-untyped-call]  # aiosmtpd
        await self.push("250 OK" if status is MISSING else status)

    def _data_stream(self) -> asyncio.StreamReader:
        """The client's stream without the command-line check (DATA lines are content)."""
        reader: object = self._reader
        return reader.stream if isinstance(reader, CommandLineGuard) else self._reader

    def _start_timer(self, name: str, delay_s: float, callback: Callable[[], None]) -> None:
        self._stop_timer(name)
        self._timers[name] = self.loop.call_later(delay_s, callback)

    def _stop_timer(self, name: str) -> None:
        timer = self._timers.pop(name, None)
        if timer is not None:
            timer.cancel()

    def _data_too_slow(self) -> None:
        """Past ``data_deadline_s`` without the final dot: ``421 4.4.2`` and close."""
        log.warning("DATA from %s not ended after %g s: closing the connection",
                    self._admitted_host or "?", self._data_deadline_s)
        self._say_and_close(replies.DATA_DEADLINE)

    def _lifetime_over(self) -> None:
        """Past ``session_lifetime_s``: ``421 4.4.2`` and close, after the message in DATA."""
        if self._in_data:  # being received (the DATA deadline bounds it) or processed
            self._close_after_data = replies.SESSION_TOO_LONG
            return
        log.info("session of %s reached its lifetime of %g s: closing the connection",
                 self._admitted_host or "?", self._session_lifetime_s)
        self._say_and_close(replies.SESSION_TOO_LONG)

    def _command_seen(self, line: bytes) -> bool:
        """Count a command outside a mail transaction; past ``max_idle_commands`` since the
        last message, say ``421 4.7.0``, close and return False. ``BDAT`` (CHUNKING is not
        offered) is ``521 5.5.1`` and the end of the session, before aiosmtpd sees it: the
        chunk that follows it on the wire (RFC 3030 section 2) is message content, never
        to be read as commands."""
        words = line.split(None, 1)
        if words and words[0].upper() == b"BDAT":
            log.warning("BDAT from %s (CHUNKING is not offered): closing the connection",
                        self._admitted_host or "?")
            self._say_and_close(replies.BDAT_NOT_IMPLEMENTED)
            return False
        if words and words[0].upper() in _TRANSACTION_COMMANDS:
            self._answering = words[0].upper()  # counted in push() if it is refused
            return True
        return self._count_idle()

    def _count_idle(self) -> bool:
        """One more command that made no progress towards a message; past
        ``max_idle_commands`` since the last message, say ``421 4.7.0``, close, return False."""
        self._idle_commands += 1
        if self._idle_commands <= self._max_idle_commands:
            return True
        log.warning("%s sent %d commands without a message: closing the connection",
                    self._admitted_host or "?", self._idle_commands)
        self._say_and_close(replies.TOO_MANY_IDLE_COMMANDS)
        return False

    def begin_shutdown(self) -> None:
        """Graceful stop: an idle session is told ``421 4.3.2`` and closed now; one inside DATA
        (receiving the body, or waiting for the upstream) finishes its transaction first."""
        self.draining = True
        if not self._in_data:
            self._say_and_close(replies.SHUTTING_DOWN)

    @property
    def busy(self) -> bool:
        """True from DATA until its reply: the body is arriving or the upstream is working."""
        return self._in_data

    def close_now(self) -> None:
        """Past the shutdown grace: ``421 4.3.2`` and close, whatever the session is doing."""
        self._say_and_close(replies.SHUTTING_DOWN)

    def _cb_client_connected(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        super()._cb_client_connected(reader, writer)
        # duck-typed: it is the reader to aiosmtpd, with the line check in front
        self._reader = cast(asyncio.StreamReader, CommandLineGuard(
            reader, self._bad_command_line, self._command_seen))

    def _bad_command_line(self) -> None:
        log.warning("command line with a bare CR or LF from %s: closing the connection",
                    self._admitted_host or "?")
        self._say_and_close(replies.BARE_CR_OR_LF_IN_COMMAND)

    def _say_and_close(self, reply: SmtpReply) -> None:
        transport = _writable(self.transport)
        if transport is not None:
            transport.write(f"{reply}\r\n".encode())
            transport.close()

    async def smtp_STARTTLS(self, arg: str) -> None:
        """STARTTLS; inside TLS (after STARTTLS, or on the implicit-TLS port) it is
        ``503 5.5.1`` and the session goes on (RFC 3207 section 4.2)."""
        if self._tls_protocol is not None or self.implicit_tls:
            await self.push(str(replies.TLS_ALREADY_ACTIVE))
            return
        if arg or not self.tls_context:
            await super().smtp_STARTTLS(arg)  # aiosmtpd's 501 / 454
            return
        await self.push("220 Ready to start TLS")
        # aiosmtpd's own STARTTLS, with a TLS layer that lets a half-closed client read its
        # replies (relay.smtp.tls_halfclose)
        waiter = self.loop.create_future()
        self._tls_protocol = HalfCloseTLSProtocol(
            self.loop, self, self.tls_context, waiter, server_side=True)
        self._original_transport = self.transport
        assert self._original_transport is not None
        self._original_transport.set_protocol(self._tls_protocol)
        self.transport = self._tls_protocol._app_transport
        self._tls_protocol.connection_made(self._original_transport)
        try:
            await waiter
        except asyncio.CancelledError:
            raise
        except Exception as error:
            raise TLSSetupException() from error

    def tls_failed(self, listener: str, host: str, error: BaseException) -> None:
        """A client's TLS handshake on ``listener`` (``starttls``, ``implicit``) failed: one
        INFO line (scanners and old clients make many; nothing for an operator to do) and
        ``relay_tls_handshake_failures_total``."""
        log.info("TLS handshake failed with %s: %s", host, str(error) or type(error).__name__)
        self._metrics.tls_handshake_failed(listener)

    async def handle_exception(self, error: Exception) -> str:
        """A failed STARTTLS handshake is :meth:`tls_failed`, not a traceback; aiosmtpd then
        closes the connection. Other errors go to the handler."""
        if isinstance(error, TLSSetupException):
            self.tls_failed("starttls", self._admitted_host or "?", error.__cause__ or error)
            return str(replies.INTERNAL_ERROR)  # not sent: aiosmtpd closes the connection
        return await super().handle_exception(error)

    async def smtp_EHLO(self, hostname: str) -> None:
        """EHLO; its 250 lines carry no enhanced code (RFC 2034 section 3) and go out in one
        write (aiosmtpd writes and drains each line)."""
        self._in_helo = True
        self._ehlo_lines = []
        try:
            await super().smtp_EHLO(hostname)
        finally:
            self._in_helo = False
            self._ehlo_lines = None

    async def smtp_HELO(self, hostname: str) -> None:
        """HELO; its 250 line carries no enhanced code (RFC 2034 section 3)."""
        self._in_helo = True
        try:
            await super().smtp_HELO(hostname)
        finally:
            self._in_helo = False

    async def smtp_MAIL(self, arg: str | None) -> None:
        """MAIL FROM, refused early when the path lacks brackets or holds control characters.

        Where EHLO advertised AUTH, its ``AUTH=`` parameter (RFC 4954 section 5) is accepted
        with ``<>`` or any xtext (else ``501 5.5.4``) and not passed on: the relay does not
        vouch for the original submitter, and the upstream gets no parameter it did not
        advertise. aiosmtpd checks SIZE, BODY and SMTPUTF8 and answers ``555 5.5.4`` to any
        other parameter.
        """
        refusal = check_path_argument(arg, "FROM:")
        if refusal is not None:
            await self.push(str(refusal))
            return
        if arg is not None and self._auth_advertised():
            arg, values = take_parameter(arg, "FROM:", "AUTH")
            if values and (len(values) > 1 or not xtext_ok(values[0])):
                await self.push(str(replies.BAD_AUTH_PARAMETER))
                return
        await super().smtp_MAIL(arg)

    def _auth_advertised(self) -> bool:
        """True when this session's EHLO listed AUTH (mechanisms, and TLS where required)."""
        return (self.session is not None and self.session.extended_smtp
                and bool(self._auth_methods)
                and (not self._auth_require_tls or self._tls_protocol is not None))

    async def smtp_RCPT(self, arg: str | None) -> None:
        """RCPT TO, refused early when the path lacks brackets or holds control characters."""
        refusal = check_path_argument(arg, "TO:")
        if refusal is not None:
            await self.push(str(refusal))
            return
        await super().smtp_RCPT(arg)

    def _getaddr(self, arg: str) -> tuple[str | None, str | None]:
        """aiosmtpd's address parse, :func:`plain_path` first (``local_part_limit`` unset)."""
        plain = plain_path(arg)
        if plain is None or self.local_part_limit:
            return super()._getaddr(arg)
        return plain

    async def _call_handler_hook(self, command: str, *args: Any) -> Any:
        if command == "DATA":
            self._receiving_data = False
            self._data_handled = True
            self._idle_commands = 0  # a message: the client is not idling
            # the idle timer must not cut the client off while upstream works (up to the
            # final-dot timeout): give the whole processing time instead
            self._reset_timeout(self._processing_timeout_s)
        return await super()._call_handler_hook(command, *args)

    def _timeout_cb(self) -> None:
        """Say ``421 4.4.2`` before closing an idle client (RFC 5321 section 4.5.3.2.7)."""
        transport = _writable(self.transport)
        if transport is not None:
            transport.write(f"{replies.CLIENT_TIMEOUT}\r\n".encode())
        super()._timeout_cb()  # type: ignore[no-untyped-call]  # aiosmtpd leaves it untyped


def _writable(transport: asyncio.BaseTransport | None) -> asyncio.WriteTransport | None:
    """``transport`` when it is open and has ``write``, else None; duck-typed, as uvloop's
    transports are not :class:`asyncio.WriteTransport` subclasses."""
    if transport is None or transport.is_closing() or not callable(
            getattr(transport, "write", None)):
        return None
    return cast(asyncio.WriteTransport, transport)
