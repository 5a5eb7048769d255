"""OAuth2 access tokens for smarthost AUTH XOAUTH2 / OAUTHBEARER (RFC 6749, RFC 7628).

:class:`TokenProvider` holds the relay's token: it caches it and lets one fetch run at a time,
whatever :class:`TokenSource` gets it. :class:`FormGrant` (here, no extra library) asks the
token endpoint with the
client-credentials grant (RFC 6749 section 4.4: ``client_id`` + ``client_secret`` + ``scope``,
Microsoft 365 / Entra ID) or the refresh-token grant (section 6: ``refresh_token`` +
``client_id`` [+ ``client_secret``], Google Workspace), POSTed as
``application/x-www-form-urlencoded`` over HTTPS, the endpoint's certificate verified against
``ca_file`` when given, else the system's CAs; a refresh token the endpoint rotates (a new
``refresh_token`` in its reply, RFC 6749 section 6) replaces the old one, in memory and in its
file. The Microsoft (msal: certificate, workload and managed identity) and Google (google-auth:
service account) sources are :mod:`relay.upstream.oauth_libraries`'s (the ``oauth`` extra).
A token is cached until ``expires_in`` less a
margin (a tenth of its life, at most 60 s); one fetch runs at a time and concurrent callers
wait for it. :meth:`TokenProvider.invalidate` drops a token the smarthost refused (535), so
the next caller fetches a fresh one.

Failures raise :class:`TokenError` with a client-safe reason (no secret, no token): the
endpoint unreachable or timed out, an HTTP error status, a reply that is no token. The client
secret comes from its file, read once when the provider is built (a new secret needs a
restart). The refresh token's file is shared by every worker of the relay: a refresh grant
holds an exclusive ``flock`` on ``.<file>.lock`` beside it (:mod:`relay.upstream.oauth_lock`:
never followed through a link, never gone without while workers share the token), reads the
file again (another worker may have rotated the token) and writes a rotated token back before
letting go, so one worker refreshes at a time, each with the token in force. A reply is read
within :data:`MAX_TOKEN_REPLY_BYTES` (:func:`relay.core.http_rules.read_bounded`'s rule), a
redirect is not followed, and what the endpoint says of an error is logged shortened and
escaped. A fetch started is not abandoned by
its caller's cancellation (it may carry a rotated refresh token): it runs to its end, and
:meth:`TokenProvider.close` waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import ssl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, get_args

from relay.core.http_rules import ReplyTooLarge, printable_excerpt, refuse_declared
from relay.upstream.oauth_lock import LockError, exclusive, lock_path

if TYPE_CHECKING:  # aiohttp is imported where a token is fetched (most relays use none)
    import aiohttp

log = logging.getLogger("relay.upstream.oauth")

_MAX_MARGIN_S = 60.0  # a token is renewed this long (or a tenth of its life) before it expires
MAX_TOKEN_REPLY_BYTES = 64 * 1024  # a token reply past this is refused, never read whole
_DEFAULT_LIFETIME_S = 300.0  # a reply without expires_in (RFC 6749 5.1: only RECOMMENDED)
_MAX_ERROR_TEXT = 200
ENTRA_TOKEN_PATH = "/oauth2/v2.0/token"  # noqa: S105 (a URL path, not a secret)


TokenFailure = Literal["unreachable", "refused", "malformed", "too_large", "redirected",
                       "not_https", "busy", "lock"]
TOKEN_FAILURES: tuple[TokenFailure, ...] = get_args(TokenFailure)
"""The kinds of :class:`TokenError` (the ``reason`` label of
``relay_oauth_token_failures_total``): the endpoint unreachable or timed out, an error
answer, a reply that is no token, a reply over the bound, a redirect (not followed), an
endpoint that is not https (nor loopback), the refresh lock held too long by one worker, the
refresh lock not usable while workers share the token."""


class TokenError(Exception):
    """No access token: ``reason`` says why in words safe to show a client (no secret);
    ``kind`` is one of :data:`TOKEN_FAILURES`."""

    def __init__(self, reason: str, *, kind: TokenFailure) -> None:
        super().__init__(reason)
        self.reason, self.kind = reason, kind


@dataclass(frozen=True, repr=False)
class OAuthConfig:
    """Where and how to get a token. ``refresh_token`` set: the refresh-token grant; else the
    client-credentials grant (``client_secret`` then required). ``timeout_s``: seconds for the
    whole token request (connect, TLS, reply). ``repr`` hides the secrets."""

    token_url: str
    client_id: str
    client_secret: str | None = None
    refresh_token: str | None = None
    scope: str | None = None
    ca_file: Path | None = None
    timeout_s: float = 30.0
    refresh_token_file: Path | None = None  # where a rotated refresh token is written back
    shared: bool = True  # several workers refresh this token: never without the lock

    @property
    def grant(self) -> str:
        """``refresh_token`` or ``client_credentials`` (the ``grant_type`` form field)."""
        return "refresh_token" if self.refresh_token is not None else "client_credentials"

    def form(self) -> dict[str, str]:
        """The token request's form fields (RFC 6749 sections 4.4.2 and 6)."""
        fields = {"grant_type": self.grant, "client_id": self.client_id}
        if self.client_secret is not None:
            fields["client_secret"] = self.client_secret
        if self.refresh_token is not None:
            fields["refresh_token"] = self.refresh_token
        if self.scope:
            fields["scope"] = self.scope
        return fields

    def __repr__(self) -> str:
        return (f"OAuthConfig(token_url={self.token_url!r}, client_id={self.client_id!r}, "
                f"grant={self.grant!r}, scope={self.scope!r})")


def entra_authority(token_url: str) -> str:
    """The msal authority of an Entra token endpoint URL:
    ``https://login.microsoftonline.com/TENANT/oauth2/v2.0/token`` ->
    ``https://login.microsoftonline.com/TENANT``. Raises ValueError for another shape."""
    if not token_url.startswith("https://") or not token_url.endswith(ENTRA_TOKEN_PATH):
        raise ValueError(f"an Entra token endpoint is https://HOST/TENANT{ENTRA_TOKEN_PATH}")
    authority = token_url[: -len(ENTRA_TOKEN_PATH)]
    if authority.count("/") < 3 or authority.endswith("/"):
        raise ValueError(f"an Entra token endpoint is https://HOST/TENANT{ENTRA_TOKEN_PATH}")
    return authority


def tls_context(ca_file: Path | None) -> ssl.SSLContext:
    """A verifying client context: the CAs of ``ca_file`` (PEM), else the system's.

    Raises ``ssl.SSLError`` or ``OSError`` when the file is no readable PEM CA bundle.
    """
    return ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)


class TokenSource(Protocol):
    """Where a :class:`TokenProvider` gets a fresh token."""

    async def fetch(self) -> tuple[str, float]:
        """A new access token and its lifetime in seconds. Raises :class:`TokenError` (its
        reason safe to show a client) when there is none; logs why."""
        ...


class TokenProvider:
    """Access tokens for one OAuth2 client from ``source``; see the module docstring.

    ``clock`` (seconds, monotonic) is injectable for tests; ``fetches`` counts token requests
    sent (successful or not); ``on_failure`` is called with the kind of each failed fetch
    (:data:`TOKEN_FAILURES`: the metric).
    """

    def __init__(self, source: TokenSource, *,
                 clock: Callable[[], float] = time.monotonic,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self._source = source
        self._clock = clock
        self._on_failure = on_failure
        self._token: str | None = None
        self._valid_until = 0.0
        self._inflight: asyncio.Task[str] | None = None
        self.fetches = 0

    async def token(self) -> str:
        """A valid access token: the cached one, else a fresh one (one fetch at a time: a
        caller arriving during a fetch waits for that one). A caller cancelled while it waits
        leaves the fetch running (:meth:`close` waits for it).

        Raises :class:`TokenError` when the endpoint gives none.
        """
        cached = self._cached()
        if cached is not None:
            return cached
        if self._inflight is None:
            self.fetches += 1
            self._inflight = asyncio.get_running_loop().create_task(self._fetch())
            self._inflight.add_done_callback(self._fetched)
        return await asyncio.shield(self._inflight)

    async def close(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` seconds for the fetch in flight, whose reply may carry a
        rotated refresh token that must reach its file; cancel it past that."""
        task = self._inflight
        if task is None:
            return
        done, _ = await asyncio.wait([task], timeout=timeout_s)
        if not done:
            log.error("OAuth2: the token request still runs after %.0f s: cancelled",
                      timeout_s)
            task.cancel()

    def invalidate(self, token: str) -> None:
        """Forget ``token`` (the smarthost refused it) unless a newer one replaced it already:
        many connections refused with one stale token cause one fetch, not many."""
        if self._token == token:
            self._token = None

    async def _fetch(self) -> str:
        try:
            token, lifetime = await self._source.fetch()
        except TokenError as exc:
            if self._on_failure is not None:
                self._on_failure(exc.kind)
            raise
        margin = min(_MAX_MARGIN_S, lifetime / 10)
        self._token, self._valid_until = token, self._clock() + lifetime - margin
        return token

    def _fetched(self, task: asyncio.Task[str]) -> None:
        if self._inflight is task:
            self._inflight = None
        if not task.cancelled():
            task.exception()  # retrieved: every caller that awaited it may have been cancelled

    def _cached(self) -> str | None:
        if self._token is not None and self._clock() < self._valid_until:
            return self._token
        return None


class FormGrant:
    """:class:`TokenSource` of the client-credentials and refresh-token grants, POSTed by the
    relay itself (see the module docstring). Raises ValueError for a config without a grant."""

    def __init__(self, config: OAuthConfig) -> None:
        if config.refresh_token is None and config.client_secret is None:
            raise ValueError("the client-credentials grant needs a client secret")
        self._cfg = config
        self._ssl = tls_context(config.ca_file)
        self._in_file = config.refresh_token  # the refresh token its file held when last seen

    async def fetch(self) -> tuple[str, float]:
        """POST the grant; the token and its lifetime in seconds. A refresh grant with a
        token file holds the file's lock and reads it first (the module docstring). Raises
        TokenError."""
        path = self._cfg.refresh_token_file
        if self._cfg.refresh_token is None or path is None:
            return await self._post()
        path = Path(await asyncio.to_thread(os.path.realpath, path))
        try:
            async with exclusive(lock_path(path), wait_s=self._cfg.timeout_s + _LOCK_MARGIN_S,
                                 shared=self._cfg.shared):
                await self._read_refresh_token(path)
                return await self._post()
        except LockError as exc:
            raise TokenError(exc.reason, kind=exc.kind) from None

    async def _read_refresh_token(self, path: Path) -> None:
        """Take the refresh token in ``path`` when it is not the one last seen there (another
        worker rotated it, or the operator replaced it); keep this process's own otherwise
        (one it could not write back)."""
        try:
            text = (await asyncio.to_thread(path.read_text, encoding="utf-8")).strip()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("OAuth2: the refresh token file %s cannot be read (%s): the token "
                        "this process holds is used", path, exc)
            return
        if text and text != self._in_file:
            self._cfg = dataclasses.replace(self._cfg, refresh_token=text)
            self._in_file = text

    async def _post(self) -> tuple[str, float]:
        import aiohttp  # its import costs a start 0.2 s of CPU

        url = self._cfg.token_url
        timeout = aiohttp.ClientTimeout(total=self._cfg.timeout_s)
        try:
            # never follow a redirect: it would POST the client secret again, perhaps to
            # another host or over plain http, and take a token from there
            async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                    url, data=self._cfg.form(), ssl=self._ssl, allow_redirects=False,
                    headers={"Accept": "application/json"}) as response:
                status = response.status
                body = await _bounded_body(response)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.error("OAuth2 token endpoint %s unreachable (%s: %s)", url,
                      type(exc).__name__, printable_excerpt(str(exc)))
            raise TokenError("token endpoint unreachable", kind="unreachable") from exc
        except ReplyTooLarge as exc:
            log.error("OAuth2 token endpoint %s: %s", url, exc)
            raise TokenError("token endpoint reply too large", kind="too_large") from exc
        if 300 <= status < 400:
            log.error("OAuth2 token endpoint %s answered HTTP %d (a redirect to %s): not "
                      "followed; set oauth_token_url to the endpoint itself", url, status,
                      printable_excerpt(response.headers.get("Location", "nowhere")))
            raise TokenError(f"token endpoint redirected, HTTP {status}", kind="redirected")
        if status != 200:
            log.error("OAuth2 token endpoint %s answered HTTP %d (%s grant, client_id %s): %s",
                      url, status, self._cfg.grant, self._cfg.client_id, _error_text(body))
            raise TokenError(f"token endpoint refused, HTTP {status}", kind="refused")
        try:
            token, lifetime, rotated = _parse(body)
        except ValueError as exc:
            log.error("OAuth2 token endpoint %s gave no usable token: %s", url, exc)
            raise TokenError("token endpoint reply malformed", kind="malformed") from exc
        if rotated is not None and self._cfg.refresh_token not in (None, rotated):
            await self._keep_refresh_token(rotated)
        return token, lifetime

    async def _keep_refresh_token(self, rotated: str) -> None:
        """Use ``rotated`` from now on, and write it over ``refresh_token_file`` (atomically,
        mode 0600) so a restart uses it too: an endpoint that rotates revokes the old one."""
        self._cfg = dataclasses.replace(self._cfg, refresh_token=rotated)
        path = self._cfg.refresh_token_file
        if path is None:
            return
        # the write runs to its end even if this fetch is cancelled (a stop's bound): the
        # lock is let go only once the file holds the new token
        write = asyncio.ensure_future(asyncio.to_thread(_write_secret, path, rotated))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            await asyncio.wait([write])
            if not write.exception():
                self._in_file = rotated
            raise
        except OSError as exc:
            log.error("OAuth2: the token endpoint rotated the refresh token and it could not "
                      "be written to %s (%s): this process uses the new one, a restart would "
                      "read the old one", path, exc)
            return
        self._in_file = rotated
        log.info("OAuth2: the token endpoint rotated the refresh token; kept in %s", path)


_LOCK_MARGIN_S = 5.0  # a refresh waits this much longer than a token request for the lock


async def _bounded_body(response: aiohttp.ClientResponse) -> bytes:
    """The body of ``response``, at most :data:`MAX_TOKEN_REPLY_BYTES` read
    (:func:`relay.core.http_rules.read_bounded`'s rule, over aiohttp's stream); raises
    ReplyTooLarge (after reading at most one byte more, or none when its Content-Length says
    so) for a longer one."""
    refuse_declared(response.content_length, MAX_TOKEN_REPLY_BYTES)
    body = bytearray()
    while len(body) <= MAX_TOKEN_REPLY_BYTES:
        chunk = await response.content.read(MAX_TOKEN_REPLY_BYTES + 1 - len(body))
        if not chunk:
            return bytes(body)
        body += chunk
    raise ReplyTooLarge(f"reply over {MAX_TOKEN_REPLY_BYTES} bytes refused")


def _write_secret(path: Path, value: str) -> None:
    """Replace the file ``path`` names (through symbolic links: the link stays) with
    ``value``: a new file in its folder, mode 0600, synced, renamed over it, the folder
    synced (a warning when it cannot be). Raises OSError when the file is not replaced."""
    target = Path(os.path.realpath(path))
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(value + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    try:  # the rename done, the file holds the token: a folder that cannot sync is a warning
        folder = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError as exc:
        log.warning("OAuth2: %s written, its folder not synced (%s): a power loss may undo "
                    "the rename", target, exc.strerror)


def _parse(body: bytes) -> tuple[str, float, str | None]:
    """``access_token``, ``expires_in`` and the ``refresh_token`` (None without one) of a
    token response (RFC 6749 sections 5.1 and 6).

    Raises ValueError (its text names the fault, never the token) for anything else.
    """
    try:
        reply = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("not JSON") from None
    except RecursionError:  # arrays or objects nested past the interpreter's stack
        raise ValueError("JSON nested too deep") from None
    if not isinstance(reply, dict):
        raise ValueError("not a JSON object")
    token = reply.get("access_token")
    if not isinstance(token, str) or not token or not token.isprintable():
        raise ValueError("no access_token string")
    token_type = reply.get("token_type", "Bearer")
    if not isinstance(token_type, str) or token_type.lower() != "bearer":
        raise ValueError(f"token_type is {str(token_type)[:20]!r}, not Bearer")
    lifetime = reply.get("expires_in", _DEFAULT_LIFETIME_S)
    if isinstance(lifetime, str) and lifetime.isdigit():  # some endpoints quote it
        lifetime = int(lifetime)
    if (isinstance(lifetime, bool) or not isinstance(lifetime, int | float)
            or not math.isfinite(lifetime) or lifetime <= 0):
        raise ValueError("expires_in is not a finite positive number")
    refresh = reply.get("refresh_token")
    if not isinstance(refresh, str) or not refresh or not refresh.isprintable():
        refresh = None
    return token, float(lifetime), refresh


def _error_text(body: bytes) -> str:
    """The ``error`` and ``error_description`` of an error reply (RFC 6749 section 5.2), or
    its first bytes; at most 200 characters, its control characters escaped
    (:func:`relay.core.http_rules.printable_excerpt`), for the log."""
    try:
        reply = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        reply = None
    if isinstance(reply, dict) and "error" in reply:
        text = f"{reply.get('error')}: {reply.get('error_description', '')}"
    else:
        text = body[:_MAX_ERROR_TEXT].decode("utf-8", "replace")
    return printable_excerpt(text, _MAX_ERROR_TEXT)
