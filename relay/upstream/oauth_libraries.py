"""Token sources that are a maintained library's (the ``oauth`` extra): Microsoft Entra ID through
msal, Google through google-auth. Each is a :class:`relay.upstream.oauth.TokenSource`; the
relay's :class:`relay.upstream.oauth.TokenProvider` keeps its cache and its one fetch at a time
in front of them. The libraries block (requests): each fetch runs in a daemon thread of its
own, every HTTP request bounded by ``timeout_s`` and the whole fetch by twice that.

- :class:`EntraClient`: the client-credentials grant of a confidential client (msal
  ``ConfidentialClientApplication``) with a client secret, a certificate (a client assertion
  JWT signed with its private key, RFC 7523; the certificate sent as ``x5c``) or a federated
  token file (workload identity: Kubernetes' projected service-account token, read again for
  each fetch, so its rotation is followed).
- :class:`EntraManagedIdentity`: an Azure managed identity (msal ``ManagedIdentityClient``:
  App Service / Functions ``IDENTITY_ENDPOINT``, Azure Arc, Service Fabric, the VM's IMDS),
  system-assigned or user-assigned by its client id.
- :class:`GoogleServiceAccount`: a service account's key (google-auth), the token for the
  mailbox ``subject`` (domain-wide delegation: Gmail takes XOAUTH2 only for a user).

Every HTTP request a library makes goes through a :class:`relay.upstream.token_http.
TokenSession` (no redirect, the reply bounded, https only but for loopback). Failures raise
:class:`relay.upstream.oauth.TokenError` with a client-safe reason; the library's error (never a
secret) is logged, shortened and escaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import requests

from relay.core.http_rules import endpoint_refusal, printable_excerpt
from relay.upstream.oauth import TokenError, entra_authority
from relay.upstream.token_http import TokenSession

log = logging.getLogger("relay.upstream.oauth")

_T = TypeVar("_T")
_REQUESTS_PER_FETCH = 2  # msal's first fetch asks the authority's discovery document too


def load_certificate(path: Path) -> dict[str, str]:
    """msal's certificate credential from one PEM file holding the private key (unencrypted)
    and the certificate: ``private_key``, ``public_certificate`` (sent as ``x5c``, so a
    certificate renewed under the same subject keeps working) and its SHA-256 ``thumbprint``
    (``x5t#S256``). Raises ValueError naming what the file lacks, OSError when unreadable."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    pem = path.read_bytes()
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: no unencrypted PEM private key ({exc})") from None
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise ValueError(f"{path}: no PEM certificate") from None
    if cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != \
            key.public_key().public_bytes(serialization.Encoding.DER,
                                          serialization.PublicFormat.SubjectPublicKeyInfo):
        raise ValueError(f"{path}: the private key is not the certificate's")
    der = cert.public_bytes(serialization.Encoding.DER)
    return {
        "private_key": key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()).decode(),
        "public_certificate": cert.public_bytes(serialization.Encoding.PEM).decode(),
        "thumbprint_sha256": hashlib.sha256(der).hexdigest(),
    }


def _msal_token(result: Mapping[str, Any] | None, what: str) -> tuple[str, float]:
    """The token and lifetime of an msal result; TokenError (logged) for an error result."""
    if result and isinstance(result.get("access_token"), str) and result["access_token"]:
        return result["access_token"], float(result.get("expires_in") or 300)
    reply = result or {"error": "no result"}
    log.error("OAuth2 (%s): no token: %s", what, printable_excerpt(
        f"{reply.get('error')}: {reply.get('error_description', '')}"))
    raise TokenError("token endpoint refused", kind="refused")


async def _in_thread(call: Callable[[], tuple[str, float]], what: str, *, timeout_s: float,
                     unreachable: tuple[type[Exception], ...] = ()) -> tuple[str, float]:
    """Run a library's blocking fetch in a daemon thread of its own, waited for at most
    :data:`_REQUESTS_PER_FETCH` x ``timeout_s`` (its requests' timeout, seconds: that bounds
    each read, not a reply that trickles, nor the library's retries); its failures become
    TokenError: past the deadline, requests' and the socket's, and ``unreachable`` (the
    library's own transport error), as ``token endpoint unreachable``; any other as
    ``token endpoint refused``. A fetch left past its deadline, or by a stop, finishes in its
    thread unwaited, and never holds up the process's exit."""
    deadline_s = _REQUESTS_PER_FETCH * timeout_s
    transport: tuple[type[Exception], ...] = (requests.RequestException, OSError, *unreachable)
    try:
        return await asyncio.wait_for(_daemon_thread(call), deadline_s)
    except TokenError:
        raise
    except TimeoutError as exc:
        log.error("OAuth2 (%s): token endpoint unreachable (no token within %.0f s)", what,
                  deadline_s)
        raise TokenError("token endpoint unreachable", kind="unreachable") from exc
    except transport as exc:
        log.error("OAuth2 (%s): token endpoint unreachable (%s: %s)", what,
                  type(exc).__name__, printable_excerpt(str(exc)))
        raise TokenError("token endpoint unreachable", kind="unreachable") from exc
    except Exception as exc:  # the library's own errors (msal, google-auth): logged, no secret
        log.error("OAuth2 (%s): no token (%s: %s)", what, type(exc).__name__,
                  printable_excerpt(str(exc)))
        raise TokenError("token endpoint refused", kind="refused") from exc


async def _daemon_thread(call: Callable[[], _T]) -> _T:
    """``call()`` in a new daemon thread; its result or exception."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not done.done():  # the caller may have stopped waiting
            outcome()

    def run() -> None:
        try:
            result = call()
        except Exception as exc:  # handed to the waiting task
            report: Callable[[], None] = functools.partial(done.set_exception, exc)
        else:
            report = functools.partial(done.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, report)

    threading.Thread(target=run, name="oauth-token", daemon=True).start()
    return await done


@dataclass(frozen=True, repr=False)
class EntraCredential:
    """Exactly one of: ``client_secret``, ``certificate`` (:func:`load_certificate`'s dict),
    ``federated_token_file`` (read for each fetch)."""

    client_secret: str | None = None
    certificate: Mapping[str, str] | None = None
    federated_token_file: Path | None = None

    def for_msal(self) -> str | dict[str, Any]:
        if self.client_secret is not None:
            return self.client_secret
        if self.certificate is not None:
            return dict(self.certificate)
        if self.federated_token_file is not None:
            path = self.federated_token_file
            return {"client_assertion": lambda: path.read_text(encoding="utf-8").strip()}
        raise ValueError("an Entra client needs a secret, a certificate or a federated token")


class EntraClient:
    """:class:`relay.upstream.oauth.TokenSource` of an Entra confidential client (msal)."""

    def __init__(self, *, token_url: str, client_id: str, credential: EntraCredential,
                 scope: str, ca_file: Path | None = None, timeout_s: float = 30.0) -> None:
        self._what = f"Entra client {client_id}"
        self._scopes = [scope]
        self._build = functools.partial(
            _entra_app, client_id, credential.for_msal(), entra_authority(token_url),
            TokenSession(timeout_s, str(ca_file) if ca_file else True), timeout_s)
        self._app: Any = None
        self._timeout_s = timeout_s

    async def fetch(self) -> tuple[str, float]:
        def call() -> tuple[str, float]:
            import msal

            if self._app is None:  # msal asks the authority's discovery document on creation
                self._app = self._build()
            # msal's own cache would hand back the token the smarthost just refused: the
            # relay's TokenProvider is the cache, each fetch asks the authority
            self._app.token_cache = msal.TokenCache()
            return _msal_token(self._app.acquire_token_for_client(scopes=self._scopes),
                               self._what)
        return await _in_thread(call, self._what, timeout_s=self._timeout_s)


def _entra_app(client_id: str, credential: str | dict[str, Any], authority: str,
               session: requests.Session, timeout_s: float) -> Any:
    """msal's confidential client (it fetches the authority's OpenID discovery document: call
    it off the event loop)."""
    import msal

    return msal.ConfidentialClientApplication(
        client_id, client_credential=credential, authority=authority,
        # the authority is the one configured: no call to Microsoft's instance discovery
        instance_discovery=False, http_client=session, timeout=timeout_s)


class EntraManagedIdentity:
    """:class:`relay.upstream.oauth.TokenSource` of an Azure managed identity (msal):
    ``identity`` ``system``, or the client id of a user-assigned one. ``scope`` is turned into
    the resource managed identity asks for (``https://outlook.office365.com/.default`` ->
    ``https://outlook.office365.com``)."""

    def __init__(self, *, identity: str, scope: str, ca_file: Path | None = None,
                 timeout_s: float = 30.0) -> None:
        import msal

        which: msal.ManagedIdentity = (
            msal.SystemAssignedManagedIdentity() if identity == "system"
            else msal.UserAssignedManagedIdentity(client_id=identity))
        self._what = f"managed identity {identity}"
        self._resource = scope.removesuffix("/.default")
        # a client per fetch: its token cache would hand back a token the smarthost refused
        self._client = functools.partial(
            msal.ManagedIdentityClient, which,
            http_client=TokenSession(timeout_s, str(ca_file) if ca_file else True,
                                     link_local=True))
        self._timeout_s = timeout_s

    async def fetch(self) -> tuple[str, float]:
        def call() -> tuple[str, float]:
            return _msal_token(self._client().acquire_token_for_client(
                resource=self._resource), self._what)
        return await _in_thread(call, self._what, timeout_s=self._timeout_s)


def load_service_account(path: Path) -> dict[str, Any]:
    """The JSON key of a Google service account (``type`` ``service_account``, with
    ``client_email``, ``private_key`` and ``token_uri``). Raises ValueError naming what is
    wrong (never the key), OSError when unreadable."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path}: not JSON") from None
    if not isinstance(info, dict) or info.get("type") != "service_account":
        raise ValueError(f"{path}: not a service account key (type service_account)")
    missing = [k for k in ("client_email", "private_key", "token_uri") if not info.get(k)]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)}")
    why = endpoint_refusal(str(info["token_uri"]))
    if why is not None:
        raise ValueError(f"{path}: token_uri {printable_excerpt(str(info['token_uri']))}: "
                         f"{why}: the signed assertion would cross it")
    from google.oauth2 import service_account
    try:
        service_account.Credentials.from_service_account_info(info)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: its private key does not load ({type(exc).__name__})"
                         ) from None
    return info


class GoogleServiceAccount:
    """:class:`relay.upstream.oauth.TokenSource` of a Google service account's key
    (google-auth), the token for ``subject`` (the mailbox: domain-wide delegation)."""

    def __init__(self, *, info: Mapping[str, Any], subject: str, scope: str,
                 ca_file: Path | None = None, timeout_s: float = 30.0) -> None:
        from google.auth.exceptions import TransportError
        from google.auth.transport.requests import Request
        from google.oauth2 import service_account

        self._what = f"service account {info.get('client_email')} for {subject}"
        self._credentials = service_account.Credentials.from_service_account_info(
            dict(info), scopes=[scope], subject=subject)
        self._request = Request(session=TokenSession(timeout_s,
                                                     str(ca_file) if ca_file else True))
        self._now: Callable[[], datetime.datetime] = functools.partial(
            datetime.datetime.now, datetime.UTC)
        self._unreachable: tuple[type[Exception], ...] = (TransportError,)
        self._timeout_s = timeout_s

    async def fetch(self) -> tuple[str, float]:
        def call() -> tuple[str, float]:
            self._credentials.refresh(self._request)
            token, expiry = self._credentials.token, self._credentials.expiry
            if not token:
                raise TokenError("token endpoint reply malformed", kind="malformed")
            if expiry is None:
                return token, 300.0
            ends = expiry.replace(tzinfo=datetime.UTC)  # google-auth: naive UTC
            return token, max(1.0, (ends - self._now()).total_seconds())
        return await _in_thread(call, self._what, timeout_s=self._timeout_s,
                                unreachable=self._unreachable)
