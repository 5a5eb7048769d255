"""The one place a store key is derived (docs/design.md §2).

The relay (:meth:`relay.core.dedup.DedupCore.process`) and the admin commands
(:func:`relay.admin.key_for`) both call :func:`recipient_key`, so the key an operator computes
is the key the relay reserved; :func:`header_values` turns header values given on a command line
into what the relay reads from a message.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from relay.core.fingerprint import DEFAULT_STORE_PREFIX, fingerprint, store_key
from relay.core.headers import (
    DEFAULT_MAX_KEY_CHARS,
    DedupHeaders,
    ParsedMessage,
    normalize_header_value,
)
from relay.core.key_rules import (
    KeyRule,
    MessageView,
    content_digest,
    first_match,
    stored_digest,
)
from relay.core.recipients import normalize_recipient

KeyFormat = Literal["hex", "compact"]
"""How a fingerprint is written in its store key: ``hex`` (64 characters, the seed formula an
application computes) or ``compact`` (unpadded base64url of the 32-byte digest, RFC 4648
section 5: 43 characters)."""


def key_form(fp: str, key_format: KeyFormat) -> str:
    """The fingerprint ``fp`` (64 hex) as it appears in a store key under ``key_format``.

    Raises ``ValueError`` when ``fp`` is not hex (compact only)."""
    if key_format == "hex":
        return fp
    return base64.urlsafe_b64encode(bytes.fromhex(fp)).rstrip(b"=").decode("ascii")


class KeyPolicy(Protocol):
    """The settings a store key depends on (:class:`relay.core.dedup.Policy` has them)."""

    @property
    def key_prefix(self) -> str:
        """Prefix of every store key (``email:fp:``)."""
        ...

    @property
    def secret(self) -> bytes | None:
        """HMAC key of the fingerprint; None: plain SHA-256."""
        ...

    @property
    def previous_secret(self) -> bytes | None:
        """The HMAC key the fingerprints had before ``secret`` (a rotation, design.md §2.3):
        its keys are looked up too; None: none."""
        ...

    @property
    def local_part_case_sensitive(self) -> bool:
        """Whether ``User@x`` and ``user@x`` are two mailboxes."""
        ...

    @property
    def scope_by_auth(self) -> bool:
        """Whether the AUTH identity is part of the fingerprint (tenants)."""
        ...

    @property
    def key_format(self) -> KeyFormat:
        """How the fingerprint is written in the key (:data:`KeyFormat`)."""
        ...

    @property
    def key_rules(self) -> tuple[KeyRule, ...]:
        """The ``[[key_rule]]`` entries, in order (:mod:`relay.core.key_rules`)."""
        ...

    @property
    def max_key_chars(self) -> int:
        """Characters of a key or template (a rule's longer key becomes its digest)."""
        ...


@dataclass(frozen=True)
class KeyRules:
    """A :class:`KeyPolicy` for a caller without a :class:`relay.core.dedup.Policy`."""

    key_prefix: str = DEFAULT_STORE_PREFIX
    secret: bytes | None = None
    previous_secret: bytes | None = None
    local_part_case_sensitive: bool = False
    scope_by_auth: bool = False
    key_format: KeyFormat = "hex"
    key_rules: tuple[KeyRule, ...] = ()
    max_key_chars: int = DEFAULT_MAX_KEY_CHARS


@dataclass(frozen=True)
class DerivedKey:
    """Where a message's key comes from: ``headers`` (the key and template the fingerprint
    takes: the message's own, or a rule's), ``source`` (``header``; ``rule:NAME``; ``""``: no
    key), the rule that matched (``rule``, None for none) and whether its source yielded
    nothing (``missed``: the message is relayed without dedup). ``view`` is what the rules
    read of the message (its decoded text parsed on first use only), kept for
    :meth:`content_digest`."""

    headers: DedupHeaders
    source: str
    rule: KeyRule | None = None
    missed: bool = False
    view: MessageView | None = field(default=None, compare=False, repr=False)

    @property
    def shadow(self) -> bool:
        """Whether the key came from a rule in shadow mode."""
        return self.rule is not None and not self.missed and self.rule.mode == "shadow"

    def content_digest(self) -> str:
        """The message's content as a store keeps it (design.md §2.2): the ``content``
        digest of :mod:`relay.core.key_rules` (the built-in volatile parts and, for a key a
        rule gave, that rule's ``ignore`` patterns removed), in its stored form
        (:func:`relay.core.key_rules.stored_digest`, 10 characters); ``""`` without a view.
        Computed on the first call, once per message (a ``content`` rule's key shares it)."""
        if self.view is None:
            return ""
        ignore = self.rule.ignore if self.rule is not None else ()
        return stored_digest(content_digest(self.view, ignore))


def derive_key(message: ParsedMessage, headers: DedupHeaders, policy: KeyPolicy, *,
               mail_from: str, rcpt_tos: Sequence[str]) -> DerivedKey:
    """The key of a message whose dedup header fields are ``headers``: its key header when it
    has one (an explicit key always wins), else the first of ``policy.key_rules`` that matches
    (its template replacing the message's when it gives one), else none."""
    view = MessageView(message, mail_from=mail_from, rcpt_tos=rcpt_tos)
    if headers.key is not None:
        return DerivedKey(headers=headers, source="header", view=view)
    found = first_match(policy.key_rules, view, max_key_chars=policy.max_key_chars)
    if found is None:
        return DerivedKey(headers=headers, source="", view=view)
    templates = headers.templates if found.template is None else (
        (found.template,) if found.template else ())
    return DerivedKey(
        headers=DedupHeaders(keys=(found.key,) if found.key else (), templates=templates),
        source=f"rule:{found.rule.name}", rule=found.rule, missed=found.key is None, view=view)


@dataclass(frozen=True)
class RecipientKey:
    """One recipient's normalized ``mailbox``, its ``fingerprint`` (64 hex) and store ``key``
    (the fingerprint in the policy's :data:`KeyFormat`); ``previous``: its store key under the
    policy's previous secret (design.md §2.3), None without one."""

    mailbox: str
    fingerprint: str
    key: str
    previous: str | None = None


def header_values(keys: Iterable[str], templates: Iterable[str], *,
                  max_chars: int = DEFAULT_MAX_KEY_CHARS) -> DedupHeaders:
    """The dedup fields of a message whose key and template values are given apart (as an
    application writes them; several occurrences allowed), as
    :func:`relay.core.headers.extract_dedup_headers` reads them from a header section:
    each value normalized, blanks dropped, distinct values sorted. Raises
    :class:`relay.core.errors.InvalidDedupKeyError` for a value the relay refuses."""
    return DedupHeaders(keys=_normalized(keys, "dedupe key", max_chars),
                        templates=_normalized(templates, "template", max_chars))


def _normalized(values: Iterable[str], label: str, limit: int) -> tuple[str, ...]:
    normalized = {normalize_header_value(v, label=label, max_chars=limit) for v in values}
    return tuple(sorted(v for v in normalized if v))


def recipient_key(rcpt: str, template: str, key: str, policy: KeyPolicy,
                  auth_user: str | None = None) -> RecipientKey:
    """Derive the store key of ``rcpt`` (a forward path as the client gave it) for a message
    whose dedup header values are ``template`` and ``key`` (as
    :class:`relay.core.headers.DedupHeaders` gives them: normalized, several values joined
    by US), under ``policy``; ``auth_user`` (the session's AUTH identity) counts only with
    ``scope_by_auth``.

    With ``policy.previous_secret`` the result also names the recipient's store key under
    that secret (``previous``). Raises :class:`relay.core.errors.InvalidAddressError` for a
    recipient that cannot be normalized.
    """
    mailbox = normalize_recipient(rcpt, local_part_case_sensitive=policy.local_part_case_sensitive)
    scope = auth_user if policy.scope_by_auth else None
    fp = fingerprint(mailbox, template, key, secret=policy.secret, scope=scope)
    previous = None
    if policy.previous_secret is not None:
        earlier = fingerprint(mailbox, template, key, secret=policy.previous_secret, scope=scope)
        previous = store_key(policy.key_prefix, key_form(earlier, policy.key_format))
    return RecipientKey(mailbox=mailbox, fingerprint=fp,
                        key=store_key(policy.key_prefix, key_form(fp, policy.key_format)),
                        previous=previous)


def recipient_keys(rcpt_tos: Sequence[str], template: str, key: str, policy: KeyPolicy,
                   auth_user: str | None = None) -> dict[str, str]:
    """Map each recipient of ``rcpt_tos`` to its store key (:func:`recipient_key`); raises
    as it does."""
    return {rcpt: recipient_key(rcpt, template, key, policy, auth_user).key
            for rcpt in rcpt_tos}
