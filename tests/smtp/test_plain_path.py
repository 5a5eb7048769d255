"""relay.smtp.session.plain_path: the plain MAIL/RCPT path is read without aiosmtpd's
email-header parse, with the very result that parse gives (else it is left to it)."""

from __future__ import annotations

from typing import Any

from aiosmtpd.smtp import SMTP
from hypothesis import example, given, settings
from hypothesis import strategies as st

from relay.smtp.session import RelaySMTP, plain_path

_ATEXT = "A-Za-z0-9!#$%&'*+\\-/=?^_`{|}~"
_PLAIN = rf"<[{_ATEXT}]+(\.[{_ATEXT}]+)*@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*>"
# the characters a path's syntax turns on, a few letters, a blank, a tab and non-ASCII
_PIECES = st.text(alphabet='<>@.,:;"\\()[] \tab-Z9é\u2003=', max_size=30)


def _aiosmtpd(arg: str) -> Any:
    """aiosmtpd's parse, or the type of what it raises (a bare ``"`` breaks the header
    parser: the listener never hands it a path without brackets)."""
    try:
        return SMTP._getaddr(SMTP.__new__(SMTP), arg)
    except Exception as exc:
        return type(exc)


def _relay(arg: str) -> Any:
    try:
        return RelaySMTP._getaddr(RelaySMTP.__new__(RelaySMTP), arg)
    except Exception as exc:
        return type(exc)


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.builds(lambda p, r: p + r, st.from_regex(_PLAIN, fullmatch=True), _PIECES),
    st.builds(lambda a, p, r: a + p + r, _PIECES, st.from_regex(_PLAIN, fullmatch=True),
              _PIECES),
    _PIECES))
@example("<a@b> (comment) SIZE=1")
@example("<a@b>\t SIZE=1 BODY=8BITMIME")
@example("<a@b>x")
@example('<"a"@b>')
@example("<@r.example:a@b>")
@example("<>")
@example("<a..b@c>")
def test_the_relay_reads_every_path_as_aiosmtpd_does(arg: str) -> None:
    """Plain or not, with parameters, comments, quotes or junk: the same (address, rest)."""
    assert _relay(arg) == _aiosmtpd(arg)
    plain = plain_path(arg)
    assert plain is None or plain == _aiosmtpd(arg)


def test_the_usual_paths_are_plain() -> None:
    """The forms applications send take the short way; quoted, routed, commented do not."""
    assert plain_path("<user.name+tag@mail.example.net> SIZE=2048") == (
        "user.name+tag@mail.example.net", "SIZE=2048")
    assert plain_path("<app@example.com>") == ("app@example.com", "")
    for other in ('<"a b"@x.example>', "<@relay.example:a@x.example>", "<>",
                  "<a@x.example> (c)", "<a@[192.0.2.1]>", "<jö@x.example>"):
        assert plain_path(other) is None, other
