"""The aiosmtpd adapter: the handler hooks of the SMTP listener, and its protocol factory.

:class:`RelayHandler` holds the hooks that check the envelope and hand each message to the
dedup core; the wire rules live in :class:`relay.smtp.session.RelaySMTP`. Built with
:func:`smtp_factory` and served by ``loop.create_server`` in the main event loop, never by
aiosmtpd's threaded ``Controller``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import TYPE_CHECKING

from aiosmtpd.proxy_protocol import V2_CMD, ProxyData
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, Session

from relay.core import replies
from relay.core.address import mailbox_problem, mask_address
from relay.core.dedup import Decision, InboundMessage
from relay.core.errors import InvalidAddressError
from relay.core.headers import parse_message
from relay.core.interfaces import Metrics, Result, SmtpReply
from relay.core.message import MessageCore
from relay.core.queue_id import upstream_queue_id
from relay.core.recipients import normalize_recipient
from relay.smtp.access import ConnectionGate, Network, sender_allowed
from relay.smtp.data import NORMALIZE, has_bare_cr_or_lf
from relay.smtp.session import RelaySMTP

if TYPE_CHECKING:
    from relay.smtp.auth import SaslMechanisms

log = logging.getLogger("relay.smtp.handler")

_SAFE_HELO = re.compile(r"^[A-Za-z0-9.\-_:\[\]]{1,255}$")


@dataclass(frozen=True)
class ListenerLimits:
    """Listener limits: ``max_recipients`` per message, ``max_message_size`` in bytes; a
    session's DATA ends ``data_deadline_s`` after the 354, the session ``session_lifetime_s``
    after connect, or at ``max_idle_commands`` commands without a message. ``bare_newline``:
    ``normalize`` takes a content line ending in a bare LF as ending in CRLF, ``reject`` leaves
    it to the ``550 5.6.0`` (:func:`relay.smtp.data.read_message`). ``console_url``: the
    console's external URL, whose page of each message the decision log line links
    (``console``: ``URL/message/QUEUE_ID``); None: no link. ``add_message_id``: a message
    without a Message-ID field gets ``<QUEUE-ID@hostname>`` (RFC 5322 section 3.6.4)."""

    hostname: str
    max_recipients: int = 1000
    max_message_size: int = 10 * 1024 * 1024
    client_timeout_s: float = 300.0
    data_deadline_s: float = 600.0
    session_lifetime_s: float = 3600.0
    max_idle_commands: int = 100
    local_part_case_sensitive: bool = False
    log_recipients: bool = False
    allowed_senders: tuple[str, ...] = ()
    bare_newline: str = NORMALIZE
    console_url: str | None = None
    add_message_id: bool = True


@dataclass(frozen=True)
class ListenerSecurity:
    """Who may talk to the listener and how (design.md §5.1, "Access").

    ``tls_context`` enables STARTTLS (and the implicit-TLS listener); ``tls_required`` refuses
    mail commands before STARTTLS (RFC 3207 section 4); AUTH is offered only over TLS and
    only when ``auth_enabled``; ``auth_required`` refuses MAIL before AUTH (``530 5.7.0``);
    ``proxy_networks`` (set when PROXY protocol is on) are the balancers allowed to send it,
    ``proxy_timeout_s`` the seconds a connection has to send its header.
    """

    gate: ConnectionGate
    tls_context: ssl.SSLContext | None = None
    tls_required: bool = False
    auth_enabled: bool = False
    auth_required: bool = False
    proxy_networks: tuple[Network, ...] | None = None
    proxy_timeout_s: float = 10.0


class RelayHandler:
    """aiosmtpd hooks: check the envelope, then hand each message to the dedup core."""

    def __init__(self, *, core: MessageCore, metrics: Metrics, limits: ListenerLimits,
                 sasl: SaslMechanisms | None = None) -> None:
        self._core = core
        self.metrics = metrics
        self._limits = limits
        self._sasl = sasl
        self.tasks: set[asyncio.Task[Decision]] = set()
        self.sessions: set[RelaySMTP] = set()  # open client sessions, for graceful shutdown

    def set_allowed_senders(self, patterns: tuple[str, ...]) -> None:
        """Check the next MAIL FROM of every session against ``patterns`` (a configuration
        reload; :func:`relay.smtp.access.sender_allowed`)."""
        self._limits = replace(self._limits, allowed_senders=patterns)

    async def auth_PLAIN(self, server: SMTP, args: list[str]) -> AuthResult:
        """AUTH PLAIN (RFC 4616) against the credentials file."""
        if self._sasl is None:
            return AuthResult(success=False, handled=False, message=str(replies.AUTH_NOT_AVAILABLE))
        return await self._sasl.auth_PLAIN(server, args)

    async def auth_LOGIN(self, server: SMTP, args: list[str]) -> AuthResult:
        """AUTH LOGIN (draft-murchison-sasl-login) against the credentials file."""
        if self._sasl is None:
            return AuthResult(success=False, handled=False, message=str(replies.AUTH_NOT_AVAILABLE))
        return await self._sasl.auth_LOGIN(server, args)

    async def handle_PROXY(self, server: SMTP, session: Session, envelope: Envelope,
                           proxy_data: ProxyData) -> bool:
        """Behind a balancer: admit the client by the source address the PROXY header gives,
        and count it against the per-address limit (a refusal is answered 421 4.7.0).

        A v2 ``LOCAL`` header (the balancer's own health check) or a v1 ``UNKNOWN`` one names
        no client: its address block is ignored (PROXY protocol spec, section 2.2) and the
        balancer's own address must then be an allowed client.
        """
        if not isinstance(server, RelaySMTP):
            return False
        local = proxy_data.command == V2_CMD.LOCAL or proxy_data.src_addr is None
        peer = session.peer[0] if isinstance(session.peer, tuple) else ""
        source = str(peer) if local else str(proxy_data.src_addr)
        if not server.gate.allows(source):
            log.warning("PROXY source address not allowed", extra={"client": source})
            return False
        refusal = server.admit_proxied(source)
        if refusal is not None:
            await server.push(str(refusal))
            return False
        return True

    async def handle_EHLO(self, server: SMTP, session: Session, envelope: Envelope,
                          hostname: str, responses: list[str]) -> list[str]:
        """Advertise PIPELINING and ENHANCEDSTATUSCODES beside aiosmtpd's extensions."""
        session.host_name = hostname
        keywords = [r[4:] for r in responses[1:] if r[4:] not in ("HELP", "AUTH ")]
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
        if address not in ("", "<>") and (problem := mailbox_problem(address)) is not None:
            log.info("MAIL FROM refused: %s", problem)
            return str(replies.BAD_SENDER_SYNTAX)
        if not sender_allowed(address, self._limits.allowed_senders):
            return str(replies.SENDER_NOT_ALLOWED)
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return str(replies.SENDER_OK)

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, rcpt_options: list[str]) -> str:
        """Accept a forward path, up to ``max_recipients`` (RFC 5321 section 4.5.3.1.8)."""
        refusal = self._check_address(address, envelope)
        if refusal is not None:
            return str(refusal)
        if (problem := mailbox_problem(address, postmaster_alone=True)) is not None:
            log.info("RCPT TO refused: %s", problem)
            return str(replies.BAD_RECIPIENT_SYNTAX)
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
        """Check the content, parse its header section once (:func:`parse_message`: what the
        core, the ledger and the notices read), then let the core relay it; the reply is the
        core's decision. The size and line-length limits were held by the DATA reader
        (:func:`relay.smtp.data.read_message`) as the message arrived."""
        content: bytes = envelope.original_content or b""
        self.metrics.message_bytes(len(content))
        queue_id = secrets.token_hex(6)
        if has_bare_cr_or_lf(content):
            return self._refuse(queue_id, replies.BARE_CR_OR_LF)
        if b"\x00" in content:
            return self._refuse(queue_id, replies.NUL_IN_MESSAGE)
        mail_from = "" if envelope.mail_from in (None, "<>") else str(envelope.mail_from)
        parsed = parse_message(content)
        if self._limits.add_message_id and parsed.first("message-id") is None:
            parsed = parsed.with_field("Message-ID", f"<{queue_id}@{self._limits.hostname}>")
            content = parsed.content
        # what the message needs, not what the client declared (RFC 6531 section 3.4):
        # an all-ASCII message goes without SMTPUTF8 / BODY=8BITMIME to any upstream
        utf8_headers = bool(envelope.smtp_utf8) and parsed.eight_bit_headers
        smtputf8 = utf8_headers or not all(
            a.isascii() for a in [mail_from, *envelope.rcpt_tos])
        msg = InboundMessage(
            mail_from=mail_from, rcpt_tos=list(envelope.rcpt_tos), content=content,
            trace=self._received(server, session, queue_id, smtputf8), smtputf8=smtputf8,
            eight_bit=parsed.eight_bit, utf8_headers=utf8_headers, queue_id=queue_id,
            auth_user=str(session.auth_data) if session.authenticated else None, parsed=parsed)
        # shielded: a client that hangs up mid-wait must not cancel an upstream transaction
        # half way (the reservation would be left PENDING with the message maybe delivered),
        # nor the decision's log line, which the in-doubt procedure starts from
        self.metrics.in_progress(1)
        task = asyncio.ensure_future(self._decide(msg, len(content),
                                                  _client_host(server, session)))
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        decision = await asyncio.shield(task)
        return str(decision.reply)

    async def _decide(self, msg: InboundMessage, size: int, client: str) -> Decision:
        """Run the core on ``msg`` and log its decision, whether or not the client still waits."""
        started = time.perf_counter()
        decision = await self._core.process(msg)
        self._log_decision(msg, decision, time.perf_counter() - started, size, client)
        return decision

    def _task_done(self, task: asyncio.Task[Decision]) -> None:
        self.tasks.discard(task)
        self.metrics.in_progress(-1)

    def _refuse(self, queue_id: str, reply: SmtpReply) -> str:
        self.metrics.message(Result.INVALID)
        log.warning("message refused", extra={"queue_id": queue_id, "reply": str(reply)})
        return str(reply)

    def _received(self, server: SMTP, session: Session, queue_id: str, smtputf8: bool) -> bytes:
        """The ``Received:`` trace header (RFC 5321 section 4.4, RFC 3848 protocol names)."""
        helo = session.host_name or "unknown"
        if not _SAFE_HELO.match(helo):
            helo = "invalid-helo"
        peer = _client_host(server, session) or "unknown"
        proto = "UTF8SMTP" if smtputf8 else ("ESMTP" if session.extended_smtp else "SMTP")
        if session.ssl or getattr(server, "implicit_tls", False):
            proto += "S"
        if session.authenticated:
            proto += "A"
        return (
            f"Received: from {helo} ([{peer}])\r\n"
            f"\tby {self._limits.hostname} (dedup-relay) with {proto} id {queue_id};\r\n"
            f"\t{format_datetime(datetime.now(UTC))}\r\n"
        ).encode("ascii", "replace")

    def _log_decision(self, msg: InboundMessage, decision: Decision, seconds: float,
                      size: int, client: str) -> None:
        """One structured line per message decision (no body; recipients and the sender masked
        by default): what an operator needs in an incident, the client's address, its AUTH
        user, the sender and the Message-ID among it, and with ``console_url`` the link to the
        message's console page (docs/operating/logs.md)."""
        show: Callable[[str], str] = (
            (lambda a: a) if self._limits.log_recipients else mask_address)
        label = distinct_labels([*decision.outcomes, *decision.keys], show)
        upstream = decision.upstream_reply
        fields: dict[str, object] = {
            "queue_id": msg.queue_id,
            "client": client,
            "from": show(msg.mail_from) if msg.mail_from else "",
            "message_id": msg.message.message_id,
            "result": decision.result.value,  # plain strings: the text format uses repr()
            "reply": str(decision.reply),
            "outcomes": {label[r]: o.value for r, o in decision.outcomes.items()},
            "keys": {label[r]: k for r, k in decision.keys.items()},
            "key_source": decision.key_source or None,
            "upstream_reply": str(upstream) if upstream is not None else None,
            "upstream_queue_id": upstream_queue_id(upstream) or None,
            "bytes": size,
            "latency_ms": round(seconds * 1000, 1),
        }
        if msg.auth_user is not None:
            fields["auth_user"] = msg.auth_user
        if decision.trace_id:
            fields["trace_id"] = decision.trace_id
        if decision.reused:  # keys reused for other content (design.md §4.9)
            fields["key_reused"] = sorted(label[r] for r in decision.reused)
        if self._limits.console_url is not None:  # the console's page of this message
            fields["console"] = f"{self._limits.console_url}/message/{msg.queue_id}"
        log.info("message", extra=fields)

    async def handle_exception(self, error: Exception) -> str:
        """Log the exception and answer ``451 4.3.0`` without leaking its text."""
        log.error("session exception: %s", type(error).__name__, exc_info=error)
        return str(replies.INTERNAL_ERROR)


def _client_host(server: SMTP, session: Session) -> str:
    """The client's address: the one a PROXY header named behind a load balancer, else the
    connection's peer; ``""`` when neither is known."""
    host = getattr(server, "client_host", None)
    if host:
        return str(host)
    return str(session.peer[0]) if isinstance(session.peer, tuple) else ""


def distinct_labels(recipients: Iterable[str], show: Callable[[str], str]) -> dict[str, str]:
    """recipient -> its label in the decision line: ``show(recipient)`` (masked, or as it is),
    with ``#2``, ``#3`` ... added to a label an earlier recipient already has, so that two
    masks alike (``john@d``, ``jane@d`` -> ``j***@d``, ``j***@d#2``) keep one entry each in
    ``outcomes`` and ``keys``."""
    labels: dict[str, str] = {}
    used: set[str] = set()
    for recipient in recipients:
        if recipient in labels:
            continue
        base = label = show(recipient)
        n = 2
        while label in used:
            label, n = f"{base}#{n}", n + 1
        labels[recipient] = label
        used.add(label)
    return labels


def smtp_factory(handler: RelayHandler, limits: ListenerLimits, security: ListenerSecurity,
                 processing_timeout_s: float, *, implicit_tls: bool = False
                 ) -> Callable[[], RelaySMTP]:
    """Return the protocol factory for ``loop.create_server`` (one RelaySMTP per connection).

    With ``implicit_tls`` the session runs over the TLS transport that
    :mod:`relay.smtp.implicit_tls` hands it after the handshake: no STARTTLS is offered, and AUTH
    is (the transport is already encrypted).
    """

    def factory() -> RelaySMTP:
        return RelaySMTP(
            handler,
            metrics=handler.metrics,
            sessions=handler.sessions,
            processing_timeout_s=processing_timeout_s,
            gate=security.gate,
            proxy_networks=security.proxy_networks,
            implicit_tls=implicit_tls,
            data_deadline_s=limits.data_deadline_s,
            session_lifetime_s=limits.session_lifetime_s,
            max_idle_commands=limits.max_idle_commands,
            bare_newline=limits.bare_newline,
            hostname=limits.hostname,
            data_size_limit=limits.max_message_size,
            enable_SMTPUTF8=True,
            decode_data=False,
            timeout=limits.client_timeout_s,
            ident="dedup-relay ESMTP",
            tls_context=None if implicit_tls else security.tls_context,
            require_starttls=security.tls_required and not implicit_tls,
            auth_required=security.auth_required,
            auth_require_tls=not implicit_tls,
            auth_exclude_mechanism=None if security.auth_enabled else ["PLAIN", "LOGIN"],
            proxy_protocol_timeout=(
                security.proxy_timeout_s if security.proxy_networks is not None else None),
        )

    return factory
