"""The body of a console POST: :func:`form_of`.

Every form of the console is sent as ``application/x-www-form-urlencoded`` (the HTML default:
its pages post no files). Any other body, or one that does not decode (bytes that are no
UTF-8), is refused ``400`` with one INFO line of ``relay.console`` naming the peer, the path
and why: a client's malformed request is its fault, not the relay's (no ERROR, no traceback).
"""

from __future__ import annotations

import logging
from typing import NoReturn, cast

from aiohttp import web
from multidict import MultiDictProxy

from relay.console.errors import ConsoleError

log = logging.getLogger("relay.console")

FORM_TYPE = "application/x-www-form-urlencoded"


async def form_of(request: web.Request) -> MultiDictProxy[str]:
    """The fields of ``request``'s form (its body read already, at most the app's
    ``client_max_size``), each a text. Raises :class:`ConsoleError` (400) for a body of
    another content type or one that does not decode."""
    if request.content_type != FORM_TYPE:
        _refuse(request, f"the body is {request.content_type}, not {FORM_TYPE}")
    try:
        form = await request.post()
    except ValueError as exc:  # UnicodeDecodeError is one
        _refuse(request, f"the form does not decode ({type(exc).__name__})")
    return cast("MultiDictProxy[str]", form)  # urlencoded: every value is a text


def _refuse(request: web.Request, why: str) -> NoReturn:
    log.info("console request refused: %s", why,
             extra={"peer": request.remote, "path": request.path, "status": 400})
    raise ConsoleError(400, "This request is no form of this console's pages: open the page "
                            "again.")
