"""Which fingerprint an operator means: :func:`selected_key`, the one rule of the command line's
``--store-key`` / ``--rcpt --template --key`` and the console's forms.

An operator gives either a store key, which must start with the relay's ``store_prefix`` (a
store shared with an application holds its keys too), or a recipient with its X-Dedupe-Key
(and X-Template, and the AUTH identity with ``scope_by_auth``), from which the key the relay
uses is computed (:func:`relay.admin.records.key_for`); not both. A refusal is a
:class:`SelectionError` naming its :class:`SelectionProblem`, which each surface words in its
own terms (flags on the command line, fields in the console).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from relay.admin.records import FingerprintInput, recipient_key_for
from relay.core.errors import InvalidAddressError, InvalidDedupKeyError
from relay.settings import Settings


class SelectionProblem(enum.Enum):
    """Why a selection names no fingerprint of this relay."""

    BOTH = "both"  # a store key, and a recipient, key, template or AUTH identity too
    FOREIGN = "foreign"  # a store key that does not start with store_prefix
    INCOMPLETE = "incomplete"  # no store key, and no recipient or no key
    REFUSED = "refused"  # inputs the relay refuses (the message says why)


class SelectionError(ValueError):
    """A selection refused: ``problem``, and a sentence (for :attr:`SelectionProblem.REFUSED`
    the reason the relay refuses the recipient, key or template)."""

    def __init__(self, problem: SelectionProblem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


@dataclass(frozen=True)
class Selection:
    """What an operator gave: a ``store_key``, or a recipient (``rcpt``) with ``keys`` and
    ``templates`` (header values as an application writes them, several occurrences allowed)
    and the sender's ``auth_user`` (with ``scope_by_auth``). None or empty: not given."""

    store_key: str | None = None
    rcpt: str | None = None
    templates: Sequence[str] = ()
    keys: Sequence[str] = ()
    auth_user: str | None = None


def own_store_key(settings: Settings, store_key: str) -> str:
    """``store_key`` when it is one of this relay's (it starts with ``store_prefix``). Raises
    :class:`SelectionError` (``FOREIGN``) when not."""
    if not store_key.startswith(settings.store_prefix):
        raise SelectionError(SelectionProblem.FOREIGN,
                             f"{store_key!r} is no fingerprint of this relay: its keys start "
                             f"with {settings.store_prefix!r} (store_prefix)")
    return store_key


def selected_key(settings: Settings, given: Selection) -> str:
    """The store key ``given`` names under ``settings``: its store key (checked by
    :func:`own_store_key`), else the one computed from its recipient and key. Raises
    :class:`SelectionError`: ``BOTH``, ``FOREIGN``, ``INCOMPLETE``, or ``REFUSED`` for a
    recipient, key or template the relay refuses (or an AUTH identity without
    ``scope_by_auth``)."""
    return selected_keys(settings, given)[0]


def selected_keys(settings: Settings, given: Selection) -> tuple[str, ...]:
    """The store keys ``given`` names under ``settings``: its store key alone, or the key
    computed from its recipient and key followed, while ``fingerprint_secret_previous`` is
    set, by the same fingerprint's key under that secret (design.md §2.3: a record there
    counts as the fingerprint's; :func:`relay.admin.records.located` finds which holds one).
    Raises :class:`SelectionError` as :func:`selected_key` does, and ConfigError for a
    secret's file that cannot be read."""
    if given.store_key is not None:
        if given.rcpt is not None or given.keys or given.templates or given.auth_user:
            raise SelectionError(SelectionProblem.BOTH,
                                 "give a store key, or a recipient and key, not both")
        return (own_store_key(settings, given.store_key),)
    if given.rcpt is None or not given.keys:
        raise SelectionError(SelectionProblem.INCOMPLETE,
                             "give a recipient and its key (and template), or a store key")
    try:
        found = recipient_key_for(settings, FingerprintInput(
            rcpt=given.rcpt, templates=given.templates, keys=given.keys,
            auth_user=given.auth_user))
    except (InvalidAddressError, InvalidDedupKeyError, ValueError) as exc:
        raise SelectionError(SelectionProblem.REFUSED, str(exc)) from exc
    return (found.key,) if found.previous is None else (found.key, found.previous)
