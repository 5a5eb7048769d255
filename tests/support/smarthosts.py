"""Private smarthosts whose own logs are the reconciler's evidence: a Postfix and an Exim on
loopback that accept every message (and drop it) and refuse at end of data any message
carrying the header :data:`REFUSE_HEADER` (Postfix: a ``header_checks`` REJECT; Exim: an
``acl_smtp_data`` deny). Postfix needs root and Debian's postfix (tests/support/postfix.py);
Exim is unpacked privately (tests/support/exim.py)."""

from __future__ import annotations

import shutil
import smtplib
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support import exim, postfix

REFUSE_HEADER = exim.REFUSE_HEADER
POSTFIX_REFUSAL_TEXT = "refused by the test smarthost"


def postfix_refusing(folder: Path, refusal: str = POSTFIX_REFUSAL_TEXT) -> str:
    """main.cf lines (the ``relaying`` of :func:`tests.support.postfix.private_postfix`):
    every message discarded after it is queued, a header :data:`REFUSE_HEADER` REJECTed by
    cleanup's header_checks (written to ``folder``)."""
    checks = folder / "header_checks"
    checks.write_text(f"/^{REFUSE_HEADER}:/ REJECT {refusal}\n")
    return (f"header_checks = regexp:{checks}\n"
            "default_transport = discard:\nrelay_transport = discard:\n")


@contextmanager
def reachable_folder(prefix: str) -> Iterator[Path]:
    """A temporary folder the smarthosts' unprivileged daemons can reach (pytest's own are
    0700), removed at the end."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def postfix_smarthost(folder: Path, port: int) -> Iterator[Path]:
    """A refusing Postfix on 127.0.0.1:``port``; yields its mail log (``maillog_file``)."""
    folder.mkdir(parents=True, exist_ok=True)
    checks = folder / "checks"
    checks.mkdir(exist_ok=True)
    checks.chmod(0o755)
    with postfix.private_postfix(folder / "postfix", port, postfix_refusing(checks)):
        yield folder / "postfix" / "maillog"


def send(port: int, data: bytes) -> tuple[int, bytes]:
    """Send ``data`` (a whole message, CRLF lines) from app@example.com to
    user@example.net through 127.0.0.1:``port``; the reply to the final dot."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as client:
        client.ehlo("app.test")
        client.mail("app@example.com")
        client.rcpt("user@example.net")
        try:
            return client.data(data)
        except smtplib.SMTPDataError as refused:
            error = refused.smtp_error
            return refused.smtp_code, error.encode() if isinstance(error, str) else error


def postfix_logrotate(maillog: Path) -> None:
    """``postfix logrotate`` of the instance whose log is ``maillog``: renamed with a
    ``.YYYYMMDD-HHMMSS`` suffix, compressed to ``.gz``, a new file begun."""
    subprocess.run([postfix.POSTFIX, "-c", str(maillog.parent / "etc"), "logrotate"],
                   check=True, timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
