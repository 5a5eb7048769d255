"""The one HTTP session every request of the msal and google-auth token sources goes through
(the token endpoint, msal's OpenID discovery document, a managed identity's endpoint): the
libraries take a ``requests.Session`` (msal's ``http_client``, google-auth's
``transport.requests.Request(session)``), and :class:`TokenSession` is the relay's, holding
them to the generic grant's rules whatever the library asks for:

- no redirect is followed (``allow_redirects`` forced off, ``max_redirects`` 0 for a session
  msal copies it into): a ``3xx`` is a :class:`relay.upstream.oauth.TokenError` ``redirected``,
  so a client secret or a signed assertion is never sent again elsewhere;
- nothing is sent to an endpoint :func:`relay.core.http_rules.endpoint_refusal` refuses
  (``not_https``: plain http only to loopback, and to a link-local address for a managed
  identity, whose metadata service is plain http by design);
- a reply is read streamed, within :data:`relay.upstream.oauth.MAX_TOKEN_REPLY_BYTES`: its
  ``Content-Length`` first, then at most one byte more (``too_large``); compression is not
  asked for;
- every request has the relay's timeout and CA bundle (requests has no timeout by default,
  google-auth asks for 120 s, msal verifies against the system's CAs).

The reply is read by a response hook (:func:`bounded_reply`), so a session msal derives from
this one (Service Fabric's, which copies its hooks) reads within the bound too.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import requests

from relay.core.http_rules import ReplyTooLarge, endpoint_refusal, printable_excerpt, read_bounded
from relay.upstream.oauth import MAX_TOKEN_REPLY_BYTES, TokenError

log = logging.getLogger("relay.upstream.oauth")


class TokenSession(requests.Session):
    """A requests session for token requests (see the module docstring): ``timeout_s``
    seconds for each request's connect and each read, TLS verified against ``verify`` (a CA
    file's path, or True: the system's CAs); ``link_local``: plain http to a link-local
    address is allowed (an Azure managed identity's metadata service)."""

    def __init__(self, timeout_s: float, verify: str | bool, *,
                 link_local: bool = False) -> None:
        super().__init__()
        self._timeout_s = timeout_s
        self._link_local = link_local
        self.verify = verify
        self.max_redirects = 0
        # a token is fetched about once an hour: no idle connection kept to the endpoint; an
        # uncompressed reply, so its Content-Length is its size
        self.headers["Connection"] = "close"
        self.headers["Accept-Encoding"] = "identity"
        self.hooks["response"].append(bounded_reply)

    def request(self, method: Any, url: Any, *args: Any, **kwargs: Any
                ) -> requests.Response:
        # the libraries pass their own (google-auth: 120 s, msal: its own): ours wins, as the
        # CA file does over msal's verify=True
        kwargs["timeout"] = self._timeout_s
        kwargs["verify"] = self.verify
        return super().request(method, url, *args, **kwargs)

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:
        """Send ``request`` unless its URL is refused (TokenError ``not_https``, nothing
        sent); never following a redirect, the reply streamed to :func:`bounded_reply`."""
        url = request.url or ""
        why = endpoint_refusal(url, link_local=self._link_local)
        if why is not None:
            log.error("OAuth2: %s not asked: %s", printable_excerpt(url), why)
            raise TokenError("token endpoint not https", kind="not_https")
        kwargs["allow_redirects"] = False
        kwargs["stream"] = True
        return super().send(request, **kwargs)


def bounded_reply(response: requests.Response, **_: Any) -> requests.Response:
    """A requests response hook: read ``response``'s body within
    :data:`MAX_TOKEN_REPLY_BYTES` and let the connection go. Raises TokenError
    ``redirected`` for a 3xx, ``too_large`` for a longer reply (read no further)."""
    try:
        if 300 <= response.status_code < 400:
            log.error("OAuth2: %s answered HTTP %d (a redirect to %s): not followed",
                      printable_excerpt(response.url), response.status_code,
                      printable_excerpt(response.headers.get("Location", "nowhere")))
            raise TokenError(f"token endpoint redirected, HTTP {response.status_code}",
                             kind="redirected")
        length = response.headers.get("Content-Length", "")
        body = read_bounded(functools.partial(response.raw.read, decode_content=True),
                            limit=MAX_TOKEN_REPLY_BYTES,
                            declared=int(length) if length.isdigit() else None)
    except ReplyTooLarge as exc:
        log.error("OAuth2: %s: %s", printable_excerpt(response.url), exc)
        raise TokenError("token endpoint reply too large", kind="too_large") from None
    finally:
        response.close()
    response._content = body  # what .content, .text and .json() give
    return response
