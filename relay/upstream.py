"""The SMTP upstream (smarthost) adapter, built on aiosmtplib.

One connection per transaction (connect, EHLO, optional STARTTLS and AUTH, MAIL, RCPT..., DATA,
QUIT). Every aiosmtplib exception is translated here into a per-recipient
:class:`relay.interfaces.RcptResult`; nothing from aiosmtplib escapes this module.

The DATA phase is run by hand on aiosmtplib's public protocol methods (``execute_command``,
``protocol.write``, ``protocol.read_response``) rather than ``SMTP.data()``, because ``data()``
uses one timeout for the ``354`` and for the reply to the final dot and does not say which one
ran out. The relay must know: a failure before the final dot was fully written releases the
reservation (the retry is safe), a failure after it is UNKNOWN (RFC 1047; releasing it would
send a duplicate). The wait for the final reply is ``final_timeout_s`` (default 600 s,
RFC 5321 section 4.5.3.2.6).
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

import aiosmtplib

from relay import replies
from relay.interfaces import (
    DeliveryResult,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    SmtpReply,
)

log = logging.getLogger("relay.upstream")

_LEADING_DOT = re.compile(rb"(?m)^\.")
_FLUSH_POLL_S = 0.005


@dataclass(frozen=True)
class SmtpUpstreamConfig:
    """Where and how to reach the smarthost.

    ``tls``: ``none`` (plain), ``starttls`` (required upgrade) or ``tls`` (implicit TLS).
    Timeouts are seconds: ``connect_timeout_s`` for TCP+greeting+EHLO(+TLS+AUTH),
    ``command_timeout_s`` per command, ``final_timeout_s`` for the reply to the final dot.
    """

    host: str
    port: int
    local_hostname: str
    tls: str = "none"
    verify: bool = True
    username: str | None = None
    password: str | None = None
    connect_timeout_s: float = 30.0
    command_timeout_s: float = 60.0
    final_timeout_s: float = 600.0


def _reply(exc: aiosmtplib.SMTPResponseException) -> SmtpReply:
    return SmtpReply(exc.code, exc.message)


def _all(recipients: Sequence[str], status: RcptStatus, reply: SmtpReply) -> DeliveryResult:
    return DeliveryResult(recipients={r: RcptResult(status, reply) for r in recipients})


def _connection_failure(exc: Exception) -> SmtpReply:
    """Map an exception raised while connecting/greeting/EHLO/STARTTLS/AUTH to a temp reply."""
    if isinstance(exc, aiosmtplib.SMTPAuthenticationError):
        return replies.UPSTREAM_AUTH_FAILED
    if isinstance(exc, aiosmtplib.SMTPResponseException):
        # a refusing greeting or EHLO says nothing about the message: the retry is safe
        return SmtpReply(451, f"4.4.1 upstream: {replies.client_safe_text(exc.message)}")
    if isinstance(exc, TimeoutError):
        return replies.UPSTREAM_TIMEOUT
    return replies.UPSTREAM_UNREACHABLE


def _mail_options(smtp: aiosmtplib.SMTP, message: OutboundMessage) -> list[str] | SmtpReply:
    """MAIL parameters for ``message``, or the refusal when the upstream lacks an extension.

    No downgrade is attempted: a non-ASCII address cannot be downgraded (RFC 6530) and the
    relay does not convert 8-bit content (RFC 6152 section 3).
    """
    if message.smtputf8 and not smtp.supports_extension("smtputf8"):
        return replies.UPSTREAM_NO_SMTPUTF8
    if message.eight_bit and not smtp.supports_extension("8bitmime"):
        return replies.UPSTREAM_NO_8BITMIME
    options = []
    if message.smtputf8:
        options.append("SMTPUTF8")
    if message.eight_bit:
        options.append("BODY=8BITMIME")
    if smtp.supports_extension("size"):
        options.append(f"SIZE={len(message.content)}")
    return options


def _lost(exc: Exception) -> SmtpReply:
    return replies.UPSTREAM_TIMEOUT if isinstance(exc, TimeoutError) else replies.UPSTREAM_LOST


class SmtpUpstream:
    """Relays to an SMTP smarthost; implements :class:`relay.interfaces.Upstream`."""

    def __init__(self, *, config: SmtpUpstreamConfig) -> None:
        self._cfg = config

    def _client(self) -> aiosmtplib.SMTP:
        cfg = self._cfg
        tls_context = None
        if cfg.tls != "none" and not cfg.verify:
            tls_context = ssl.create_default_context()
            tls_context.check_hostname = False
            tls_context.verify_mode = ssl.CERT_NONE
        return aiosmtplib.SMTP(
            hostname=cfg.host,
            port=cfg.port,
            local_hostname=cfg.local_hostname,
            timeout=cfg.command_timeout_s,
            use_tls=cfg.tls == "tls",
            start_tls=cfg.tls == "starttls",
            validate_certs=cfg.verify,
            tls_context=tls_context,
            username=cfg.username,
            password=cfg.password,
        )

    async def deliver(self, message: OutboundMessage) -> DeliveryResult:
        """Run one upstream transaction; see :class:`relay.interfaces.Upstream`."""
        smtp = self._client()
        try:
            try:
                await smtp.connect(timeout=self._cfg.connect_timeout_s)
                if smtp.is_ehlo_or_helo_needed:  # aiosmtplib greets lazily; we need the ESMTP
                    await smtp.ehlo(timeout=self._cfg.command_timeout_s)  # keywords now
            except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
                log.warning("upstream connect failed: %s", type(exc).__name__)
                return _all(message.rcpt_tos, RcptStatus.REFUSED, _connection_failure(exc))
            return await self._transaction(smtp, message)
        finally:
            await self._quit(smtp)

    async def _transaction(self, smtp: aiosmtplib.SMTP, message: OutboundMessage) -> DeliveryResult:
        options = _mail_options(smtp, message)
        if isinstance(options, SmtpReply):
            return _all(message.rcpt_tos, RcptStatus.REFUSED, options)
        encoding = "utf-8" if message.smtputf8 else "ascii"
        try:
            await smtp.mail(message.mail_from, options=options, encoding=encoding)
        except aiosmtplib.SMTPResponseException as exc:
            return _all(message.rcpt_tos, RcptStatus.REFUSED, _reply(exc))
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            return _all(message.rcpt_tos, RcptStatus.REFUSED, _lost(exc))
        except ValueError:  # aiosmtplib refuses control characters; the listener already did
            return _all(message.rcpt_tos, RcptStatus.REFUSED, replies.BAD_SENDER_SYNTAX)
        results, accepted = await self._recipients(smtp, message.rcpt_tos, encoding)
        if not accepted:
            return DeliveryResult(recipients=results)
        status, final = await self._data(smtp, message.content)
        for rcpt in accepted:
            results[rcpt] = RcptResult(status, final)
        return DeliveryResult(
            recipients=results, final_reply=final if status is RcptStatus.ACCEPTED else None
        )

    async def _recipients(
        self, smtp: aiosmtplib.SMTP, rcpt_tos: Sequence[str], encoding: str
    ) -> tuple[dict[str, RcptResult], list[str]]:
        """RCPT for each recipient: the refusals by address, and the accepted addresses."""
        results: dict[str, RcptResult] = {}
        accepted: list[str] = []
        for rcpt in rcpt_tos:
            try:
                await smtp.rcpt(rcpt, encoding=encoding)
                accepted.append(rcpt)
            except aiosmtplib.SMTPResponseException as exc:
                results[rcpt] = RcptResult(RcptStatus.REFUSED, _reply(exc))
            except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
                lost = RcptResult(RcptStatus.REFUSED, _lost(exc))
                return {r: results.get(r, lost) for r in rcpt_tos}, []
            except ValueError:
                results[rcpt] = RcptResult(RcptStatus.REFUSED, replies.BAD_RECIPIENT_SYNTAX)
        return results, accepted

    async def _data(self, smtp: aiosmtplib.SMTP, content: bytes) -> tuple[RcptStatus, SmtpReply]:
        """DATA, the message, the final dot; tell a failure before the dot from one after it."""
        try:
            start = await smtp.execute_command(b"DATA", timeout=self._cfg.command_timeout_s)
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            return RcptStatus.REFUSED, _lost(exc)
        if start.code != 354:
            return RcptStatus.REFUSED, SmtpReply(start.code, start.message)
        protocol = smtp.protocol
        transport = protocol.transport if protocol is not None else None
        if protocol is None or not isinstance(transport, asyncio.WriteTransport):
            return RcptStatus.REFUSED, replies.UPSTREAM_LOST
        payload = _LEADING_DOT.sub(b"..", content)
        if not payload.endswith(b"\r\n"):
            payload += b"\r\n"
        try:
            protocol.write(payload + b".\r\n")
        except aiosmtplib.SMTPException:
            return RcptStatus.REFUSED, replies.UPSTREAM_LOST
        reader = asyncio.ensure_future(protocol.read_response(timeout=self._cfg.final_timeout_s))
        if not await self._flushed(transport, reader):
            reader.cancel()
            smtp.close()
            return RcptStatus.REFUSED, replies.UPSTREAM_LOST
        try:
            response = await reader
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            smtp.close()
            log.error("upstream gave no reply to the final dot (%s): outcome unknown",
                      type(exc).__name__)
            return RcptStatus.UNKNOWN, replies.OUTCOME_UNKNOWN
        reply = SmtpReply(response.code, response.message)
        return (RcptStatus.ACCEPTED if reply.is_positive else RcptStatus.REFUSED), reply

    async def _flushed(
        self, transport: asyncio.WriteTransport, reader: asyncio.Future[aiosmtplib.SMTPResponse]
    ) -> bool:
        """Wait until the kernel took every byte of the message and the final dot.

        False when the connection closed (or writing stalled past ``command_timeout_s``)
        while bytes were still buffered: the upstream cannot have the whole message.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._cfg.command_timeout_s
        while True:
            if transport.get_write_buffer_size() == 0 and not transport.is_closing():
                return True
            if reader.done() and not reader.cancelled() and reader.exception() is None:
                return True  # the upstream answered already (e.g. an early 552)
            if transport.is_closing() or reader.done() or loop.time() > deadline:
                return False  # asyncio drops the unsent bytes of a closed transport
            await asyncio.sleep(_FLUSH_POLL_S)

    async def _quit(self, smtp: aiosmtplib.SMTP) -> None:
        if not smtp.is_connected:
            return
        try:
            await smtp.quit(timeout=min(5.0, self._cfg.command_timeout_s))
        except (aiosmtplib.SMTPException, OSError, TimeoutError):
            smtp.close()

    async def ping(self) -> None:
        """Connect, EHLO and QUIT; raise ConnectionError when the smarthost does not answer."""
        smtp = self._client()
        try:
            await smtp.connect(timeout=self._cfg.connect_timeout_s)
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            raise ConnectionError(f"upstream {self._cfg.host}:{self._cfg.port}: {exc}") from exc
        finally:
            await self._quit(smtp)

    async def close(self) -> None:
        """Nothing is pooled yet: every transaction has its own connection."""
