"""dedup-relay: an SMTP relay proxy that stops duplicate outbound email.

For every envelope recipient of a message carrying an ``X-Dedupe-Key`` header the relay derives a
fingerprint, reserves it atomically in a store (Redis, or an embedded SQLite file), relays the
message to the upstream smarthost and settles the reservation by the upstream's reply.

``__version__`` is the installed distribution's version (``pyproject.toml`` keeps it); the CLI's
``--version`` and the ``relay_build_info`` metric read it from here.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DISTRIBUTION = "dedup-relay"


def _source_tree_version() -> str:
    """The version in the ``pyproject.toml`` beside this package, for a source tree that was
    never installed (no distribution metadata); ``0+unknown`` when there is none."""
    import tomllib  # only on this rare path

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "0+unknown"
    if project.get("name") != DISTRIBUTION:
        return "0+unknown"
    return str(project.get("version", "0+unknown"))


try:
    __version__: str = version(DISTRIBUTION)
except PackageNotFoundError:
    __version__ = _source_tree_version()
