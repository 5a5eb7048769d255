"""Reading the workers' prometheus-client multiprocess files without failing on one
(design.md §6.2): :class:`WorkerFiles` is the supervisor's collector of the directory the
workers write (``PROMETHEUS_MULTIPROC_DIR``), behind ``/metrics`` and ``/readyz``.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
from collections.abc import Iterator

from prometheus_client import multiprocess
from prometheus_client.core import Metric
from prometheus_client.mmap_dict import MmapedDict

log = logging.getLogger("relay.ops.metrics")

READ_TRIES = 3
"""Reads of the whole directory before a scrape gives up on the workers' files (each read
skips the files it cannot read; a file that changes between that check and the read starts
the read again)."""


class WorkerFiles(multiprocess.MultiProcessCollector):
    """prometheus-client's collector of the multiprocess directory ``path``, skipping each
    file it cannot read instead of failing the whole collection.

    A worker creates its file, then sizes it: a reader in between meets a 0-byte file, and
    prometheus-client's own collector raises ``struct.error`` (an open upstream bug), which
    made the supervisor's ``/readyz`` and ``/metrics`` answer 500. A file cut short (a full
    disk) raised too. Such a file is left out of that collection: a 0-byte one is said at
    DEBUG (it is sized a moment later), another once per file and size at WARNING. Other
    files' values are unchanged. Build one per directory with :func:`worker_files`.
    """

    def __init__(self, path: str) -> None:
        super().__init__(None, path=path)  # type: ignore[no-untyped-call]
        self._said: set[tuple[str, int]] = set()

    def collect(self) -> Iterator[Metric]:
        """Every readable file's metrics, merged as prometheus-client merges them; none
        after :data:`READ_TRIES` reads that each met a file changing under them."""
        for _ in range(READ_TRIES):
            files = [f for f in sorted(glob.glob(os.path.join(self._path, "*.db")))
                     if self._readable(f)]
            try:
                return iter(self.merge(files, accumulate=True))  # type: ignore[no-untyped-call]
            except Exception as exc:  # a file changed since it was checked
                log.debug("a metrics file changed while it was read: %s", exc)
        log.warning("the workers' metrics files kept changing while read (%d tries): their "
                    "values are left out of this collection", READ_TRIES)
        return iter(())

    def _readable(self, path: str) -> bool:
        """Whether every entry of ``path`` reads and parses as prometheus-client reads it."""
        try:
            values = MmapedDict.read_all_values_from_file(path)  # type: ignore[no-untyped-call]
            for key, _value, _at, _pos in values:
                _metric, _name, labels, _help = json.loads(key)
                dict(labels)
        except FileNotFoundError:  # a dead worker's live gauge, removed meanwhile
            return False
        except Exception as exc:  # any unreadable file is left out
            self._skipped(path, exc)
            return False
        return True

    def _skipped(self, path: str, error: Exception) -> None:
        try:
            size = os.path.getsize(path)
        except OSError:
            size = -1
        text = f"{type(error).__name__}: {error}"
        if size == 0:
            log.debug("skipped the metrics file %s: 0 bytes (not sized yet)", path)
        elif (path, size) not in self._said:
            self._said.add((path, size))
            log.warning("skipped the metrics file %s (%d bytes), which cannot be read: %s",
                        path, size, text)


@functools.lru_cache(maxsize=8)
def worker_files(path: str) -> WorkerFiles:
    """The one :class:`WorkerFiles` of the directory ``path``: ``/metrics`` and the
    readiness helpers of :mod:`relay.ops.metrics` share it (and what it already said)."""
    return WorkerFiles(path)
