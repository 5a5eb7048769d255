"""Text for the operator's terminal: :func:`shown`, the one escape every CLI printer of text a
client or a smarthost controls goes through (a Message-ID, a recipient, an upstream's reply
or queue id, read back from the audit ledger or the store). The rule itself (which characters,
and how they are shown) is :func:`relay.core.escape.escaped`.
"""

from __future__ import annotations

from relay.core.escape import escaped


def shown(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1) and lone surrogate escaped as
    ``\\xNN`` / ``\\uNNNN`` (:func:`relay.core.escape.escaped`): safe to print on a
    terminal, one line."""
    return escaped(text)


def shown_lines(text: str) -> str:
    """``text`` as :func:`shown` prints it, its line breaks kept (a message of several
    lines)."""
    return "\n".join(escaped(line) for line in text.split("\n"))
