"""The SMTP session protocol: aiosmtpd's ``SMTP`` with the relay's wire rules.

Enhanced status codes on every reply (RFC 2034), strict paths (RFC 5321 section 4.1.2), a
``421 4.4.2`` before closing an idle client, 998-octet lines, per-chunk DATA timeout, and the
access rules of :class:`relay.access.ConnectionGate` applied before the greeting. The hooks that
decide about mail are in :mod:`relay.listener`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from aiosmtpd.smtp import SMTP, TLSSetupException

from relay import replies
from relay.access import ConnectionGate, Network, address_in
from relay.interfaces import SmtpReply

if TYPE_CHECKING:
    from relay.listener import RelayHandler

log = logging.getLogger("relay.smtp")

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1 controls
# RFC 5321 section 4.1.2: "<" [source route ":"] mailbox ">" then only parameters after a
# blank; a blank or bracket inside the path is allowed in a quoted local part only
_PATH = re.compile(r'<(?:"(?:[^"\\]|\\.)*"|[^<>"\s])*>(?:\s|$)')

# aiosmtpd's own wording of replies the catalogue words better (same codes)
_AIOSMTPD_REWORDED = {
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


class _CommandLineGuard:
    """Wraps the session's StreamReader: a command line must end in CRLF, not LF or CR CRLF.

    aiosmtpd reads commands with ``readuntil()`` (up to a bare LF) and strips CRs, so
    ``RCPT TO:<a@x>\nRCPT TO:<b@y>\r\n`` would be two commands: a recipient smuggled past an
    application that only strips CRLF (RFC 5321 section 2.3.8 allows CRLF only). A bad line
    calls ``on_bad`` (the session answers 421 and closes, as sendmail does: nothing after it on
    this connection can be trusted) and ends the session. A line over the reader's limit reaches
    aiosmtpd in pieces (``read(consumed)`` after a ``LimitOverrunError``, then ``readuntil()``):
    the check then looks at the end of the whole line, so a long line ending in CRLF gets
    aiosmtpd's ``500`` and one ending in a bare LF the ``421``. DATA lines
    (``readuntil(b"\r\n")``) and AUTH responses (``readline()``) pass through unchanged; every
    other attribute is the wrapped reader's (aiosmtpd's STARTTLS writes to private ones).
    """

    __slots__ = ("_inner", "_on_bad", "_overrun", "_tail")
    _inner: asyncio.StreamReader
    _on_bad: Callable[[], None]
    _overrun: bool  # inside an over-long command line
    _tail: bytes  # its last bytes drained so far

    def __init__(self, inner: asyncio.StreamReader, on_bad: Callable[[], None]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_on_bad", on_bad)
        object.__setattr__(self, "_overrun", False)
        object.__setattr__(self, "_tail", b"")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    async def read(self, n: int = -1) -> bytes:
        data = await self._inner.read(n)
        if self._overrun and data:
            self._tail = (self._tail + data)[-2:]
        return data

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        try:
            line = await self._inner.readuntil(separator)
        except asyncio.LimitOverrunError:
            if separator == b"\n":
                self._overrun = True
            raise
        if separator != b"\n":
            return line
        end = self._tail + line if self._overrun else line
        self._overrun, self._tail = False, b""
        # a CR inside the line reaches the path checks (501); one just before the CRLF would be
        # stripped by aiosmtpd unseen
        if not end.endswith(b"\r\n") or end.endswith(b"\r\r\n"):
            self._on_bad()
            raise asyncio.CancelledError  # aiosmtpd's own end for a connection gone mid-command
        return line


class RelaySMTP(SMTP):
    """aiosmtpd's SMTP protocol with the relay's wire rules (DESIGN section 5)."""

    # 998 octets + CRLF + a dot doubled for transparency, which RFC 5321 section 4.5.3.1.6
    # does not count; the exact 998-octet rule is applied after unstuffing, in handle_DATA
    line_length_limit = 1001

    def __init__(self, handler: RelayHandler, *, processing_timeout_s: float,
                 gate: ConnectionGate, proxy_networks: tuple[Network, ...] | None = None,
                 implicit_tls: bool = False, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.gate = gate
        self.implicit_tls = implicit_tls
        self._proxy_networks = proxy_networks
        self._refusal: SmtpReply | None = None
        self._admitted_host: str | None = None
        self._processing_timeout_s = processing_timeout_s
        self._client_timeout_s: float = kwargs.get("timeout", 300.0)
        self._in_helo = False
        self._receiving_data = self._in_data = False
        self.draining = False
        self._data_started = self._data_handled = False
        self._metrics = handler.metrics
        self._sessions = handler.sessions
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit or refuse the client, and count the session (once: STARTTLS calls this again)."""
        if not self._counted:
            self._counted = True
            self._metrics.session(1)
            self._sessions.add(self)
            self._refusal = self._admission(transport)
        super().connection_made(transport)

    def _admission(self, transport: asyncio.BaseTransport) -> SmtpReply | None:
        """The 421 refusal for this client, or None (then it is counted by the gate)."""
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else ""
        if self._proxy_networks is not None:
            # behind a load balancer: the balancer must be trusted; the client's own address
            # is checked when the PROXY header arrives (RelayHandler.handle_PROXY)
            if not address_in(host, self._proxy_networks):
                return replies.CLIENT_NOT_ALLOWED
        elif not self.gate.allows(host):
            return replies.CLIENT_NOT_ALLOWED
        refusal = self.gate.admit(host)
        if refusal is None:
            self._admitted_host = host
        return refusal

    def connection_lost(self, error: Exception | None) -> None:
        """Uncount the session and its connection."""
        if self._counted:
            self._counted = False
            self._metrics.session(-1)
            self._sessions.discard(self)
        if self._admitted_host is not None:
            self.gate.release(self._admitted_host)
            self._admitted_host = None
        super().connection_lost(error)

    async def _handle_client(self) -> None:
        """Greet an admitted client; say ``421 4.7.0`` and close for a refused one."""
        if self._refusal is not None:
            await self.push(str(self._refusal))
            if self.transport is not None:
                self.transport.close()
            return
        await super()._handle_client()

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
        await super().push(status)

    def data_received(self, data: bytes) -> None:
        """While a DATA transfer runs, every chunk restarts the client timeout.

        aiosmtpd restarts its timer per command only, so a long but steady upload would be cut
        off; RFC 5321 section 4.5.3.2.5 times the DATA block per chunk.
        """
        if self._receiving_data:
            self._reset_timeout(self._client_timeout_s)
        super().data_received(data)

    async def smtp_DATA(self, arg: str) -> None:
        """DATA, with the per-chunk timeout of :meth:`data_received` while the body arrives.

        aiosmtpd counts its size limit on the wire, transparency dots included; RFC 1870
        section 3 does not count them. So while the body arrives its limit is raised by the
        most stuffing can add (a third: every line a lone dot), and the exact limit is applied
        to the unstuffed message in the handler.
        """
        self._receiving_data = self._in_data = True
        self._data_started = self._data_handled = False
        exact = self.data_size_limit
        if exact:
            self.data_size_limit = exact + exact // 3 + 4
        try:
            await super().smtp_DATA(arg)
        finally:
            self.data_size_limit = exact
            self._receiving_data = self._in_data = False
        if self._data_started and not self._data_handled and self.transport is not None:
            # aiosmtpd refused the content itself (line too long, too big): count it too
            self._metrics.message("invalid")
        if self.draining:  # the transaction is answered: now the session goes
            self._say_and_close(replies.SHUTTING_DOWN)

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
        self._reader = cast(asyncio.StreamReader,
                            _CommandLineGuard(reader, self._bad_command_line))

    def _bad_command_line(self) -> None:
        log.warning("command line with a bare CR or LF from %s: closing the connection",
                    self._admitted_host or "?")
        self._say_and_close(replies.BARE_CR_OR_LF_IN_COMMAND)

    def _say_and_close(self, reply: SmtpReply) -> None:
        transport = self.transport
        if isinstance(transport, asyncio.WriteTransport) and not transport.is_closing():
            transport.write(f"{reply}\r\n".encode())
            transport.close()

    async def smtp_STARTTLS(self, arg: str) -> None:
        """STARTTLS; inside TLS (after STARTTLS, or on the implicit-TLS port) it is
        ``503 5.5.1`` and the session goes on (RFC 3207 section 4.2)."""
        if self._tls_protocol is not None or self.implicit_tls:
            await self.push(str(replies.TLS_ALREADY_ACTIVE))
            return
        await super().smtp_STARTTLS(arg)

    async def handle_exception(self, error: Exception) -> str:
        """A failed STARTTLS handshake is one WARNING line (scanners make many), not a
        traceback; aiosmtpd then closes the connection. Other errors go to the handler."""
        if isinstance(error, TLSSetupException):
            log.warning("TLS handshake failed with %s: %s", self._admitted_host or "?",
                        error.__cause__ or error)
            return str(replies.INTERNAL_ERROR)  # not sent: aiosmtpd closes the connection
        return await super().handle_exception(error)

    async def smtp_EHLO(self, hostname: str) -> None:
        """EHLO; its 250 lines carry no enhanced code (RFC 2034 section 3)."""
        self._in_helo = True
        try:
            await super().smtp_EHLO(hostname)
        finally:
            self._in_helo = False

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

    async def _call_handler_hook(self, command: str, *args: Any) -> Any:
        if command == "DATA":
            self._receiving_data = False
            self._data_handled = True
            # the idle timer must not cut the client off while upstream works (up to the
            # final-dot timeout): give the whole processing time instead
            self._reset_timeout(self._processing_timeout_s)
        return await super()._call_handler_hook(command, *args)

    def _timeout_cb(self) -> None:
        """Say ``421 4.4.2`` before closing an idle client (RFC 5321 section 4.5.3.2.7)."""
        transport = self.transport
        if isinstance(transport, asyncio.WriteTransport) and not transport.is_closing():
            transport.write(f"{replies.CLIENT_TIMEOUT}\r\n".encode())
        super()._timeout_cb()  # type: ignore[no-untyped-call]  # aiosmtpd leaves it untyped


