"""Writes the sample smarthost logs of tests/reconcile/logs/ from a real private Postfix and
a real private Exim (tests/support/smarthosts.py; root, Debian's postfix, apt for Exim):

    .venv/bin/python tools/reconcile_log_samples.py

Each smarthost is sent the messages of :data:`CASES` (Message-ID first or after other
headers, folded, absent, reused; refused at end of data by the header X-Test-Refuse above
or below the Message-ID), then its logs are copied: ``postfix-maillog.log`` (Postfix's own
``maillog_file``: ``Dec 07 21:04:41``), ``exim-mainlog.log`` and ``exim-rejectlog.log``.
``postfix-syslog.log`` and ``postfix-rfc3339.log`` are the same Postfix lines with the
timestamp written as a traditional syslog daemon (``Dec  7``) and as rsyslog's
RSYSLOG_FileFormat (RFC 3339, microseconds, offset) write it: this Postfix (3.7) writes only
the first form itself.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path

from tests.support import exim, smarthosts
from tests.support.net import free_port

LOGS = Path(__file__).resolve().parents[1] / "tests" / "reconcile" / "logs"
REFUSE = f"{smarthosts.REFUSE_HEADER}: yes\r\n"
# (what the case is, the headers above the blank line)
CASES = [
    ("accepted, Message-ID first",
     "Message-ID: <first@app.test>\r\nFrom: app@example.com\r\nSubject: one\r\n"),
    ("accepted, Message-ID after other headers",
     "From: app@example.com\r\nSubject: two\r\nMessage-ID: <after@app.test>\r\n"),
    ("accepted, folded Message-ID",
     "From: app@example.com\r\nMessage-ID:\r\n <folded@app.test>\r\nSubject: three\r\n"),
    ("accepted, no Message-ID", "From: app@example.com\r\nSubject: no id\r\n"),
    ("refused, the refused header below the Message-ID",
     f"Message-ID: <refused-below@app.test>\r\nFrom: app@example.com\r\n{REFUSE}"),
    ("refused, the refused header above the Message-ID",
     f"From: app@example.com\r\n{REFUSE}Message-ID: <refused-above@app.test>\r\n"),
    ("refused, folded Message-ID",
     f"{REFUSE}Message-ID:\r\n <refused-folded@app.test>\r\nSubject: four\r\n"),
    ("accepted, one Message-ID used twice (first)", "Message-ID: <reused@app.test>\r\n"),
    ("accepted, one Message-ID used twice (second)", "Message-ID: <reused@app.test>\r\n"),
]


def send_all(port: int) -> None:
    for what, headers in CASES:
        code, reply = smarthosts.send(port, f"{headers}\r\nbody\r\n".encode())
        print(f"  {what}: {code} {reply.decode(errors='replace')}", file=sys.stderr)
        time.sleep(1.1)  # one second apart: the reused ID's two acceptances differ in stamp


def wait_for(path: Path, text: str) -> None:
    for _ in range(200):
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{path} never logged {text!r}")


def rewritten(line: str, fmt: str) -> str:
    """``line`` (Postfix's ``Dec 07 21:04:41 host ...``) with its stamp in the form ``fmt``
    (``syslog`` or ``rfc3339``), the year the current one."""
    stamp = datetime.strptime(f"{datetime.now().year} {line[:15]}", "%Y %b %d %H:%M:%S")
    rest = line[16:]
    if fmt == "syslog":
        return f"{stamp:%b} {stamp.day:2d} {stamp:%H:%M:%S} {rest}"
    local = stamp.astimezone()
    return f"{local.isoformat(timespec='microseconds')} {rest}"


def main() -> None:
    LOGS.mkdir(parents=True, exist_ok=True)
    with smarthosts.reachable_folder("reconcile-samples-") as folder:
        port = free_port()
        with smarthosts.postfix_smarthost(folder / "postfix", port) as maillog:
            send_all(port)
            wait_for(maillog, "reused@app.test")
            time.sleep(2)
            lines = maillog.read_text().splitlines()
        (LOGS / "postfix-maillog.log").write_text("\n".join(lines) + "\n")
        for fmt in ("syslog", "rfc3339"):
            (LOGS / f"postfix-{fmt}.log").write_text(
                "\n".join(rewritten(line, fmt) for line in lines) + "\n")
        port = free_port()
        with exim.private_exim(folder / "exim", port) as instance:
            send_all(port)
            wait_for(instance.main_log, "reused@app.test")
            time.sleep(1)
            (LOGS / "exim-mainlog.log").write_text(instance.main_log.read_text())
            (LOGS / "exim-rejectlog.log").write_text(instance.reject_log.read_text())


if __name__ == "__main__":
    main()
