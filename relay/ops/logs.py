"""Logging: JSON lines (python-json-logger) or plain text.

Logs never hold message bodies or secrets; recipients are masked unless ``log_recipients``
(design.md §6.4): the decision line masks its own fields, and every other line has the
addresses in its message and its string fields masked by :class:`_MaskAddresses` (an
upstream's reply quotes recipients: ``450 4.2.0 <jane.roe@example.net>: greylisted``).
Structured fields go in ``extra=``; the JSON formatter writes them as keys, the text
formatter appends them as ``key=value``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from datetime import UTC, datetime
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from relay.core.address import mask_addresses_in

# attributes every LogRecord has; anything else on a record came from ``extra=``
_STANDARD = frozenset(vars(logging.LogRecord("n", 0, "p", 0, "m", None, None))) | {
    "message", "asctime", "taskName"}


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def rfc3339(created: float) -> str:
    """``created`` (unix seconds) as an RFC 3339 UTC time with milliseconds
    (``2026-12-05T07:01:28.123Z``): lines hundreds of which share a second stay in order."""
    stamp = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds")
    return stamp.removesuffix("+00:00") + "Z"


class JsonLines(JsonFormatter):
    """One JSON object per record, its ``time`` in RFC 3339 with milliseconds."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """:func:`rfc3339` of the record's time."""
        return rfc3339(record.created)


def json_lines() -> JsonLines:
    """The relay's JSON formatter: ``time``, ``level``, ``logger``, ``message``, then the
    record's structured fields."""
    return JsonLines("{asctime}{levelname}{name}{message}", style="{",
                     rename_fields={"asctime": "time", "levelname": "level", "name": "logger"})


class TextFormatter(logging.Formatter):
    """``time level logger message key=value ...`` with the record's extra fields, the time in
    RFC 3339 with milliseconds."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """:func:`rfc3339` of the record's time."""
        return rfc3339(record.created)

    def format(self, record: logging.LogRecord) -> str:
        """Format ``record`` and append its ``extra=`` fields."""
        line = super().format(record)
        extras: dict[str, Any] = {
            k: v for k, v in vars(record).items() if k not in _STANDARD}
        if extras:
            line += " " + " ".join(f"{k}={v!r}" for k, v in extras.items())
        # one record, one line: client bytes (CR, LF, NUL) cannot forge log lines
        return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", line)


def setup_logging(level: str, fmt: str = "json", *, worker: int | None = None,
                  mask_addresses: bool = True) -> None:
    """Send the relay's logs to stderr, one line per record, at ``level``.

    ``fmt`` is ``json`` (one JSON object per line: time, level, logger, message and the
    structured fields) or ``text``. ``worker``: the index of a worker process (``workers`` >
    1); every line then has the fields ``worker`` (the index) and ``pid``.
    ``mask_addresses`` (``log_recipients`` off) masks every address in every line.
    """
    handler = logging.StreamHandler(sys.stderr)
    if worker is not None:
        handler.addFilter(_WorkerFields(worker))
    if mask_addresses:
        handler.addFilter(_MaskAddresses())
    if fmt == "json":
        handler.setFormatter(json_lines())
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


# fields whose value only looks like an address: a Message-ID is ``<id@host>`` (RFC 5322
# section 3.6.4), and an operator looks it up as it is
_UNMASKED_FIELDS = frozenset({"message_id"})


class _MaskAddresses(logging.Filter):
    """Masks the addresses in a record's message and in its ``extra=`` fields (strings, and
    the keys and strings of dicts and lists in them), :func:`mask_addresses_in`; fields named
    in :data:`_UNMASKED_FIELDS` are left as they are."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_addresses_in(message)
        if masked != message:
            record.msg, record.args = masked, None
        for name, value in list(vars(record).items()):
            if name not in _STANDARD and name not in _UNMASKED_FIELDS:
                setattr(record, name, _masked(value))
        return True


def _masked(value: Any) -> Any:
    """``value`` with the addresses in its strings masked (dicts and lists walked)."""
    if isinstance(value, str):
        return mask_addresses_in(value)
    if isinstance(value, dict):
        return {_masked(k): _masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_masked(v) for v in value)
    return value


def _drop_login_data_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Session.login_data is deprecated")
