"""Inbound SMTP AUTH: the SASL PLAIN and LOGIN mechanisms over a users file.

Sources: RFC 4954 (SMTP AUTH: ``334`` challenges with a mandatory space, ``*`` cancels,
``=`` is an empty initial response, ``501``/``535``/``235`` replies), RFC 4616 (PLAIN:
``[authzid] NUL authcid NUL passwd``, UTF-8), and draft-murchison-sasl-login-00 (LOGIN:
base64 ``Username:`` and ``Password:`` challenges). Client quirks it accepts: the mechanism
name in any case, ``AUTH PLAIN`` without an initial response (answered ``334 ``), LOGIN
prompts compared byte for byte by the client.

The users file, its hash checks and the rule of attempts (the guess budget, the failure delay,
the turns of a user name) are :mod:`relay.credentials`'; this module speaks SASL over them.
Passwords, hashes and AUTH blobs are never logged or put in an exception; the username is
logged at DEBUG only. The authenticated identity is part of the dedup fingerprint only with
``scope_by_auth``.

:class:`SaslMechanisms` plugs into aiosmtpd: the listener's handler exposes its ``auth_PLAIN``
and ``auth_LOGIN`` (aiosmtpd offers every handler method named ``auth_<MECH>``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import logging
from collections.abc import Callable

from aiosmtpd.smtp import SMTP, AuthResult

from relay.core import replies
from relay.credentials import AttemptResult, Attempts, CredentialFile

log = logging.getLogger("relay.smtp.auth")

_LOGIN_USERNAME = "Username:"  # exactly, without NUL: Go's net/smtp compares it
_LOGIN_PASSWORD = "Password:"  # noqa: S105  (the LOGIN prompt, not a password)


async def _first_response(server: SMTP, args: list[str], challenge: str | bytes, *,
                          encode_to_b64: bool = True) -> bytes | None:
    """The client's first SASL response: the AUTH line's initial response (RFC 4954 section
    4), else its answer to ``challenge``. ``None`` when the exchange is over: '*' or bad
    base64 to the challenge (aiosmtpd answered 501), or a bad initial response (answered
    here)."""
    if len(args) == 1:
        blob = await server.challenge_auth(challenge, encode_to_b64=encode_to_b64)
        return blob if isinstance(blob, bytes) else None
    decoded = _decode_initial_response(args[1])
    if decoded is None:
        await server.push(str(replies.AUTH_BAD_BASE64))
    return decoded


def _decode_initial_response(arg: str) -> bytes | None:
    """The initial response of ``AUTH <mech> <arg>``; ``=`` is empty (RFC 4954 section 4)."""
    if arg == "=":
        return b""
    try:
        return base64.b64decode(arg.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        return None


def _split_plain(message: bytes) -> tuple[str, str, str] | None:
    """``(authzid, authcid, passwd)`` of a PLAIN message (RFC 4616 section 2), or None."""
    parts = message.split(b"\x00")
    if len(parts) != 3:
        return None
    try:
        authzid, authcid, passwd = (part.decode("utf-8") for part in parts)
    except UnicodeDecodeError:
        return None
    return authzid, authcid, passwd


def _peer_host(server: SMTP) -> str:
    """The client's address: behind a PROXY balancer the one its header gave."""
    client = getattr(server, "client_host", None)
    if isinstance(client, str) and client:
        return client
    peer = server.session.peer if server.session is not None else None
    return str(peer[0]) if isinstance(peer, tuple) else str(peer)


class SaslMechanisms:
    """SASL PLAIN and LOGIN for aiosmtpd, checked against a :class:`CredentialFile` under
    :class:`Attempts`' rule (the guess budget per client address, across connections; the
    failure delay; a user never locked out).

    A right password is answered ``235`` as soon as it is verified; a failure ``535`` at its
    delay floor, or ``421 4.7.0`` with the connection closed when it spent the address's
    budget; an attempt from an address whose budget failures spent is not checked: it calls
    ``on_refused`` and is answered ``421 4.7.0``, the connection closed. Each failure calls
    ``on_failure`` (for a metric) once its check is done, also when the client hung up
    before the answer. A cancelled exchange (``*``) or bad base64 is answered ``501`` by
    aiosmtpd and is not counted. Raises ValueError as :class:`Attempts`.
    """

    def __init__(self, *, credentials: CredentialFile,
                 on_failure: Callable[[], None] | None = None,
                 on_refused: Callable[[], None] | None = None,
                 failure_delay_s: float = 1.0, max_failures: int = 5,
                 failure_window_s: float = 600.0) -> None:
        self.attempts = Attempts(credentials=credentials, failure_delay_s=failure_delay_s,
                                 max_failures=max_failures, failure_window_s=failure_window_s)
        self._on_failure = on_failure
        self._on_refused = on_refused

    @classmethod
    def under(cls, attempts: Attempts, *, on_failure: Callable[[], None] | None = None,
              on_refused: Callable[[], None] | None = None) -> SaslMechanisms:
        """The mechanisms over ``attempts`` (the users file under the guess rule, as the
        settings build it: :meth:`relay.settings.access.AccessSettings.auth_attempts`)."""
        sasl = cls.__new__(cls)
        sasl.attempts, sasl._on_failure, sasl._on_refused = attempts, on_failure, on_refused
        return sasl

    @property
    def credentials(self) -> CredentialFile:
        """The users AUTH is checked against (:meth:`CredentialFile.replace_with` on reload)."""
        return self.attempts.credentials

    async def auth_PLAIN(self, server: SMTP, args: list[str]) -> AuthResult:
        """``AUTH PLAIN [initial-response]`` (RFC 4616); ``args`` is the AUTH line split.

        Without an initial response the challenge is ``334 `` (empty). An authzid other than
        the authcid is refused. Returns aiosmtpd's AuthResult; ``auth_data`` is the username.
        """
        message = await _first_response(server, args, b"", encode_to_b64=False)
        if message is None:
            return AuthResult(success=False, handled=True)
        parts = _split_plain(message)
        if parts is None:
            return await self._check(server, "PLAIN", None, None)
        authzid, username, password = parts
        if authzid not in ("", username):  # acting as another user is not offered
            return await self._check(server, "PLAIN", username, None)
        return await self._check(server, "PLAIN", username, password)

    async def auth_LOGIN(self, server: SMTP, args: list[str]) -> AuthResult:
        """``AUTH LOGIN [base64 username]`` (draft-murchison-sasl-login-00).

        Challenges are base64 ``Username:`` (unless the username came on the AUTH line) and
        ``Password:``, without NUL. Returns aiosmtpd's AuthResult; ``auth_data`` is the
        username.
        """
        username_bytes = await _first_response(server, args, _LOGIN_USERNAME)
        if username_bytes is None:
            return AuthResult(success=False, handled=True)
        password_blob = await server.challenge_auth(_LOGIN_PASSWORD)
        if not isinstance(password_blob, bytes):
            return AuthResult(success=False, handled=True)
        try:
            username = username_bytes.decode("utf-8")
            password = password_blob.decode("utf-8")
        except UnicodeDecodeError:
            return await self._check(server, "LOGIN", None, None)
        return await self._check(server, "LOGIN", username, password)

    async def _check(self, server: SMTP, mechanism: str, username: str | None,
                     password: str | None) -> AuthResult:
        """One attempt under :class:`Attempts`' rule: ``235`` at once when right; a failure
        ``535`` at its delay floor, or ``421`` and closed when it spent the budget; refused
        unchecked ``421`` and closed.

        ``username`` is None when the exchange named none that can be decoded, ``password``
        None when the attempt fails before its password matters.
        """
        host = _peer_host(server)
        result = await self.attempts.check(host, username, password, on_failure=functools.partial(
            self._failed, mechanism, host, username))
        if result is AttemptResult.SUCCEEDED:
            log.info("auth succeeded", extra={"mechanism": mechanism, "peer": host})
            log.debug("auth succeeded for user", extra={"username": username})
            return AuthResult(success=True, auth_data=username,
                              message=str(replies.AUTH_SUCCEEDED))
        if result is AttemptResult.REFUSED:
            if self._on_refused is not None:
                self._on_refused()
            log.warning("auth budget spent, attempt refused unchecked", extra={"peer": host})
            return await self._close(server)
        return await self._fail(server, host)

    def _failed(self, mechanism: str, host: str, username: str | None) -> None:
        """A failed check: counted (``on_failure``) and logged."""
        if self._on_failure is not None:
            self._on_failure()
        log.info("auth failed", extra={"mechanism": mechanism, "peer": host,
                                       "failures": self.attempts.spent(host)})
        if username is not None:
            log.debug("auth failed for user", extra={"username": username})

    async def _fail(self, server: SMTP, host: str) -> AuthResult:
        """Answer a failure: 535, or 421 and close when it spent the address's budget."""
        if not self.attempts.exhausted(host):
            return AuthResult(success=False, handled=False, message=str(replies.AUTH_FAILED))
        log.warning("too many auth failures, closing", extra={"peer": _peer_host(server)})
        return await self._close(server)

    @staticmethod
    async def _close(server: SMTP) -> AuthResult:
        """Answer ``421 4.7.0`` and close the connection."""
        await server.push(str(replies.AUTH_TOO_MANY_FAILURES))
        if server.transport is not None:
            server.transport.close()
        return AuthResult(success=False, handled=True)
