"""The console's users file read again on reload, over real HTTP against an in-process relay:
the sessions of a user whose line changed (a new password hash, another role) end, those of
a user whose line stayed go on."""

from __future__ import annotations

from pathlib import Path

import bcrypt
import pytest

from relay.credentials import format_entry
from tests.support.console import (
    OPERATOR,
    OPERATOR_PASSWORD,
    VIEWER,
    VIEWER_PASSWORD,
    Browser,
    console_relay,
    opened,
)
from tests.support.relays import MakeRelay
from tests.support.sink import Sink

pytestmark = pytest.mark.timeout(60)


def line_of(path: Path, user: str) -> str:
    return next(line for line in path.read_text().splitlines() if line.startswith(user + ":"))


def new_line(user: str, password: str, role: str) -> str:
    return format_entry(user, bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode(),
                        role)


@pytest.mark.parametrize("change", ["password", "role"])
async def test_a_reload_ends_the_sessions_of_a_user_whose_line_changed(
        make_relay: MakeRelay, sink: Sink, tmp_path: Path, web: list[Browser],
        change: str) -> None:
    """The viewer's line gets a new password (or the operator role) and the file is read
    again: the viewer's session ends (its next page is the sign-in), the operator's, whose
    line is the same, goes on; the viewer signs in again with the line's password."""
    relay = await console_relay(make_relay, sink, tmp_path)
    users = relay.settings.console_auth_file
    assert users is not None
    viewer, operator = opened(web, relay), opened(web, relay)
    assert (await viewer.sign_in(VIEWER, VIEWER_PASSWORD))[0] == 303
    assert (await operator.sign_in(OPERATOR, OPERATOR_PASSWORD))[0] == 303
    password = "a-new-password-2" if change == "password" else VIEWER_PASSWORD
    role = "operator" if change == "role" else "viewer"
    users.write_text(new_line(VIEWER, password, role) + "\n" + line_of(users, OPERATOR) + "\n")
    await relay.apply(relay.settings, frozenset({"console_auth_file"}))
    status, _, response = await viewer.get("/history")
    assert status == 302 and response.headers["Location"].startswith("/login")
    assert (await operator.get("/history"))[0] == 200
    assert (await viewer.sign_in(VIEWER, password))[0] == 303
    assert (await viewer.get("/history"))[0] == 200
