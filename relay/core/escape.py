"""Text a peer controls, made safe to show: :func:`escaped`, the one rule every printer of
such text goes through (the CLI's lines, :func:`relay.cli.terminal.shown`; a peer's text in
a log line, :func:`relay.core.http_rules.printable_excerpt`).

A terminal obeys control characters: ESC starts sequences that clear the screen, set the
window title, write the clipboard (OSC 52) or plant links (OSC 8); BEL, BS and CR hide or
rewrite what was printed before them. So every C0 control (U+0000 to U+001F), DEL (U+007F)
and C1 control (U+0080 to U+009F, ECMA-48 section 5), and every lone surrogate (bytes that
were no UTF-8), is shown as a visible escape (``\\x1b``, ``\\udcff``); every other
character, any printable UTF-8 text, is shown as it is.
"""

from __future__ import annotations

import re

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escaped(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1) and lone surrogate escaped as
    ``\\xNN`` / ``\\uNNNN``: safe to print on a terminal or in a log line, one line."""
    return _UNSAFE.sub(_escape, text)
