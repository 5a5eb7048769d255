"""The timestamps at the start of a mail log's lines, as unix seconds.

- traditional syslog, ``Dec  7 21:03:04`` (or ``Dec 07``, Postfix's own ``maillog_file``):
  local time, no year: the year that puts it nearest to now, not later than a day ahead
  (RFC 3164 section 4.1.2);
- RFC 3339, ``2026-12-07T21:03:04.123456+00:00`` (rsyslog's and syslog-ng's ISO format,
  journald exports): its own offset;
- Exim's ``2026-12-07 21:03:04`` (with ``.123`` under ``log_selector = +millisec`` and
  `` +0100`` under ``log_timezone = true``): local time unless an offset follows.
"""

from __future__ import annotations

import calendar
import functools
import re
import time
from datetime import datetime

_MONTHS = {name: number for number, name in enumerate(
    ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), 1)}
_SYSLOG = re.compile(r"([A-Z][a-z]{2}) ([ \d]\d) (\d\d):(\d\d):(\d\d)(\.\d+)? ")
_RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d) ")
_EXIM = re.compile(r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(\.\d+)?(?: ([+-])(\d\d)(\d\d))? ")
_DAY = 86400.0


class SyslogClock:
    """Parses syslog timestamps (either form); ``now`` is read once per instance: make one
    per batch of lines. Local-time conversions are cached per hour of the day."""

    def __init__(self, now: float | None = None) -> None:
        self._now = time.time() if now is None else now
        self._hours: dict[tuple[str, str, str], float | None] = {}

    def parse(self, line: str) -> tuple[float, int] | None:
        """(unix seconds, length of the timestamp and the space after it), or None when the
        line starts with neither form."""
        if line[:1].isdigit():
            match = _RFC3339.match(line)
            if match is None:
                return None
            text = match.group(0)[:-1].replace("Z", "+00:00")
            try:
                return datetime.fromisoformat(text).timestamp(), match.end()
            except ValueError:
                return None
        match = _SYSLOG.match(line)
        if match is None:
            return None
        month, day, hour, minute, second, fraction = match.groups()
        start = self._hour(month, day, hour)
        if start is None:
            return None
        return start + int(minute) * 60 + int(second) + float(fraction or 0), match.end()

    def _hour(self, month: str, day: str, hour: str) -> float | None:
        key = (month, day, hour)
        if key not in self._hours:
            self._hours[key] = self._nearest_year(month, int(day), int(hour))
        return self._hours[key]

    def _nearest_year(self, month: str, day: int, hour: int) -> float | None:
        number = _MONTHS.get(month)
        if number is None:
            return None
        year = time.localtime(self._now).tm_year
        fits = []
        for candidate in (year + 1, year, year - 1):
            try:
                stamp = time.mktime((candidate, number, day, hour, 0, 0, 0, 0, -1))
            except (OverflowError, ValueError):
                continue
            # mktime normalises Feb 29 of a common year to Mar 1: not that date
            if time.localtime(stamp).tm_mday != day:
                continue
            if stamp <= self._now + _DAY:
                fits.append(stamp)
        return max(fits) if fits else None


def exim_stamp(line: str) -> tuple[float, int] | None:
    """(unix seconds, length of the timestamp and the space after it) of an Exim log line,
    or None when the line does not start with one."""
    match = _EXIM.match(line)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, sign, off_h, off_m = match.groups()
    if sign is None:
        start = _local_hour(year, month, day, hour)
    else:
        start = _utc_hour(year, month, day, hour)
        offset = (int(off_h) * 3600 + int(off_m) * 60) * (1 if sign == "+" else -1)
        start = None if start is None else start - offset
    if start is None:
        return None
    return start + int(minute) * 60 + int(second) + float(fraction or 0), match.end()


@functools.lru_cache(maxsize=256)
def _local_hour(year: str, month: str, day: str, hour: str) -> float | None:
    """The unix seconds of that hour's start in local time (cached: one call a log hour)."""
    try:
        return time.mktime((int(year), int(month), int(day), int(hour), 0, 0, 0, 0, -1))
    except (OverflowError, ValueError):
        return None


def _utc_hour(year: str, month: str, day: str, hour: str) -> float | None:
    try:
        return float(calendar.timegm((int(year), int(month), int(day), int(hour), 0, 0, 0, 0, 0)))
    except (OverflowError, ValueError):
        return None
