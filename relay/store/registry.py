"""The kinds of fingerprint store the relay knows, one entry each (:data:`KINDS`), and the one
place a store URL's scheme is looked at (:func:`kind_of`).

A store kind is its package under ``relay/store/`` with a ``kind`` module exporting one
:class:`relay.store.kinds.StoreKind`, and its line here (docs/layout.md, "Adding a store
kind"). The settings (which URL is valid, which files it names, opening the store, its kind
in the start-up line) and the command line (``db upgrade``, the admin commands' data file)
ask this module. Importing it imports no driver (:mod:`relay.store.kinds`).
"""

from __future__ import annotations

from relay.store.kinds import StoreKind
from relay.store.postgres.kind import POSTGRES
from relay.store.redis.kind import REDIS
from relay.store.sqlite.kind import SQLITE

KINDS: tuple[StoreKind, ...] = (
    REDIS,
    SQLITE,
    POSTGRES,
)


def kind_of(url: str) -> StoreKind | None:
    """The kind whose schemes ``url`` begins with; None when no kind takes it."""
    return next((kind for kind in KINDS if kind.takes(url)), None)


def url_forms() -> str:
    """Every kind's URL forms, for ``--help`` and the refusal of another URL."""
    return "; ".join(kind.forms for kind in KINDS)
