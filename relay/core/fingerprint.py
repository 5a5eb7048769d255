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
