"""relay.smtp.data.has_bare_cr_or_lf: counting CRs, LFs and CRLFs finds exactly what the
regular expression of a bare CR or LF finds (RFC 5321 section 2.3.8)."""

from __future__ import annotations

import re

from hypothesis import example, given, settings
from hypothesis import strategies as st

from relay.smtp.data import has_bare_cr_or_lf

_BARE = re.compile(rb"\r(?!\n)|(?<!\r)\n")


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from([b"\r", b"\n", b"\r\n", b"a", b"\n\r", b"\r\r\n"]),
                max_size=12).map(b"".join))
@example(b"")
@example(b"a\r\nb\r\n")
@example(b"a\rb")
@example(b"a\nb")
@example(b"\n\r")
def test_counting_finds_what_the_regex_finds(content: bytes) -> None:
    assert has_bare_cr_or_lf(content) is (_BARE.search(content) is not None)
