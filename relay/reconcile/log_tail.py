"""Reading a growing, rotated log file incrementally: each :meth:`LogTail.read` returns the
complete lines appended since the previous one, never the whole history again.

The file is followed by its open descriptor, so a rotation (``PATH`` renamed to ``PATH.1``,
then compressed to ``PATH.1.gz`` and removed) loses nothing: the renamed file is finished
through the descriptor held, then the new ``PATH`` is read from its start. A file truncated in
place (logrotate's ``copytruncate``) is finished from its copy ``PATH.1`` when that copy starts
as the file did, then read again from 0. A line without its newline yet is kept until the rest
arrives. At the first read the newest rotated copy present (:func:`rotated_history`) is
read once before ``PATH``.
Blocking (file I/O): callers run it in a thread. Raises OSError when ``PATH`` cannot be read
and no descriptor is held."""

from __future__ import annotations

import glob
import gzip
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from io import BufferedIOBase
from pathlib import Path

# bytes read per call to read(): a first read of a large history goes in steps of this size
_CHUNK = 1 << 20
# the bytes of a file's start that tell it apart from another file (its first line, mostly)
_HEAD = 256
# logrotate's dateext (-YYYYMMDD, -YYYYMMDDHH) and "postfix logrotate" (.YYYYMMDD-HHMMSS)
_DATED = re.compile(r"[.-]\d{8}(?:-?\d{2,6})?(?:\.gz)?$")


def rotated_history(path: Path) -> Path | None:
    """The newest rotated copy of ``path`` present, or None: ``PATH.1``, ``PATH.1.gz``
    (logrotate), ``PATH.01``/``PATH.01.gz`` (Exim's exicyclog), ``PATH-YYYYMMDD[.gz]``
    (logrotate's dateext), ``PATH.YYYYMMDD-HHMMSS[.gz]`` (``postfix logrotate``); the one
    modified last wins."""
    names = [path.with_name(path.name + suffix)
             for suffix in (".1", ".1.gz", ".01", ".01.gz")]
    try:
        names += [p for p in path.parent.glob(glob.escape(path.name) + "[.-]*")
                  if _DATED.fullmatch(p.name[len(path.name):])]
    except OSError:
        return None
    present = []
    for p in names:
        try:
            present.append((p.stat().st_mtime, str(p), p))
        except OSError:
            continue
    return max(present)[2] if present else None


def _open_any(path: Path) -> BufferedIOBase:
    """``path`` opened for reading, decompressed when it ends in ``.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return path.open("rb")


@dataclass
class _Followed:
    """A file being read: its descriptor, identity (device, inode), the bytes consumed, the
    first bytes of the file (to recognise a copy of it) and its last line without a newline
    yet."""

    handle: BufferedIOBase
    ident: tuple[int, int]
    position: int = 0
    head: bytes = b""
    partial: bytes = b""


def _split(followed: _Followed, chunk: bytes) -> Iterator[str]:
    data = followed.partial + chunk
    end = data.rfind(b"\n")
    if end < 0:
        followed.partial = data
        return
    followed.partial = data[end + 1:]
    for line in data[:end].split(b"\n"):
        yield line.decode("utf-8", "replace").rstrip("\r")


def _finish(followed: _Followed) -> Iterator[str]:
    """A file that will grow no more: its last line counts even without a newline."""
    if followed.partial:
        line, followed.partial = followed.partial, b""
        yield line.decode("utf-8", "replace").rstrip("\r")


def _rewritten(followed: _Followed) -> bool:
    """Whether the file was truncated in place since it was read (shorter than what was
    read, or starting with other bytes: truncated, then written past the old length)."""
    fd = followed.handle.fileno()
    if os.fstat(fd).st_size < followed.position:
        return True
    return bool(followed.head) and os.pread(fd, len(followed.head), 0) != followed.head


class LogTail:
    """Follows the log at ``path`` (see the module's docstring). ``bytes_read`` counts every
    byte taken from disk (decompressed bytes for a ``.gz``). ``missing_ok``: a ``path`` that
    does not exist yet reads as empty (Exim makes its reject log at the first rejection)."""

    def __init__(self, path: Path, *, missing_ok: bool = False) -> None:
        self.path = path
        self.missing_ok = missing_ok
        self.bytes_read = 0
        self._followed: _Followed | None = None
        # a file rotated away: read once more at the next call (its writer may not have
        # reopened the new file yet), then closed
        self._retiring: _Followed | None = None
        self._started = False
        self._history_read = False

    def read(self) -> list[str]:
        """The complete lines appended since the previous call, as :meth:`lines` gives."""
        return list(self.lines())

    def lines(self) -> Iterator[str]:
        """The complete lines appended since the previous call (without their newline,
        decoded as UTF-8 with undecodable bytes replaced), oldest first, read as they are
        consumed (a large history is never held whole). Raises OSError when ``PATH`` cannot
        be read; the lines yielded before it count as read."""
        return self._lines()

    def close(self) -> None:
        """Release the descriptors held (the next read starts from the current ``PATH``)."""
        for followed in (self._followed, self._retiring):
            if followed is not None:
                followed.handle.close()
        self._followed = self._retiring = None

    def _lines(self) -> Iterator[str]:
        if not self._started:
            yield from self._history()
            self._started = True
        yield from self._retire()
        followed = self._followed
        if followed is not None and _rewritten(followed):
            yield from self._truncated(followed)
        else:
            yield from self._drain(followed)
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            if (self._followed is None and self._retiring is None and not self._history_read
                    and not self.missing_ok):
                raise
            return  # renamed away and not created again yet: the descriptors have it all
        if followed is None:
            yield from self._open_current()
        elif (stat.st_dev, stat.st_ino) != followed.ident:
            yield from self._drain(followed)  # what the writer added before it reopened
            self._retiring, self._followed = followed, None  # read once more next time
            yield from self._open_current()

    def _retire(self) -> Iterator[str]:
        retiring = self._retiring
        if retiring is None:
            return
        yield from self._drain(retiring)
        yield from _finish(retiring)
        retiring.handle.close()
        self._retiring = None

    def _history(self) -> Iterator[str]:
        history = rotated_history(self.path)
        if history is None:
            return
        self._history_read = True
        try:
            with _open_any(history) as handle:
                whole = _Followed(handle, (0, 0))
                while chunk := handle.read(_CHUNK):
                    self.bytes_read += len(chunk)
                    yield from _split(whole, chunk)
                yield from _finish(whole)
        except (OSError, EOFError):
            pass  # a history that cannot be read is no evidence; the current file still is

    def _open_current(self) -> Iterator[str]:
        handle = self.path.open("rb")
        actual = os.fstat(handle.fileno())
        self._followed = _Followed(handle, (actual.st_dev, actual.st_ino))
        yield from self._drain(self._followed)

    def _drain(self, followed: _Followed | None) -> Iterator[str]:
        if followed is None:
            return
        while chunk := followed.handle.read(_CHUNK):
            if len(followed.head) < _HEAD:
                followed.head += chunk[:_HEAD - len(followed.head)]
            followed.position += len(chunk)
            self.bytes_read += len(chunk)
            yield from _split(followed, chunk)

    def _truncated(self, followed: _Followed) -> Iterator[str]:
        """``PATH`` was truncated in place: finish what was written before the truncation
        from its copy (``PATH.1``, or ``PATH.1.gz`` when compressed at once, when it starts
        as the file did), then read ``PATH`` from 0."""
        for suffix in (".1", ".1.gz"):
            try:
                with _open_any(self.path.with_name(self.path.name + suffix)) as copy:
                    if not followed.head or copy.read(len(followed.head)) != followed.head:
                        continue
                    copy.seek(followed.position)
                    while chunk := copy.read(_CHUNK):
                        self.bytes_read += len(chunk)
                        yield from _split(followed, chunk)
                    break
            except (OSError, EOFError):
                continue
        yield from _finish(followed)
        followed.handle.seek(0)
        followed.position = 0
        followed.head = b""
        yield from self._drain(followed)
