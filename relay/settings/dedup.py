"""The dedup rules: how a fingerprint is made (header names, case of local parts, HMAC secret,
scope), how long it suppresses copies (window, lease), what happens to a message without a key,
to a retry of one in doubt or when the store is down, the per-template rules and the rate
limits; built into :class:`relay.core.policy.Policy` and :class:`relay.core.limits.RateRule`.
The rules change live on reload; what shapes the fingerprint never does."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from relay.core.errors import ConfigError
from relay.core.key_rules import KeyRule, build_rule
from relay.core.keys import KeyFormat
from relay.core.limits import RateRule
from relay.core.policy import Policy, TemplateRule
from relay.core.rules import (
    DuplicateReply,
    KeyReuse,
    MissingKeyPolicy,
    Mode,
    StoreDownPolicy,
    UnknownPolicy,
)
from relay.settings.common import (
    CsvList,
    FileCheck,
    SecretFile,
    Section,
    SettingsRuleError,
    secret_setting,
    setting_names,
    split_csv,
)

if TYPE_CHECKING:
    from relay.core.dedup import DedupCore


class DeclaresLabels(Protocol):
    """Where a reload declares the metric children of what it added (the relay's metrics)."""

    def declare_rate_limits(self, labels: Iterable[str]) -> None: ...

    def declare_key_rules(self, names: Iterable[str]) -> None: ...


class TemplatePolicy(BaseModel):
    """One ``[[template_policy]]`` entry of the config file: the dedup rules for the messages
    whose template matches ``match`` (a shell glob, case-sensitive, on the normalized template
    value; ``*`` for the default entry). A key left out takes the global setting of that name.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    match: str = Field(min_length=0, description="shell glob on the template value")
    dedup: bool | None = Field(None, description=(
        "false: relay these messages without dedup (one-time codes, password resets)"))
    dedup_window: float | None = Field(None, gt=0, description=(
        "seconds a sent fingerprint of this template suppresses copies"))
    missing_key: MissingKeyPolicy | None = None
    unknown_policy: UnknownPolicy | None = None
    duplicate_reply: DuplicateReply | None = Field(None, description=(
        '"250" (accepted, not relayed again) or "550" (550 5.7.1, the caller is told)'))
    mode: Mode | None = None
    key_reuse: KeyReuse | None = Field(None, description=(
        "a copy whose key's record is of other content: suppress, reject (550 5.7.1) or "
        "relay"))


class KeyRuleMatch(BaseModel):
    """The ``match`` of a ``[[key_rule]]``: each condition given must hold."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sender: str | None = Field(None, description=(
        "the envelope sender: an address or a glob such as *@shop.example (case-insensitive)"))
    recipient_domain: str | None = Field(None, description=(
        "a glob every recipient's domain matches (case-insensitive)"))
    header: str | None = Field(None, description="a header field the message must have")
    subject: str | None = Field(None, description="a pattern the Subject must hold")


class KeyRuleEntry(BaseModel):
    """One ``[[key_rule]]`` entry of the config file: for a message without a key header that
    ``match`` fits, where its dedupe ``key`` comes from (``header:NAME``, ``subject:REGEX``,
    ``body:REGEX``: the first capture group, or ``content``: a digest of the normalized text),
    its ``template`` (a fixed name, or ``subject``: the Subject with digits masked), the
    patterns ``ignore`` removes before ``content``, and its ``mode`` (design.md §2.1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    match: KeyRuleMatch = Field(default_factory=lambda: KeyRuleMatch.model_validate({}))
    key: str
    template: str | None = None
    ignore: tuple[str, ...] = ()
    mode: Mode = "enforce"

    def rule(self) -> KeyRule:
        """The core's rule; raises ``ValueError`` naming this rule when it is invalid."""
        m = self.match
        return build_rule(name=self.name, key=self.key, sender=m.sender,
                          recipient_domain=m.recipient_domain, header=m.header,
                          subject=m.subject, template=self.template, ignore=self.ignore,
                          mode=self.mode)


class RateLimit(BaseModel):
    """One ``[[rate_limit]]`` entry of the config file: at most ``messages`` messages (and
    ``recipients`` envelope recipients) per ``per`` seconds for each value of ``scope`` (each
    upstream, AUTH user, sender domain or template), shared by every relay on the store.
    ``match`` (a shell glob on the scope's value) limits the entry to some values; ``name`` is
    its ``limit`` label in ``relay_rate_limited_total`` (default
    ``<scope>-<messages>-per-<per>s``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    scope: Literal["upstream", "auth_user", "sender_domain", "template"]
    messages: int | None = Field(default=None, ge=1)
    recipients: int | None = Field(default=None, ge=1)
    per: float = Field(gt=0, description="seconds")
    match: str = "*"
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,64}$")

    @model_validator(mode="after")
    def _some_limit(self) -> RateLimit:
        if self.messages is None and self.recipients is None:
            raise ValueError("a rate_limit needs messages or recipients (or both)")
        return self

    @property
    def label(self) -> str:
        """The ``limit`` label value: ``name``, or ``<scope>-<count>-per-<per>s``."""
        if self.name is not None:
            return self.name
        count = f"{self.messages}" if self.messages is not None else f"{self.recipients}r"
        return f"{self.scope}-{count}-per-{self.per:g}s"


# the dedup rules swapped into the running Policy on reload (design.md §4.6)
POLICY_SETTINGS = ("template_policy", "key_rule", "mode", "dedup_window", "missing_key",
                   "unknown_policy", "duplicate_reply", "store_down", "in_flight_wait",
                   "key_reuse")


class DedupSettings(Section):
    """How a fingerprint is made and what the relay does with a copy, per template too."""

    TITLE: ClassVar[str] = "Dedup rules"
    LIVE: ClassVar[tuple[str, ...]] = (*POLICY_SETTINGS, "rate_limit")
    FILES: ClassVar[tuple[str, ...]] = ("fingerprint_secret_file",
                                        "fingerprint_secret_previous_file")

    dedup_window: float = Field(default=86400.0, gt=0, description=(
        "seconds a sent fingerprint suppresses copies"))
    lease: float = Field(default=900.0, gt=0, description=(
        "seconds a reservation lives without renewal (a working attempt renews it every "
        "third); at least 3 x store_timeout"))
    dedupe_headers: CsvList = Field(("X-Dedupe-Key", "Idempotency-Key"), description=(
        "header field names of the dedupe key (aliases of one field), comma-separated"))
    template_headers: CsvList = Field(("X-Template",), description=(
        "header field names of the template, comma-separated"))
    max_key_chars: int = Field(default=256, ge=1, description=(
        "characters of a key or template; longer ones are refused with 554 5.6.0"))
    local_part_case_sensitive: bool = Field(False, description=(
        "John@x and john@x are different recipients"))
    fingerprint_secret: SecretStr | None = Field(None, description=(
        "HMAC-SHA-256 key of the fingerprint instead of plain SHA-256; prefer "
        "fingerprint_secret_file or the env var: a flag is visible in the process list"))
    fingerprint_secret_file: Path | None = Field(None, description=(
        "file holding fingerprint_secret (a Docker or systemd secret; surrounding whitespace "
        "and the final newline are not part of it)"))
    fingerprint_secret_previous: SecretStr | None = Field(None, description=(
        "the fingerprint_secret before a rotation: while set, a reserve also looks each "
        "recipient up under this secret's key, and a record there counts as one under the "
        "current key (set it for one dedup window after changing the secret, then drop it); "
        "prefer fingerprint_secret_previous_file"))
    fingerprint_secret_previous_file: Path | None = Field(None, description=(
        "file holding fingerprint_secret_previous (as fingerprint_secret_file)"))
    missing_key: MissingKeyPolicy = Field("relay", description=(
        "a message without a dedupe key: relay (without dedup) or reject (554 5.6.0)"))
    strip_dedupe_headers: bool = Field(False, description=(
        "leave the dedupe key and template fields out of the relayed message"))
    scope_by_auth: bool = Field(False, description=(
        "the AUTH identity is part of the fingerprint"))
    unknown_policy: UnknownPolicy = Field("suppress", description=(
        "a retry of an in-doubt (UNKNOWN) message: suppress (250, not relayed), hold (451) "
        "or send (relayed again, a possible duplicate)"))
    in_flight_wait: float = Field(default=15.0, ge=0, description=(
        "seconds a copy of a message another attempt is relaying waits, after its final dot, "
        "for that attempt's outcome (then: the duplicate reply once sent, relayed once "
        "released, unknown_policy once in doubt, 450 4.2.0 if still in flight); 0: 450 4.2.0 "
        "at once"))
    store_down: StoreDownPolicy = Field("fail_closed", description=(
        "the store does not answer: fail_closed (451 4.3.0) or fail_open (relay without "
        "dedup)"))
    duplicate_reply: DuplicateReply = Field("250", description=(
        'a message whose every recipient is a duplicate: "250" (accepted, not relayed again) '
        'or "550" (550 5.7.1: the caller is told it was a duplicate)'))
    mode: Mode = Field("enforce", description=(
        "enforce (suppress duplicates) or shadow (decide, reserve and settle as enforce does, "
        "but deliver duplicates anyway, counted as would_suppress)"))
    key_reuse: KeyReuse = Field("suppress", description=(
        "a message whose key's record was written for other content (the application reused "
        "the key): suppress (as a duplicate, logged WARNING, counted in "
        "relay_key_reuse_total and the ledger), reject (550 5.7.1, the key was used for "
        "other content) or relay (relayed, the record then this message's)"))
    rate_limit: tuple[RateLimit, ...] = Field((), description=(
        "[[rate_limit]] tables of the config file: scope (upstream, auth_user, sender_domain, "
        "template), messages and/or recipients per `per` seconds, shared through the store"))
    template_policy: tuple[TemplatePolicy, ...] = Field((), description=(
        "[[template_policy]] tables of the config file: per-template dedup, dedup_window, "
        "missing_key, unknown_policy, duplicate_reply, mode and key_reuse; first match wins"))
    key_rule: tuple[KeyRuleEntry, ...] = Field((), description=(
        "[[key_rule]] tables of the config file: name, match (sender, recipient_domain, "
        "header, subject), key (header:NAME, subject:REGEX, body:REGEX, content), template, "
        "ignore, mode; for messages without a key header, first match wins"))

    @field_validator("dedupe_headers", "template_headers", mode="before")
    @classmethod
    def _split_header_lists(cls, value: object) -> object:
        return split_csv(value)

    @field_validator("dedupe_headers", "template_headers")
    @classmethod
    def _check_header_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # imported here: only this validator uses it (pure, no I/O)
        from relay.core.headers import check_field_names

        check_field_names(value)  # ValueError names the bad one: non-ASCII, blank, colon
        return value

    @field_validator("dedupe_headers")
    @classmethod
    def _check_some_dedupe_header(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:  # no header could carry a key: every message would relay undeduplicated
            raise ValueError("dedupe_headers must name at least one header")
        return value

    @field_validator("fingerprint_secret", "fingerprint_secret_previous")
    @classmethod
    def _check_fingerprint_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value():
            raise ValueError("a fingerprint secret must not be empty (leave it unset for "
                             "SHA-256)")
        return value

    @field_validator("rate_limit")
    @classmethod
    def _check_rate_limit_labels(cls, value: tuple[RateLimit, ...]) -> tuple[RateLimit, ...]:
        """Each limit's label names its counters in the store and its metric: two entries
        with one label would share (and double-count) their buckets."""
        labels = [r.label for r in value]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(f"[[rate_limit]] entries share the label {', '.join(twice)}: "
                             "give each a distinct name")
        return value

    @field_validator("key_rule")
    @classmethod
    def _check_key_rules(cls, value: tuple[KeyRuleEntry, ...]) -> tuple[KeyRuleEntry, ...]:
        """Each rule's patterns compile (with the capture group its key needs) and no two
        rules share a name; the ``ValueError`` names the rule."""
        names: set[str] = set()
        for entry in value:
            if entry.name in names:
                raise ValueError(f"key_rule {entry.name!r}: two rules have this name")
            names.add(entry.name)
            entry.rule()
        return value

    @model_validator(mode="after")
    def _check_dedup_rules(self) -> DedupSettings:
        if self.dedup_window < self.lease:
            raise SettingsRuleError(
                f"dedup_window ({self.dedup_window:g} s) must not be shorter than the lease "
                f"({self.lease:g} s)", "dedup_window", "lease")
        for index, entry in enumerate(self.template_policy):
            if entry.dedup_window is not None and entry.dedup_window < self.lease:
                raise SettingsRuleError(
                    f"template_policy.{index} (match {entry.match!r}): dedup_window "
                    f"({entry.dedup_window:g} s) must not be shorter than the lease "
                    f"({self.lease:g} s)", "template_policy", "lease")
        if self.fingerprint_secret_file is not None and self.fingerprint_secret is not None:
            raise SettingsRuleError("give fingerprint_secret_file or fingerprint_secret, not both",
                                    "fingerprint_secret_file", "fingerprint_secret")
        self._check_previous_secret()
        return self

    def _check_previous_secret(self) -> None:
        """The previous secret: in one place (a value or a file), and only beside a current
        one (it names what the secret was before the one in use)."""
        previous = (self.fingerprint_secret_previous, self.fingerprint_secret_previous_file)
        if all(value is not None for value in previous):
            raise SettingsRuleError(
                "give fingerprint_secret_previous_file or fingerprint_secret_previous, not both",
                "fingerprint_secret_previous_file", "fingerprint_secret_previous")
        current = (self.fingerprint_secret, self.fingerprint_secret_file)
        if any(value is not None for value in previous) and all(
                value is None for value in current):
            raise SettingsRuleError(
                "fingerprint_secret_previous is the secret before fingerprint_secret: set the "
                "current one too (fingerprint_secret or fingerprint_secret_file)",
                "fingerprint_secret_previous", "fingerprint_secret")

    @property
    def fingerprint_secret_bytes(self) -> bytes | None:
        """The HMAC key of the fingerprint (UTF-8 of ``fingerprint_secret``, or of the
        ``fingerprint_secret_file``'s text without surrounding whitespace), or None.

        Raises ConfigError when the file cannot be read or holds nothing.
        """
        if self.fingerprint_secret_file is not None:
            return secret_setting(self.fingerprint_secret_file,
                                  "fingerprint_secret_file").encode()
        secret = self.fingerprint_secret
        return secret.get_secret_value().encode() if secret is not None else None

    @property
    def fingerprint_secret_previous_bytes(self) -> bytes | None:
        """The HMAC key the fingerprints had before :attr:`fingerprint_secret_bytes` (UTF-8 of
        ``fingerprint_secret_previous``, or of its file's text without surrounding
        whitespace), or None.

        Raises ConfigError when the file cannot be read or holds nothing, and when it is the
        current secret (nothing to rotate from)."""
        if self.fingerprint_secret_previous_file is not None:
            previous = secret_setting(self.fingerprint_secret_previous_file,
                                      "fingerprint_secret_previous_file").encode()
        elif self.fingerprint_secret_previous is not None:
            previous = self.fingerprint_secret_previous.get_secret_value().encode()
        else:
            return None
        if previous == self.fingerprint_secret_bytes:
            raise ConfigError(f"{setting_names('fingerprint_secret_previous')}: it is the "
                              "current fingerprint secret; give the secret in use before it")
        return previous

    def file_checks(self, *, live: bool) -> list[FileCheck]:
        """The fingerprint secrets' files (read; the previous one is not the current)."""
        return [(("fingerprint_secret_file",), lambda: self.fingerprint_secret_bytes),
                (("fingerprint_secret_previous_file", "fingerprint_secret_previous"),
                 lambda: self.fingerprint_secret_previous_bytes)]

    def secret_files(self) -> list[SecretFile]:
        """The fingerprint secrets' files."""
        return [(name, path) for name, path in (
            ("fingerprint_secret_file", self.fingerprint_secret_file),
            ("fingerprint_secret_previous_file", self.fingerprint_secret_previous_file))
            if path is not None]

    def template_rules(self) -> tuple[TemplateRule, ...]:
        """The ``[[template_policy]]`` entries as the core's rules (design.md §4.6)."""
        return tuple(
            TemplateRule(match=t.match, dedup=t.dedup, window_s=t.dedup_window,
                         missing_key=t.missing_key, unknown=t.unknown_policy,
                         duplicate_reply=t.duplicate_reply, mode=t.mode,
                         key_reuse=t.key_reuse)
            for t in self.template_policy)

    def key_rules(self) -> tuple[KeyRule, ...]:
        """The ``[[key_rule]]`` entries as the core's rules (design.md §2.1)."""
        return tuple(entry.rule() for entry in self.key_rule)

    def window_for(self, templates: Sequence[str]) -> float:
        """The dedup window (seconds) of a message whose normalized template values are
        ``templates``: its ``[[template_policy]]`` entry's, else ``dedup_window``."""
        return Policy(window_s=self.dedup_window, templates=self.template_rules()
                      ).for_templates(templates).window_s

    def policy(self, *, key_prefix: str, key_format: KeyFormat, secret: bytes | None,
               previous_secret: bytes | None = None) -> Policy:
        """The dedup policy of design.md §2-4, its store keys under ``key_prefix`` in
        ``key_format``, fingerprints keyed with ``secret`` (:attr:`fingerprint_secret_bytes`:
        read once by the caller), and looked up under ``previous_secret`` too
        (:attr:`fingerprint_secret_previous_bytes`)."""
        return Policy(
            lease_s=self.lease, window_s=self.dedup_window, key_prefix=key_prefix,
            key_names=self.dedupe_headers, template_names=self.template_headers,
            max_key_chars=self.max_key_chars,
            local_part_case_sensitive=self.local_part_case_sensitive,
            secret=secret, previous_secret=previous_secret,
            missing_key=self.missing_key, unknown=self.unknown_policy,
            store_down=self.store_down, strip_headers=self.strip_dedupe_headers,
            scope_by_auth=self.scope_by_auth, key_format=key_format,
            duplicate_reply=self.duplicate_reply, mode=self.mode,
            in_flight_wait_s=self.in_flight_wait, key_reuse=self.key_reuse,
            templates=self.template_rules(), key_rules=self.key_rules())

    def live_policy(self, running: Policy) -> Policy:
        """``running`` (the relay's policy) with these settings' dedup rules
        (:data:`POLICY_SETTINGS`); every field that shapes the fingerprint (secret, key prefix
        and format, header names...) stays the running one's, and the secret's file is not
        read again (it may hold another key by now)."""
        return dataclasses.replace(
            running, window_s=self.dedup_window, missing_key=self.missing_key,
            unknown=self.unknown_policy, store_down=self.store_down,
            duplicate_reply=self.duplicate_reply, mode=self.mode,
            in_flight_wait_s=self.in_flight_wait, key_reuse=self.key_reuse,
            templates=self.template_rules(), key_rules=self.key_rules())

    def rate_rules(self) -> tuple[RateRule, ...]:
        """The ``[[rate_limit]]`` tables as the core's rules (:mod:`relay.core.limits`)."""
        return tuple(RateRule(label=r.label, scope=r.scope, per_s=r.per, messages=r.messages,
                              recipients=r.recipients, match=r.match) for r in self.rate_limit)

    def apply_dedup_live(self, applied: Set[str], *, core: DedupCore,
                         metrics: DeclaresLabels) -> None:
        """Apply the :attr:`LIVE` settings named in ``applied`` to the running ``core``: the
        dedup rules and the rate limits from the next message on (a message in flight keeps
        its policy; the store's counters stay); ``metrics`` declares the metric children of
        new rate limits and key rules (at 0, as at start)."""
        if any(name in applied for name in POLICY_SETTINGS):
            core.policy = self.live_policy(core.policy)
        if "key_rule" in applied:
            metrics.declare_key_rules(r.name for r in self.key_rule)
        if "rate_limit" in applied:
            metrics.declare_rate_limits(r.label for r in self.rate_limit)
            core.rate_limits = self.rate_rules()

    def dedup_warnings(self) -> list[str]:
        """What the start-up log warns about: shadow mode, for all or some templates."""
        shadowed = ["all templates"] if self.mode == "shadow" else [
            t.match for t in self.template_policy if t.mode == "shadow"]
        shadowed += [f"key_rule {r.name}" for r in self.key_rule if r.mode == "shadow"]
        if not shadowed:
            return []
        return [f"shadow mode for {', '.join(shadowed)}: duplicates are relayed and counted as "
                "would_suppress, not suppressed (design.md §4.6)"]
