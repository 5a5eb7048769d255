"""The SMTP upstream (smarthost) adapter, built on aiosmtplib.

Connections (connect, EHLO, optional STARTTLS and AUTH) come from :mod:`relay.upstream.pool` and
go back to it only after a transaction that ended cleanly; one whose transaction failed, timed
out or is in doubt is never reused (a late reply would answer the next transaction's first
command). Every aiosmtplib exception is translated here into a per-recipient
:class:`relay.core.interfaces.RcptResult`; nothing from aiosmtplib escapes this module.

The DATA phase runs on aiosmtplib's protocol methods rather than ``SMTP.data()``, which uses one
timeout for the ``354`` and the final reply and cannot say which ran out: a failure before the
final dot fully left the relay releases the reservation, one after it is UNKNOWN (RFC 1047). The
message is written by :mod:`relay.upstream.transfer` (stall timeout ``command_timeout_s``); the
final reply is awaited for ``final_timeout_s`` (default 600 s, RFC 5321 section 4.5.3.2.6) from
the moment the kernel took the whole message; a reply already in the kernel's receive queue at
the deadline (the worker was held up) is read, not taken for none. A wait that ends without a
reply (that timeout, or a shutdown's cut) while the kernel still holds unsent bytes of the
message resets the connection: the dot can never arrive, so the reservation is released, not
UNKNOWN. Design: docs/design.md §5.3.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import re
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiosmtplib

from relay.core import replies
from relay.core.cancellation import absorb_cancel
from relay.core.interfaces import (
    DeliveryProgress,
    DeliveryResult,
    OutboundMessage,
    RcptResult,
    RcptStatus,
    SmtpReply,
)
from relay.upstream.negotiate import negotiate
from relay.upstream.oauth import TokenError, TokenProvider
from relay.upstream.pool import ConnectionPool, discard, quit_politely
from relay.upstream.transfer import (
    DOT,
    Outcome,
    Transfer,
    WireTransport,
    abort,
    await_reply,
    is_wire,
    withdraw,
    write_backlog,
)

log = logging.getLogger("relay.upstream.smtp")

_LEADING_DOT = re.compile(rb"(?m)^\.")
_PROBE_TIMEOUT_S = 2.0  # an idle connection's RSET: a live smarthost answers at once


@dataclass(frozen=True)
class SmtpUpstreamConfig:
    """Where and how to reach the smarthost.

    ``tls``: ``none`` (plain), ``starttls`` (required upgrade) or ``tls`` (implicit TLS);
    ``ca_file``: PEM CAs that verify the smarthost instead of the system's (with ``verify``);
    ``client_cert`` / ``client_key``: a PEM client certificate chain and its key, presented
    when the smarthost asks. ``auth``: ``password`` (``username`` + ``password``, any
    mechanism aiosmtplib offers), ``xoauth2`` or ``oauthbearer`` (``username`` the mailbox,
    the access token from ``token_provider``). Timeouts are seconds: ``connect_timeout_s``
    for TCP+greeting+EHLO(+TLS+AUTH), ``command_timeout_s`` per command, ``final_timeout_s``
    for the reply to the final dot.
    """

    host: str
    port: int
    local_hostname: str
    tls: str = "none"
    verify: bool = True
    name: str = ""  # the configured name (a metric label, /readyz); "": "HOST:PORT"
    username: str | None = None
    password: str | None = None
    connect_timeout_s: float = 30.0
    command_timeout_s: float = 60.0
    final_timeout_s: float = 600.0
    pool_size: int = 4  # idle connections kept; 0: one connection per transaction
    pool_idle_s: float = 30.0  # an idle connection older than this is closed, not reused
    pool_max_messages: int = 100  # transactions per connection before it is closed
    auth: str = "password"  # password | xoauth2 | oauthbearer
    token_provider: TokenProvider | None = None  # with xoauth2 / oauthbearer
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None

    def __post_init__(self) -> None:
        if self.auth not in ("password", "xoauth2", "oauthbearer"):
            raise ValueError(f"unknown upstream auth {self.auth!r}")
        if self.auth != "password" and (self.token_provider is None or not self.username):
            raise ValueError(f"upstream auth {self.auth} needs a token provider and a user")


def client_tls_context(config: SmtpUpstreamConfig) -> ssl.SSLContext | None:
    """The TLS context of connections to the smarthost, None for plain SMTP: verifying
    against ``ca_file`` (else the system's CAs) unless ``verify`` is off, with the client
    certificate loaded when configured.

    Raises ``ssl.SSLError`` / ``OSError`` when a file is no readable PEM of its kind.
    """
    if config.tls == "none":
        return None
    context = ssl.create_default_context(
        cafile=str(config.ca_file) if config.ca_file is not None and config.verify else None)
    if not config.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if config.client_cert is not None:  # an encrypted key fails: no passphrase prompt
        context.load_cert_chain(config.client_cert, config.client_key, password=_no_passphrase)
    return context


def _no_passphrase() -> bytes:
    return b""


def xoauth2_string(user: str, token: str) -> bytes:
    """The XOAUTH2 initial response, base64: ``user=U^Aauth=Bearer T^A^A`` (Google's and
    Microsoft's SASL XOAUTH2)."""
    return base64.b64encode(f"user={user}\x01auth=Bearer {token}\x01\x01".encode())


def oauthbearer_string(user: str, host: str, port: int, token: str) -> bytes:
    """The OAUTHBEARER initial response, base64 (RFC 7628 section 3.1): the GS2 header
    ``n,a=USER,`` (``,`` and ``=`` in the user escaped as ``=2C`` / ``=3D``, RFC 5801), then
    ``^Ahost=H^Aport=P^Aauth=Bearer T^A^A``."""
    authzid = user.replace("=", "=3D").replace(",", "=2C")
    return base64.b64encode(
        f"n,a={authzid},\x01host={host}\x01port={port}\x01auth=Bearer {token}\x01\x01"
        .encode())


class _TokenRefused(aiosmtplib.SMTPAuthenticationError):
    """The smarthost refused an OAuth2 access token (535, or an error challenge): ``token``
    is the refused one, invalidated before the one retry."""

    def __init__(self, code: int, message: str, token: str) -> None:
        super().__init__(code, message)
        self.token = token


def _refusal(code: int, text: str) -> RcptResult:
    """An upstream refusal; a reply that is neither 4yz nor 5yz is a protocol error (temp)."""
    if 400 <= code < 600:
        return RcptResult(RcptStatus.REFUSED, SmtpReply.parse(code, text))
    log.warning("upstream answered %d where a refusal was due: protocol error", code)
    return RcptResult(RcptStatus.REFUSED, replies.UPSTREAM_PROTOCOL_ERROR, from_upstream=False)


def _rcpt_reply(code: int, text: str) -> tuple[int, str]:
    """A refusal of RCPT as the relay takes it: ``552`` is the temporary ``452``.

    RFC 5321 section 4.5.3.1.10: servers that still answer 552 for too many recipients are
    to be treated as if they said 452, so the client retries the rest (the recipients already
    sent are then duplicates). The enhanced code's class follows (``5.5.3`` -> ``4.5.3``).
    """
    if code != 552:
        return code, text
    enhanced = SmtpReply.parse(code, text).enhanced
    if enhanced is None:
        return 452, f"4.5.3 {text}"
    return 452, "4" + text[1:]


def _clean(code: int) -> bool:
    """Whether the session is in a known state after a refusal with ``code``: a 4yz or 5yz
    other than 421 (closing). Any other code where a refusal was due is a protocol error."""
    return 400 <= code < 600 and code != 421


def _synthetic(reply: SmtpReply, status: RcptStatus = RcptStatus.REFUSED) -> RcptResult:
    return RcptResult(status, reply, from_upstream=False)


def _all(recipients: Sequence[str], result: RcptResult, *,
         failover: bool = False) -> DeliveryResult:
    return DeliveryResult(recipients=dict.fromkeys(recipients, result), failover=failover)


def _connection_failure(exc: Exception) -> RcptResult:
    """Map an exception raised while connecting/greeting/EHLO/STARTTLS/AUTH to a temp result.

    A refusing greeting or EHLO says nothing about the message: the retry is safe (4yz).
    """
    if isinstance(exc, TokenError):
        return _synthetic(replies.upstream_token_unavailable(exc.reason))
    if isinstance(exc, aiosmtplib.SMTPAuthenticationError):
        return _synthetic(replies.UPSTREAM_AUTH_FAILED)
    if isinstance(exc, aiosmtplib.SMTPResponseException):
        text = replies.client_safe_text(f"{exc.code} {exc.message}")
        return _synthetic(SmtpReply(451, "4.4.1", f"Upstream refused the session: {text}"))
    if isinstance(exc, TimeoutError):
        return _synthetic(replies.UPSTREAM_TIMEOUT)
    return _synthetic(replies.UPSTREAM_UNREACHABLE)


def _early_reply(response: aiosmtplib.SMTPResponse) -> RcptResult:
    """The outcome of a reply that came before the whole message did (the rest is then reset,
    never sent): a 4yz/5yz refuses it; any other reply cannot be about a message the upstream
    never saw end, so whether it took something is unknown."""
    if 400 <= response.code < 600:
        return RcptResult(RcptStatus.REFUSED, SmtpReply.parse(response.code, response.message))
    log.error("upstream answered %d before the final dot: outcome unknown", response.code)
    return _synthetic(replies.OUTCOME_UNKNOWN, RcptStatus.UNKNOWN)


async def _withdraw_dot(transport: WireTransport, progress: DeliveryProgress, why: str
                        ) -> bool:
    """No reply to the final dot came (``why``): reset the connection when the kernel still
    holds unsent bytes of the message as it closes (the dot can then never arrive, so nothing
    was delivered: ``progress.dot_written`` is False again). True when it did."""
    unsent = await withdraw(transport)
    if not unsent:
        return False
    progress.dot_written = False
    log.warning("no reply to the final dot (%s) and %d byte(s) of the message still unsent: "
                "connection reset, the dot can never arrive: nothing delivered", why, unsent)
    return True


def _log_gone(exc: Exception) -> None:
    """A reused connection's MAIL found it closed (it is retried on a new one)."""
    log.info("pooled upstream connection gone (%s): opening a new one", type(exc).__name__)


def _lost(exc: Exception) -> RcptResult:
    return _synthetic(
        replies.UPSTREAM_TIMEOUT if isinstance(exc, TimeoutError) else replies.UPSTREAM_LOST)


@dataclass(frozen=True)
class _Recipients:
    """The RCPTs of one transaction: the refusals by recipient, the accepted ones in order,
    whether the session is in a known state, and the recipients past the smarthost's limit
    (``left``: refused ``452`` after an accepted one, or not sent after that)."""

    results: dict[str, RcptResult]
    accepted: list[str]
    clean: bool
    left: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Transaction:
    """One transaction's result; whether the connection may be reused (every command
    answered, none with 421: the session is in a known state); whether the transaction is
    over (no RSET needed before the next MAIL); the recipients past the smarthost's limit."""

    result: DeliveryResult
    clean: bool
    ended: bool
    left: tuple[str, ...] = ()


class SmtpUpstream:
    """Relays to an SMTP smarthost; implements :class:`relay.core.interfaces.Upstream`."""

    def __init__(self, *, config: SmtpUpstreamConfig) -> None:
        self._cfg = config
        self._tls = client_tls_context(config)
        self._pool = ConnectionPool(
            size=config.pool_size, idle_s=config.pool_idle_s,
            max_messages=config.pool_max_messages,
            probe_timeout_s=min(_PROBE_TIMEOUT_S, config.command_timeout_s),
            open_new=self._connect)

    def _client(self) -> aiosmtplib.SMTP:
        cfg = self._cfg
        password_auth = cfg.auth == "password"
        return aiosmtplib.SMTP(
            hostname=cfg.host,
            port=cfg.port,
            local_hostname=cfg.local_hostname,
            timeout=cfg.command_timeout_s,
            use_tls=cfg.tls == "tls",
            start_tls=cfg.tls == "starttls",
            validate_certs=cfg.verify,
            tls_context=self._tls,
            username=cfg.username if password_auth else None,  # OAuth2: AUTH in _open
            password=cfg.password if password_auth else None,
        )

    async def deliver(self, message: OutboundMessage,
                      progress: DeliveryProgress | None = None) -> DeliveryResult:
        """Relay ``message`` in as many transactions as the smarthost's recipient limit needs;
        see :class:`relay.core.interfaces.Upstream`.

        A ``452`` to RCPT after the transaction had a recipient accepted is the smarthost's
        limit (RFC 5321 section 4.5.3.1.10): no more RCPTs go in that transaction, and once its
        final dot is answered 2yz the recipients left go in the next one, each with its own
        result (a transaction that did not deliver ends the run: the recipients left keep the
        ``452``). The result is the first transaction's, with every recipient's; the
        ``before_dot`` hook runs once per transaction with its recipients, and
        ``progress.dot_written`` stays True once a dot went out (a cut in a later transaction
        leaves every recipient in doubt, never released to be sent twice).
        """
        progress = progress if progress is not None else DeliveryProgress()
        first, left = await self._deliver_once(message, progress)
        result, outcomes = first, dict(first.recipients)
        transactions = 1
        while left and result.final_reply is not None:
            transactions += 1
            log.info("upstream's recipient limit: %d recipient(s) left for transaction %d",
                     len(left), transactions)
            more = DeliveryProgress(before_dot=progress.before_dot)
            result, left = await self._deliver_once(
                dataclasses.replace(message, rcpt_tos=list(left)), more)
            progress.abort_reply = more.abort_reply or progress.abort_reply
            outcomes.update(result.recipients)
        return dataclasses.replace(first, recipients=outcomes)

    async def _deliver_once(self, message: OutboundMessage, progress: DeliveryProgress
                            ) -> tuple[DeliveryResult, tuple[str, ...]]:
        """Run one upstream transaction: its result, and the recipients past the smarthost's
        limit (refused ``452`` after an accepted one, or not sent after that refusal).

        A pooled connection reused without RSET whose MAIL finds it gone (closed, reset, or a
        ``421`` from a smarthost ending an idle session) is dropped and the transaction runs
        once more on a new connection: nothing of the message was sent on it.
        """
        for attempt in range(2):
            try:
                smtp, uses, untested = await self._pool.acquire()
            except (aiosmtplib.SMTPException, OSError, TimeoutError, TokenError) as exc:
                log.warning("upstream session failed: %s: %s", type(exc).__name__,
                            replies.client_safe_text(str(exc)))
                # nothing of the message reached this upstream: another may take it
                return self._named(_all(message.rcpt_tos, _connection_failure(exc),
                                        failover=True)), ()
            clean = ended = False
            try:
                done = await self._transaction(smtp, message, progress,
                                               retry_gone=untested and attempt == 0)
                if done is not None:
                    clean, ended = done.clean, done.ended
                    return self._named(done.result), done.left
                self._pool.drop_idle()  # they idled as long: most likely gone too
            finally:
                self._pool.release(smtp, uses + 1, clean, ended=ended)
        raise AssertionError("unreachable: the second attempt never retries")

    async def _connect(self) -> aiosmtplib.SMTP:
        """A new connection, greeted (and STARTTLS/AUTH as configured); raises what
        connecting raises (:class:`TokenError` when no OAuth2 token can be had), after
        closing the socket. An OAuth2 token the smarthost refuses is invalidated and AUTH
        runs once more, with a fresh token, on a new connection (nothing of a transaction
        went on the first); the fresh one refused too is kept (the refusal is not about its
        age), so a smarthost that refuses every token costs one token request per message,
        not two."""
        for attempt in range(2):
            smtp = self._client()
            try:
                await self._open(smtp)
            except _TokenRefused as exc:
                smtp.close()
                if attempt == 1:  # a fresh token refused too: not an expiry, keep it
                    raise
                assert self._cfg.token_provider is not None
                self._cfg.token_provider.invalidate(exc.token)
                log.warning("upstream refused the OAuth2 token (%d %s): fetching a new one",
                            exc.code, replies.client_safe_text(exc.message))
            except BaseException:
                smtp.close()
                raise
            else:
                return smtp
        raise AssertionError("unreachable: the second attempt raises or returns")

    async def _open(self, smtp: aiosmtplib.SMTP) -> None:
        """Connect (TLS, AUTH as configured) and greet: EHLO, or HELO when EHLO is refused."""
        await smtp.connect(timeout=self._cfg.connect_timeout_s)
        if not smtp.is_ehlo_or_helo_needed:
            return
        try:  # aiosmtplib greets lazily; the ESMTP keywords are needed before MAIL
            await smtp.ehlo(timeout=self._cfg.command_timeout_s)
        except aiosmtplib.SMTPHeloError as exc:
            if not 500 <= exc.code < 600:
                raise
            await smtp.helo(timeout=self._cfg.command_timeout_s)  # RFC 5321 section 3.2
        if self._cfg.auth != "password":
            await self._oauth(smtp)

    async def _oauth(self, smtp: aiosmtplib.SMTP) -> None:
        """AUTH XOAUTH2 or OAUTHBEARER with the provider's token (RFC 4954, RFC 7628).

        An error challenge (``334`` with a base64 JSON status) is answered with an empty
        line, as RFC 7628 section 3.2.3 asks (the XOAUTH2 servers do the same), and the final
        reply is taken. Raises :class:`_TokenRefused` for a 535 or an error challenge,
        ``SMTPAuthenticationError`` for any other refusal or a mechanism not offered,
        :class:`TokenError` when there is no token.
        """
        cfg = self._cfg
        assert cfg.token_provider is not None and cfg.username is not None
        mechanism = cfg.auth.upper()
        if cfg.auth not in smtp.server_auth_methods:
            raise aiosmtplib.SMTPAuthenticationError(
                504, f"5.5.4 the upstream does not offer AUTH {mechanism}")
        token = await cfg.token_provider.token()
        if cfg.auth == "xoauth2":
            initial = xoauth2_string(cfg.username, token)
        else:
            initial = oauthbearer_string(cfg.username, cfg.host, cfg.port, token)
        timeout = cfg.command_timeout_s
        response = await smtp.execute_command(
            b"AUTH", mechanism.encode(), initial, timeout=timeout)
        challenged = response.code == 334
        if challenged:
            response = await smtp.execute_command(b"", timeout=timeout)
        if response.code == 235:
            return
        if challenged or response.code == 535:
            raise _TokenRefused(response.code, response.message, token)
        raise aiosmtplib.SMTPAuthenticationError(response.code, response.message)

    async def _transaction(self, smtp: aiosmtplib.SMTP, message: OutboundMessage,
                           progress: DeliveryProgress, *, retry_gone: bool = False
                           ) -> _Transaction | None:
        """The transaction's :class:`_Transaction`; None when ``retry_gone`` and MAIL found
        the connection gone (see :meth:`_deliver_once`)."""
        wire = negotiate(message, smtp.esmtp_extensions.keys())
        if isinstance(wire, SmtpReply):
            return _Transaction(_all(message.rcpt_tos, _synthetic(wire)), True, True)
        encoding = "utf-8" if wire.smtputf8 else "ascii"
        try:
            await smtp.mail(wire.mail_from, options=wire.options, encoding=encoding)
        except aiosmtplib.SMTPResponseException as exc:
            if retry_gone and exc.code == 421:
                _log_gone(exc)
                return None
            # a 4yz (421 included) to MAIL: no transaction began, another upstream may try
            return _Transaction(_all(message.rcpt_tos, _refusal(exc.code, exc.message),
                                     failover=400 <= exc.code < 500), _clean(exc.code), True)
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            if retry_gone and not isinstance(exc, TimeoutError):
                _log_gone(exc)
                return None
            return _Transaction(_all(message.rcpt_tos, _lost(exc), failover=True), False, False)
        except ValueError:  # aiosmtplib refuses control characters; the listener already did
            return _Transaction(_all(message.rcpt_tos, _synthetic(replies.BAD_SENDER_SYNTAX)),
                                False, False)
        rcpts = await self._recipients(smtp, wire.rcpt_to, encoding)
        results, accepted = rcpts.results, rcpts.accepted
        if not accepted:
            return _Transaction(DeliveryResult(recipients=results), rcpts.clean, False)
        outcome, clean = await self._data(smtp, message.content, progress, accepted)
        for rcpt in accepted:
            results[rcpt] = outcome
        final = outcome.reply if outcome.status is RcptStatus.ACCEPTED else None
        return _Transaction(DeliveryResult(recipients=results, final_reply=final), clean,
                            final is not None, rcpts.left)

    async def _recipients(self, smtp: aiosmtplib.SMTP, rcpt_to: dict[str, str],
                          encoding: str) -> _Recipients:
        """RCPT for each recipient (wire form) until the smarthost's limit: a ``452`` after an
        accepted recipient (RFC 5321 section 4.5.3.1.10) ends the RCPTs, and that recipient
        and those not sent are ``left``, with that refusal as their result."""
        results: dict[str, RcptResult] = {}
        accepted: list[str] = []
        clean = True
        for index, (rcpt, wire_address) in enumerate(rcpt_to.items()):
            try:
                await smtp.rcpt(wire_address, encoding=encoding)
                accepted.append(rcpt)
            except aiosmtplib.SMTPResponseException as exc:
                code, text = _rcpt_reply(exc.code, exc.message)
                results[rcpt] = _refusal(code, text)
                clean = clean and _clean(exc.code)
                if code == 452 and accepted:  # the smarthost's limit: the rest go later
                    left = tuple(rcpt_to)[index:]
                    results.update(dict.fromkeys(left, results[rcpt]))
                    return _Recipients(results, accepted, clean, left)
            except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
                lost = _lost(exc)
                return _Recipients({r: results.get(r, lost) for r in rcpt_to}, [], False)
            except ValueError:
                results[rcpt] = _synthetic(replies.BAD_RECIPIENT_SYNTAX)
        return _Recipients(results, accepted, clean)

    async def _data(self, smtp: aiosmtplib.SMTP, content: bytes, progress: DeliveryProgress,
                    accepted: list[str]) -> tuple[RcptResult, bool]:
        """DATA, the message, the final dot; tell a failure before the dot from one after it.

        ``progress.before_dot`` (the SENDING mark) starts once the upstream answered DATA
        with ``354``, never before (a smarthost slow to answer DATA must not widen the window
        in which a crash leaves SENDING for a message not sent), and once at most
        :data:`relay.upstream.transfer.MARK_AHEAD_BYTES` of the body are left that the
        kernel has not taken (:class:`Transfer`): for a message that small, with its first
        bytes, so it runs while the body goes out. Only the final dot waits for it, and a
        mark that says no (or fails) resets the connection with the dot unwritten. A started
        mark is always waited for before this returns (cancelled only when this is), so the
        settle that follows never races it. Also says whether the session is in a known
        state afterwards (reusable).
        """
        hook = progress.before_dot
        started: list[asyncio.Future[bool]] = []

        def start_mark() -> asyncio.Future[bool]:
            if not started:
                assert hook is not None
                started.append(asyncio.ensure_future(hook(accepted)))
            return started[0]

        try:
            outcome = await self._data_gated(smtp, content, progress,
                                             start_mark if hook is not None else None)
        except BaseException:
            for mark in started:
                mark.cancel()
            raise
        marking = started[0] if started else None
        if marking is not None:
            if not marking.done():  # a done mark (the dot went) is no await: a cut here
                await asyncio.wait((marking,))  # would throw away the reply already read
            if not marking.cancelled() and marking.exception() is not None:
                log.error("the before-dot hook failed: %r", marking.exception())
        return outcome

    async def _data_gated(self, smtp: aiosmtplib.SMTP, content: bytes,
                          progress: DeliveryProgress,
                          start_mark: Callable[[], asyncio.Future[bool]] | None
                          ) -> tuple[RcptResult, bool]:
        """:meth:`_data` with the mark's starter (``start_mark``, None: no hook)."""
        try:
            start = await smtp.execute_command(b"DATA", timeout=self._cfg.command_timeout_s)
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            return _lost(exc), False
        if start.code != 354:
            return _refusal(start.code, start.message), _clean(start.code)
        protocol = smtp.protocol
        transport = protocol.transport if protocol is not None else None
        if protocol is None or not is_wire(transport):  # duck-typed: uvloop's too
            return _synthetic(replies.UPSTREAM_LOST), False
        payload = _LEADING_DOT.sub(b"..", content)
        if not payload.endswith(b"\r\n"):
            payload += b"\r\n"
        return await self._transfer(smtp, protocol, transport, payload + DOT, progress,
                                    start_mark)

    async def _transfer(self, smtp: aiosmtplib.SMTP, protocol: aiosmtplib.protocol.SMTPProtocol,
                        transport: WireTransport, payload: bytes,
                        progress: DeliveryProgress,
                        start_gate: Callable[[], asyncio.Future[bool]] | None
                        ) -> tuple[RcptResult, bool]:
        """Write ``payload`` (final dot included, held back until the gate ``start_gate()``
        returns resolves True) and
        take the reply: see :mod:`relay.upstream.transfer`. ``progress.dot_written`` turns
        True as the final dot is handed to the transport, before the loop or the kernel sent
        it (uvloop writes at the end of its loop turn): a shutdown cut from then on waits for
        the reply (:func:`relay.core.cancellation.reply_past_cut`) instead of settling a dot
        that is leaving as one that never went. Given up (stalled, lost, answered early,
        withheld, cancelled), the connection is reset while bytes are buffered (cancelled
        once the process handed all of them over: while the kernel holds some unsent), so
        ``progress.dot_written`` ends False when the final dot cannot reach the upstream any
        more, and True only when it may have."""
        def dot_handed() -> None:
            progress.dot_written = True

        transfer = Transfer(transport, payload, stall_timeout_s=self._cfg.command_timeout_s,
                            on_dot=dot_handed)
        reader = asyncio.ensure_future(protocol.read_response(timeout=None))
        try:
            # the reader must be waiting before a byte goes: aiosmtplib drops a reply that
            # comes while no read is pending, and uvloop runs a reply's data_received before
            # a task step queued earlier (the final dot's 250 was lost, the message hung)
            await asyncio.sleep(0)
            outcome = await transfer.run(reader, start_gate)
        except BaseException:  # cancelled (shutdown cut): the dot must not leave after this
            reader.cancel()
            progress.dot_written = transfer.complete
            if progress.dot_written:  # out of the process, maybe not yet out of the kernel
                await _withdraw_dot(transport, progress, "the shutdown cut the transfer")
            discard(smtp)
            raise
        progress.dot_written = transfer.complete
        if outcome is Outcome.SENT:
            return await self._final_reply(smtp, transport, reader, progress)
        if outcome is Outcome.ANSWERED:
            discard(smtp)  # the rest must not follow the reply
            return _early_reply(reader.result()), False
        reader.cancel()
        if outcome is Outcome.WITHHELD:
            abort(transport)  # reset: the upstream discards the transaction, no dot went
            smtp.close()
            return _synthetic(progress.abort_reply or replies.STORE_DOWN), False
        log.warning("upstream transfer %s with %d bytes unsent: reset, nothing delivered",
                    outcome.value, write_backlog(transport))
        discard(smtp)  # what is still buffered, the final dot included, never leaves
        return _synthetic(replies.UPSTREAM_TIMEOUT if outcome is Outcome.STALLED
                          else replies.UPSTREAM_LOST), False

    async def _final_reply(self, smtp: aiosmtplib.SMTP, transport: WireTransport,
                           reader: asyncio.Future[aiosmtplib.SMTPResponse],
                           progress: DeliveryProgress) -> tuple[RcptResult, bool]:
        """The outcome once the kernel took the final dot: 2yz, a 4yz/5yz refusal, or UNKNOWN
        (never reused: a late reply would be read as the next command's). A cancellation
        (shutdown cut) that meets a reply already read takes that reply: it is the upstream's
        verdict, and throwing it away would turn a definite answer into an in-doubt one; so is
        a reply the kernel received by the deadline (:func:`await_reply`). A
        wait that ends without a reply (the timeout, or a cut) while the kernel has not sent
        all of the message resets the connection (:func:`withdraw`): the dot can never arrive,
        ``progress.dot_written`` goes back to False, and the timeout is a refusal (released),
        not UNKNOWN."""
        try:
            response = await await_reply(reader, transport, self._cfg.final_timeout_s,
                                         self._cfg.command_timeout_s)
        except asyncio.CancelledError:
            if not reader.done() or reader.cancelled() or reader.exception() is not None:
                await _withdraw_dot(transport, progress, "the shutdown's wait for it ended")
                raise
            absorb_cancel()
            response = reader.result()
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError) and await _withdraw_dot(
                    transport, progress, f"none within {self._cfg.final_timeout_s:g} s"):
                smtp.close()
                return _synthetic(replies.UPSTREAM_TIMEOUT), False
            smtp.close()
            log.error("upstream gave no reply to the final dot (%s): outcome unknown",
                      type(exc).__name__)
            return _synthetic(replies.OUTCOME_UNKNOWN, RcptStatus.UNKNOWN), False
        reply = SmtpReply.parse(response.code, response.message)
        if 200 <= response.code < 300:
            return RcptResult(RcptStatus.ACCEPTED, reply), True
        if 400 <= response.code < 600:
            return RcptResult(RcptStatus.REFUSED, reply), _clean(response.code)
        smtp.close()  # a reply no RFC allows here: whether it took the message is unknown
        log.error("upstream answered the final dot with %d: outcome unknown", response.code)
        return _synthetic(replies.OUTCOME_UNKNOWN, RcptStatus.UNKNOWN), False

    @property
    def name(self) -> str:
        """The configured name of this upstream (``HOST:PORT`` when none was given)."""
        if self._cfg.name:
            return self._cfg.name
        host = f"[{self._cfg.host}]" if ":" in self._cfg.host else self._cfg.host
        return f"{host}:{self._cfg.port}"

    def _named(self, result: DeliveryResult) -> DeliveryResult:
        """``result`` with this upstream's name (the metric label of its reply)."""
        return dataclasses.replace(result, upstream=self.name)

    async def ping(self) -> None:
        """Connect, EHLO and QUIT; raise ConnectionError when the smarthost does not answer."""
        smtp = self._client()
        try:
            await smtp.connect(timeout=self._cfg.connect_timeout_s)
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            raise ConnectionError(f"upstream {self._cfg.host}:{self._cfg.port}: {exc}") from exc
        finally:
            await quit_politely(smtp)

    async def close(self) -> None:
        """QUIT every pooled connection (the relay is stopping)."""
        await self._pool.close()
