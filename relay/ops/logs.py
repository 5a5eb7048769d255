"""Logging: JSON lines (python-json-logger) or plain text.

Logs never hold message bodies or secrets; recipients are masked unless ``log_recipients``
(design.md §6.4). Structured fields go in ``extra=``; the JSON formatter writes them as keys,
the text formatter appends them as ``key=value``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

from pythonjsonlogger.json import JsonFormatter

# attributes every LogRecord has; anything else on a record came from ``extra=``
_STANDARD = frozenset(vars(logging.LogRecord("n", 0, "p", 0, "m", None, None))) | {
    "message", "asctime", "taskName"}


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class TextFormatter(logging.Formatter):
    """``time level logger message key=value ...`` with the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Format ``record`` and append its ``extra=`` fields."""
        line = super().format(record)
        extras: dict[str, Any] = {
            k: v for k, v in vars(record).items() if k not in _STANDARD}
        if extras:
            line += " " + " ".join(f"{k}={v!r}" for k, v in extras.items())
        # one record, one line: client bytes (CR, LF, NUL) cannot forge log lines
        return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", line)


def setup_logging(level: str, fmt: str = "json", *, worker: int | None = None) -> None:
    """Send the relay's logs to stderr, one line per record, at ``level``.

    ``fmt`` is ``json`` (one JSON object per line: time, level, logger, message and the
    structured fields) or ``text``. ``worker``: the index of a worker process (``workers`` >
    1); every line then has the fields ``worker`` (the index) and ``pid``.
    """
    handler = logging.StreamHandler(sys.stderr)
    if worker is not None:
        handler.addFilter(_WorkerFields(worker))
    if fmt == "json":
        handler.setFormatter(JsonFormatter(
            "{asctime}{levelname}{name}{message}", style="{", datefmt="%Y-%m-%dT%H:%M:%S%z",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiosmtpd logs every command line at INFO, recipients included: keep it at WARNING
    aiosmtpd_log = logging.getLogger("mail.log")
    aiosmtpd_log.setLevel(max(logging.WARNING, root.level))
    # ...and warns on every successful AUTH that a field it sets itself is deprecated
    aiosmtpd_log.addFilter(_drop_login_data_warning)


def set_level(level: str) -> None:
    """Log at ``level`` from now on (a configuration reload): the root logger, and aiosmtpd's
    kept at WARNING or above as :func:`setup_logging` does."""
    root = logging.getLogger()
    root.setLevel(level)
    logging.getLogger("mail.log").setLevel(max(logging.WARNING, root.level))


class _WorkerFields(logging.Filter):
    """Adds ``worker`` (the worker's index) and ``pid`` to every record."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self._index = index
        self._pid = os.getpid()

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self._index
        record.pid = self._pid
        return True


def _drop_login_data_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Session.login_data is deprecated")
