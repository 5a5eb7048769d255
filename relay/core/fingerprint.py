"""Fingerprint inputs and the fingerprint itself (docs/design.md §2).

Pure functions, no I/O. A fingerprint is computed per envelope recipient::

    fp = hex(SHA-256(norm_rcpt NUL template NUL dedupe_key))     # or HMAC-SHA-256 with a secret
    store key = prefix + fp                                      # default prefix "email:fp:"

With one key, one template and plain ASCII values this equals the seed Go mailer's
``email:fp:`` + hex SHA-256 of ``lower(trim(to)) NUL template NUL key``. Its inputs come from
:mod:`relay.core.headers` (the key and template values) and :mod:`relay.core.recipients` (the
normalized recipient); the rules are in docs/design.md §2.
"""

from __future__ import annotations

import hashlib
import hmac

from relay.core.address import mailbox_problem
from relay.core.errors import InvalidAddressError
from relay.core.recipients import normalize_recipient

DEFAULT_STORE_PREFIX = "email:fp:"
#: Joins the three fingerprint parts (design.md §2).
VALUE_SEPARATOR = "\0"


# -- fingerprint ------------------------------------------------------------------------------


def fingerprint(norm_rcpt: str, template: str, key: str, *, secret: bytes | None = None,
                scope: str | None = None) -> str:
    """Lower-case hex SHA-256 of ``norm_rcpt NUL template NUL key`` (design.md §2).

    Inputs are :func:`normalize_recipient` output and :class:`DedupHeaders` ``template`` /
    ``key``; they are encoded as UTF-8 with ``surrogateescape``, so raw non-UTF-8 header bytes
    hash as themselves. With ``secret`` the digest is HMAC-SHA-256 (RFC 2104) keyed by it.
    A non-empty ``scope`` (the AUTH identity, design.md §2's optional tenant scoping) is a
    fourth NUL-joined part, so two tenants' equal keys never suppress each other; without one
    the input is the seed's three parts. Returns 64 hex characters. Raises ``ValueError`` for
    an empty secret.
    """
    parts = (norm_rcpt, template, key, scope) if scope else (norm_rcpt, template, key)
    data = VALUE_SEPARATOR.join(parts).encode("utf-8", "surrogateescape")
    if secret is None:
        return hashlib.sha256(data).hexdigest()
    if not secret:
        raise ValueError("an HMAC secret must not be empty")
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


def store_key(prefix: str, fp: str) -> str:
    """The store key of a fingerprint: ``prefix + fp`` (default prefix ``email:fp:``)."""
    return prefix + fp


# -- the ledger's recipient digest ---------------------------------------------------------------

RECIPIENT_DIGEST_CONTEXT = b"dedup-relay ledger recipient\0"
"""What goes before the normalized recipient in :func:`recipient_digest`'s input, so that the
digest is never equal to another hash the relay makes of the same text."""


def recipient_digest(address: str, *, secret: bytes | None = None,
                     local_part_case_sensitive: bool = False) -> str | None:
    """The audit ledger's keyed digest of a recipient (design.md §6.7), by which a lookup
    finds an address's rows without the ledger holding it in clear.

    ``address`` is a forward path as a client or an operator writes it; it is normalized as
    for the fingerprint (:func:`relay.core.recipients.normalize_recipient`, so ``Jane@EXAMPLE.net``
    and ``<jane@example.net>`` give one digest). Returns 64 hex characters: HMAC-SHA-256
    (RFC 2104) keyed by ``secret`` of :data:`RECIPIENT_DIGEST_CONTEXT` + the normalized address
    (UTF-8), or its plain SHA-256 without a secret; None for an empty address, one that
    does not normalize or no mailbox (the relay refuses it at RCPT: no row holds its
    digest). Raises ``ValueError`` for an empty
    secret."""
    if not address:
        return None
    try:
        mailbox = normalize_recipient(address,
                                      local_part_case_sensitive=local_part_case_sensitive)
    except InvalidAddressError:
        return None
    if mailbox_problem(mailbox, postmaster_alone=True) is not None:  # refused at RCPT
        return None
    data = RECIPIENT_DIGEST_CONTEXT + mailbox.encode("utf-8", "surrogateescape")
    if secret is None:
        return hashlib.sha256(data).hexdigest()
    if not secret:
        raise ValueError("an HMAC secret must not be empty")
    return hmac.new(secret, data, hashlib.sha256).hexdigest()
