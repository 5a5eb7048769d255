"""The aiosmtpd adapter: the SMTP listener, served in the main event loop.

:class:`RelaySMTP` is aiosmtpd's ``SMTP`` protocol with the relay's wire rules (enhanced status
codes on every reply, strict paths, a ``421`` on timeout, 998-octet lines);
:class:`RelayHandler` holds the hooks that check the envelope and hand each message to the
dedup core. Built with :func:`smtp_factory` and served by ``loop.create_server``, never by
aiosmtpd's threaded ``Controller``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

from aiosmtpd.smtp import SMTP, Envelope, Session

from relay import replies
from relay.dedup import Decision, DedupCore, InboundMessage
from relay.errors import InvalidAddressError
from relay.fingerprint import normalize_recipient
from relay.interfaces import Metrics, SmtpReply
from relay.logfmt import mask_address

log = logging.getLogger("relay.listener")

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_BARE_CR_OR_LF = re.compile(rb"\r(?!\n)|(?<!\r)\n")
_UPSTREAM_QUEUE_ID = re.compile(r"(?:queued as|queue id|id=)\s*([A-Za-z0-9._:-]+)", re.I)
# RFC 5321 section 4.1.2: "<" [source route ":"] mailbox ">" then only parameters after a
# blank; a blank or bracket inside the path is allowed in a quoted local part only
_PATH = re.compile(r'<(?:"(?:[^"\\]|\\.)*"|[^<>"\s])*>(?:\s|$)')
_SAFE_HELO = re.compile(r"^[A-Za-z0-9.\-_:\[\]]{1,255}$")


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
    rest = arg[len(keyword) :].strip()
    bad = replies.BAD_SENDER_SYNTAX if keyword == "FROM:" else replies.BAD_RECIPIENT_SYNTAX
    if _CONTROL.search(rest):
        return bad
    if not rest.startswith("<"):
        return replies.PATH_NEEDS_BRACKETS
    if not _PATH.match(rest):  # no closing ">", or a blank outside a quoted string
        return bad
    return None


class RelaySMTP(SMTP):
    """aiosmtpd's SMTP protocol with the relay's wire rules (DESIGN section 5)."""

    # 998 octets + CRLF (RFC 5321 section 4.5.3.1.6); also the StreamReader limit
    line_length_limit = 1000

    def __init__(self, handler: RelayHandler, *, processing_timeout_s: float,
                 **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._processing_timeout_s = processing_timeout_s
        self._client_timeout_s: float = kwargs.get("timeout", 300.0)
        self._in_helo = False
        self._receiving_data = False
        self._data_started = self._data_handled = False
        self._metrics = handler.metrics
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Count the session once (STARTTLS calls this again for the same session)."""
        if not self._counted:
            self._counted = True
            self._metrics.session(1)
        super().connection_made(transport)

    def connection_lost(self, error: Exception | None) -> None:
        """Uncount the session."""
        if self._counted:
            self._counted = False
            self._metrics.session(-1)
        super().connection_lost(error)

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
        """DATA, with the per-chunk timeout of :meth:`data_received` while the body arrives."""
        self._receiving_data = True
        self._data_started = self._data_handled = False
        try:
            await super().smtp_DATA(arg)
        finally:
            self._receiving_data = False
        if self._data_started and not self._data_handled and self.transport is not None:
            # aiosmtpd refused the content itself (line too long, too big): count it too
            self._metrics.message("invalid")

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
        """MAIL FROM, refused early when the path lacks brackets or holds control characters."""
        refusal = check_path_argument(arg, "FROM:")
        if refusal is not None:
            await self.push(str(refusal))
            return
        await super().smtp_MAIL(arg)

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


@dataclass(frozen=True)
class ListenerLimits:
    """Listener limits: ``max_recipients`` per message, ``max_message_size`` in bytes."""

    hostname: str
    max_recipients: int = 100
    max_message_size: int = 10 * 1024 * 1024
    client_timeout_s: float = 300.0
    local_part_case_sensitive: bool = False
    log_recipients: bool = False


class RelayHandler:
    """aiosmtpd hooks: check the envelope, then hand each message to the dedup core."""

    def __init__(self, *, core: DedupCore, metrics: Metrics, limits: ListenerLimits) -> None:
        self._core = core
        self.metrics = metrics
        self._limits = limits
        self.tasks: set[asyncio.Task[Decision]] = set()

    async def handle_EHLO(self, server: SMTP, session: Session, envelope: Envelope,
                          hostname: str, responses: list[str]) -> list[str]:
        """Advertise PIPELINING and ENHANCEDSTATUSCODES beside aiosmtpd's extensions."""
        session.host_name = hostname
        keywords = [r[4:] for r in responses[1:] if r[4:] != "HELP"]
        keywords += ["PIPELINING", "ENHANCEDSTATUSCODES"]
        lines = [responses[0]] + [f"250-{k}" for k in keywords[:-1]] + [f"250 {keywords[-1]}"]
        return lines

    def _check_address(self, address: str, envelope: Envelope) -> SmtpReply | None:
        if any("\udc80" <= ch <= "\udcff" for ch in address):  # surrogate-escaped bytes
            return replies.INVALID_UTF8
        if not address.isascii() and not envelope.smtp_utf8:
            return replies.NON_ASCII_WITHOUT_SMTPUTF8
        return None

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, mail_options: list[str]) -> str:
        """Accept the reverse path (``<>`` allowed, RFC 5321 section 4.5.5)."""
        refusal = self._check_address(address, envelope)
        if refusal is not None:
            return str(refusal)
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return str(replies.SENDER_OK)

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, rcpt_options: list[str]) -> str:
        """Accept a forward path, up to ``max_recipients`` (RFC 5321 section 4.5.3.1.8)."""
        refusal = self._check_address(address, envelope)
        if refusal is not None:
            return str(refusal)
        if len(envelope.rcpt_tos) >= self._limits.max_recipients:
            return str(replies.TOO_MANY_RECIPIENTS)
        try:
            normalize_recipient(
                address, local_part_case_sensitive=self._limits.local_part_case_sensitive)
        except InvalidAddressError:
            return str(replies.BAD_RECIPIENT_ADDRESS)
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return str(replies.RECIPIENT_OK)

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        """Check the content, then let the core relay it; the reply is the core's decision."""
        content: bytes = envelope.original_content or b""
        self.metrics.message_bytes(len(content))
        queue_id = secrets.token_hex(6)
        if _BARE_CR_OR_LF.search(content):
            return self._refuse(queue_id, replies.BARE_CR_OR_LF)
        if b"\x00" in content:
            return self._refuse(queue_id, replies.NUL_IN_MESSAGE)
        mail_from = "" if envelope.mail_from in (None, "<>") else str(envelope.mail_from)
        # what the message needs, not what the client declared (RFC 6531 section 3.4):
        # an all-ASCII message goes without SMTPUTF8 / BODY=8BITMIME to any upstream
        header_section = content.split(b"\r\n\r\n", 1)[0]
        utf8_headers = bool(envelope.smtp_utf8) and not header_section.isascii()
        smtputf8 = utf8_headers or not all(
            a.isascii() for a in [mail_from, *envelope.rcpt_tos])
        msg = InboundMessage(
            mail_from=mail_from, rcpt_tos=list(envelope.rcpt_tos), content=content,
            trace=self._received(session, queue_id, smtputf8), smtputf8=smtputf8,
            eight_bit=not content.isascii(), utf8_headers=utf8_headers, queue_id=queue_id)
        started = time.perf_counter()
        # shielded: a client that hangs up mid-wait must not cancel an upstream transaction
        # half way (the reservation would be left PENDING with the message maybe delivered)
        self.metrics.in_progress(1)
        task = asyncio.ensure_future(self._core.process(msg))
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        decision = await asyncio.shield(task)
        self._log_decision(msg, decision, time.perf_counter() - started, len(content))
        return str(decision.reply)

    def _task_done(self, task: asyncio.Task[Decision]) -> None:
        self.tasks.discard(task)
        self.metrics.in_progress(-1)

    def _refuse(self, queue_id: str, reply: SmtpReply) -> str:
        self.metrics.message("invalid")
        log.warning("message refused", extra={"queue_id": queue_id, "reply": str(reply)})
        return str(reply)

    def _received(self, session: Session, queue_id: str, smtputf8: bool) -> bytes:
        """The ``Received:`` trace header (RFC 5321 section 4.4), CRLF-terminated bytes."""
        helo = session.host_name or "unknown"
        if not _SAFE_HELO.match(helo):
            helo = "invalid-helo"
        peer = session.peer[0] if isinstance(session.peer, tuple) else "unknown"
        proto = "UTF8SMTP" if smtputf8 else ("ESMTP" if session.extended_smtp else "SMTP")
        if session.ssl:
            proto += "S"
        return (
            f"Received: from {helo} ([{peer}])\r\n"
            f"\tby {self._limits.hostname} (dedup-relay) with {proto} id {queue_id};\r\n"
            f"\t{format_datetime(datetime.now(UTC))}\r\n"
        ).encode("ascii", "replace")

    def _log_decision(self, msg: InboundMessage, decision: Decision, seconds: float,
                      size: int) -> None:
        """One structured line per message decision (no body, recipients masked by default)."""
        show: Callable[[str], str] = (
            (lambda a: a) if self._limits.log_recipients else mask_address)
        upstream = decision.upstream_reply
        match = _UPSTREAM_QUEUE_ID.search(upstream.text) if upstream is not None else None
        log.info("message", extra={
            "queue_id": msg.queue_id,
            "result": decision.result,
            "reply": str(decision.reply),
            "outcomes": {show(r): o for r, o in decision.outcomes.items()},
            "upstream_reply": str(upstream) if upstream is not None else None,
            "upstream_queue_id": match.group(1) if match else None,
            "bytes": size,
            "latency_ms": round(seconds * 1000, 1),
        })

    async def handle_exception(self, error: Exception) -> str:
        """Log the exception and answer ``451 4.3.0`` without leaking its text."""
        log.error("session exception: %s", type(error).__name__, exc_info=error)
        return str(replies.INTERNAL_ERROR)


def smtp_factory(handler: RelayHandler, limits: ListenerLimits,
                 processing_timeout_s: float) -> Callable[[], RelaySMTP]:
    """Return the protocol factory for ``loop.create_server`` (one RelaySMTP per connection)."""

    def factory() -> RelaySMTP:
        return RelaySMTP(
            handler,
            processing_timeout_s=processing_timeout_s,
            hostname=limits.hostname,
            data_size_limit=limits.max_message_size,
            enable_SMTPUTF8=True,
            decode_data=False,
            timeout=limits.client_timeout_s,
            ident="dedup-relay ESMTP",
        )

    return factory
