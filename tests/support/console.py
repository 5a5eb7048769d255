"""The console's parts in the tests: a relay serving it, a users file (bcrypt at the lowest
cost, so a sign-in costs milliseconds), a signed-in HTTP client, and the CSRF token a page's
form carries."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import bcrypt

from relay.app import Relay
from relay.credentials import format_entry
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

VIEWER, VIEWER_PASSWORD = "vera", "viewer-pw-1"
OPERATOR, OPERATOR_PASSWORD = "otto", "operator-pw-1"

_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def users_file(folder: Path) -> Path:
    """A console users file with a viewer and an operator."""
    path = folder / "console-users"
    lines = [format_entry(user, bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode(),
                          role)
             for user, password, role in ((VIEWER, VIEWER_PASSWORD, "viewer"),
                                          (OPERATOR, OPERATOR_PASSWORD, "operator"))]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def csrf_of(page: str) -> str:
    """The CSRF token of the first form on ``page``."""
    found = _CSRF.search(page)
    assert found is not None, page[:2000]
    return found.group(1)


@dataclass
class Browser:
    """An HTTP client with its own cookies (a browser without JavaScript), on ``base``."""

    base: str
    http: aiohttp.ClientSession

    async def get(self, path: str) -> tuple[int, str, aiohttp.ClientResponse]:
        async with self.http.get(self.base + path, allow_redirects=False) as response:
            return response.status, await response.text(), response

    async def post(self, path: str, form: dict[str, str]
                   ) -> tuple[int, str, aiohttp.ClientResponse]:
        async with self.http.post(self.base + path, data=form,
                                  allow_redirects=False) as response:
            return response.status, await response.text(), response

    async def sign_in(self, user: str, password: str, next_path: str = "/history"
                      ) -> tuple[int, str, aiohttp.ClientResponse]:
        """Open the sign-in page (its cookie and token), then post the form."""
        _, page, _ = await self.get("/login")
        return await self.post("/login", {"csrf": csrf_of(page), "user": user,
                                          "password": password, "next": next_path})


def browser(base: str, **session: object) -> Browser:
    """A :class:`Browser` keeping cookies of an IP host (``unsafe``), Secure ones too."""
    jar = aiohttp.CookieJar(unsafe=True)
    return Browser(base, aiohttp.ClientSession(cookie_jar=jar, **session))  # type: ignore[arg-type]


async def console_relay(make_relay: MakeRelay, sink: Sink, tmp_path: Path,
                        **extra: Any) -> Relay:
    """A relay serving the console on a free loopback port (failure delay 0.2 s)."""
    values: dict[str, Any] = {
        "upstream": f"127.0.0.1:{sink.port}", "upstream_timeout": 0.6,
        "console_listen": "127.0.0.1:0", "console_auth_file": users_file(tmp_path),
        "auth_failure_delay": 0.2, **extra}
    return await make_relay(**values)


def opened(web: list[Browser], relay: Relay, scheme: str = "http", **session: object
           ) -> Browser:
    """A :class:`Browser` on ``relay``'s console, closed with the test's ``web`` list."""
    assert relay.console is not None
    b = browser(f"{scheme}://127.0.0.1:{relay.console.port}", **session)
    web.append(b)
    return b
