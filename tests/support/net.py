"""Loopback helpers shared by the tests."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def maildir_files(path: Path) -> list[bytes]:
    """The contents of every message file in the Maildir at ``path``."""
    return [p.read_bytes() for p in sorted((path / "new").glob("*"))]
