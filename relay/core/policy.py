"""The dedup policy of one relay, and of one message (docs/design.md §4.6).

:class:`Policy` holds the relay's rules; its :attr:`Policy.templates` are the
``[[template_policy]]`` entries of the config file. :meth:`Policy.for_templates` resolves the
rules of one message from its template values: the first entry whose glob matches a template
value gives that value's rules, an entry leaving a rule unset takes the relay's; a message with
several template values takes, rule by rule, the strictest of their entries. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from relay.core.key_rules import KeyRule
from relay.core.keys import KeyFormat
from relay.core.rules import (
    DuplicateReply,
    KeyReuse,
    MissingKeyPolicy,
    Mode,
    StoreDownPolicy,
    UnknownPolicy,
)

# strictest last: the order :meth:`Policy.for_templates` folds several templates' rules by
_UNKNOWN_ORDER: tuple[UnknownPolicy, ...] = ("send", "suppress", "hold")
_MISSING_ORDER: tuple[MissingKeyPolicy, ...] = ("relay", "reject")
_MODE_ORDER: tuple[Mode, ...] = ("shadow", "enforce")
_REPLY_ORDER: tuple[DuplicateReply, ...] = ("250", "550")
_REUSE_ORDER: tuple[KeyReuse, ...] = ("relay", "suppress", "reject")
_CACHE_SIZE = 1024  # resolved template sets kept per policy (a message's templates repeat)


@dataclass(frozen=True)
class TemplateRule:
    """One ``[[template_policy]]`` entry: ``match`` is a shell glob (case-sensitive, on the
    normalized template value; ``*`` matches every value, the empty one of a message without a
    template too); None leaves a rule to the relay's setting. ``window_s`` is in seconds."""

    match: str
    dedup: bool | None = None
    window_s: float | None = None
    missing_key: MissingKeyPolicy | None = None
    unknown: UnknownPolicy | None = None
    duplicate_reply: DuplicateReply | None = None
    mode: Mode | None = None
    key_reuse: KeyReuse | None = None


@dataclass(frozen=True)
class Policy:
    """The dedup rules of one relay (durations in seconds); built from Settings by the app.

    ``dedup``, ``window_s``, ``missing_key``, ``unknown``, ``duplicate_reply``, ``mode`` and
    ``key_reuse`` are the rules a ``[[template_policy]]`` entry (``templates``) may set per
    template; the others are the relay's alone (they shape the fingerprint, which no policy
    changes).
    """

    lease_s: float = 900.0
    window_s: float = 86400.0
    key_prefix: str = "email:fp:"
    key_names: tuple[str, ...] = ("X-Dedupe-Key", "Idempotency-Key")
    template_names: tuple[str, ...] = ("X-Template",)
    max_key_chars: int = 256
    local_part_case_sensitive: bool = False
    secret: bytes | None = None
    previous_secret: bytes | None = None  # a rotation: its keys are looked up too (§2.3)
    missing_key: MissingKeyPolicy = "relay"
    unknown: UnknownPolicy = "suppress"
    store_down: StoreDownPolicy = "fail_closed"
    strip_headers: bool = False  # remove the key and template fields before relaying
    scope_by_auth: bool = False  # the AUTH identity is part of the fingerprint (tenants)
    key_format: KeyFormat = "hex"  # the fingerprint in a store key: hex or compact (base64url)
    dedup: bool = True  # False: relay without dedup (an exempt template)
    duplicate_reply: DuplicateReply = "250"
    mode: Mode = "enforce"
    in_flight_wait_s: float = 15.0  # a copy of a message in flight waits this long (0: 450)
    key_reuse: KeyReuse = "suppress"  # a key's record of other content (design.md §4.9)
    templates: tuple[TemplateRule, ...] = ()
    key_rules: tuple[KeyRule, ...] = ()  # [[key_rule]]: keys for messages without a key header
    _resolved: dict[tuple[str, ...], Policy] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def for_templates(self, templates: Sequence[str]) -> Policy:
        """The rules of a message whose normalized template values are ``templates`` (none:
        the empty value): per value the first matching entry's rules over the relay's, and for
        several values rule by rule the strictest (dedup on over off, the longest window,
        reject over relay, hold over suppress over send, 550 over 250, enforce over shadow,
        key_reuse reject over suppress over relay).
        Returns ``self`` when no entry is configured."""
        if not self.templates:
            return self
        key = tuple(templates)
        found = self._resolved.get(key)
        if found is None:
            if len(self._resolved) >= _CACHE_SIZE:
                self._resolved.clear()
            found = self._resolved[key] = self._resolve(key)
        return found

    def _resolve(self, templates: tuple[str, ...]) -> Policy:
        """:meth:`for_templates` without the cache."""
        resolved = [self._one(value) for value in (templates or ("",))]
        if len(resolved) == 1:
            return resolved[0]
        return dataclasses.replace(
            self,
            dedup=any(p.dedup for p in resolved),
            window_s=max(p.window_s for p in resolved),
            missing_key=max((p.missing_key for p in resolved), key=_MISSING_ORDER.index),
            unknown=max((p.unknown for p in resolved), key=_UNKNOWN_ORDER.index),
            duplicate_reply=max((p.duplicate_reply for p in resolved), key=_REPLY_ORDER.index),
            mode=max((p.mode for p in resolved), key=_MODE_ORDER.index),
            key_reuse=max((p.key_reuse for p in resolved), key=_REUSE_ORDER.index),
        )

    def _one(self, template: str) -> Policy:
        """The rules of one template value: the first entry matching it over the relay's."""
        for rule in self.templates:
            if fnmatchcase(template, rule.match):
                return dataclasses.replace(
                    self,
                    dedup=self.dedup if rule.dedup is None else rule.dedup,
                    window_s=self.window_s if rule.window_s is None else rule.window_s,
                    missing_key=rule.missing_key or self.missing_key,
                    unknown=rule.unknown or self.unknown,
                    duplicate_reply=rule.duplicate_reply or self.duplicate_reply,
                    mode=rule.mode or self.mode,
                    key_reuse=rule.key_reuse or self.key_reuse,
                )
        return self
