"""The audit ledger (design.md §6.7): the PostgreSQL database that keeps one row per recipient
decision, whether the relay fails closed without it, how many rows wait in memory, how long
rows are kept and how much of an address or key they hold; built into
:class:`relay.store.postgres.ledger.PostgresLedger`."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from relay.settings.common import (
    FileCheck,
    Section,
    SettingsRuleError,
    kind_extra_missing,
    postgres_files,
    redact_url,
)
from relay.store.postgres.kind import POSTGRES

if TYPE_CHECKING:
    from relay.core.policy import Policy
    from relay.ops.metrics import PrometheusMetrics
    from relay.store.postgres.ledger import LedgerOptions, PostgresLedger


class LedgerSettings(Section):
    """Where ledger rows go, and what they hold."""

    TITLE: ClassVar[str] = "Audit ledger"

    ledger: str | None = Field(None, description=(
        "postgresql://USER@HOST:PORT/DB of the audit ledger: one row per recipient decision, "
        "written off the hot path in batches (any store; `dedup-relay db upgrade --ledger URL` "
        "creates its table); unset: no ledger"))
    ledger_required: bool = Field(False, description=(
        "fail closed: while the ledger cannot take rows (down, or its queue full) new messages "
        "are answered 451 4.3.0; false: relaying goes on and the rows are dropped and counted "
        "(relay_ledger_dropped_total)"))
    ledger_queue: int = Field(default=10000, ge=1, description=(
        "ledger rows a worker keeps in memory while the ledger is slow or down; more are "
        "dropped (or, with ledger_required, new messages refused)"))
    ledger_retention: float = Field(default=400 * 86400.0, gt=0, description=(
        "seconds a ledger row is kept (from when it was written); older rows are deleted in "
        "bounded batches"))
    ledger_recipients: Literal["masked", "full"] = Field("masked", description=(
        "recipients in ledger rows: masked (j***@example.com) or full"))
    ledger_keys: Literal["hash", "plain"] = Field("hash", description=(
        "dedupe keys in ledger rows: hash (SHA-256 hex, HMAC with fingerprint_secret when "
        "set) or plain"))
    in_doubt_alert_after: float = Field(default=3600.0, gt=0, description=(
        "seconds after which an in-doubt (unknown) ledger decision no later row resolved "
        "counts in relay_ledger_in_doubt_unresolved (the DedupRelayInDoubtUnresolved alert)"))

    @field_validator("ledger")
    @classmethod
    def _check_ledger(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not POSTGRES.takes(value):
            raise ValueError("ledger must be a postgresql:// (or postgres://) URL, got "
                             + repr(redact_url(value)))
        missing = kind_extra_missing(POSTGRES)
        if missing is not None:
            raise ValueError(f"the audit ledger needs PostgreSQL's driver: {missing}")
        POSTGRES.check_url(value, "ledger")
        return value

    @model_validator(mode="after")
    def _check_required(self) -> LedgerSettings:
        if self.ledger_required and self.ledger is None:
            raise SettingsRuleError(
                "ledger_required is set but no ledger is: name the audit ledger's database "
                "(postgresql://...) or leave ledger_required off", "ledger_required", "ledger")
        return self

    def file_checks(self, *, live: bool) -> list[FileCheck]:
        """The files the ledger's URL names (``sslrootcert=`` ...), readable."""
        ledger = self.ledger
        return [] if ledger is None else [(("ledger",), lambda: postgres_files(ledger))]

    def ledger_options(self, *, instance: str, secret: bytes | None,
                       local_part_case_sensitive: bool) -> LedgerOptions:
        """How this process writes ledger rows: ``instance`` names it in every row (the relay's
        hostname and pid); ``secret`` is the HMAC key of hashed dedupe keys and of the
        recipients' digests, whose addresses are normalized as the fingerprints' are
        (``local_part_case_sensitive``)."""
        from relay.store.postgres.ledger import LedgerOptions

        return LedgerOptions(
            instance=instance, recipients_full=self.ledger_recipients == "full",
            keys_plain=self.ledger_keys == "plain", secret=secret,
            local_part_case_sensitive=local_part_case_sensitive,
            queue_max=self.ledger_queue, required=self.ledger_required,
            retention_s=self.ledger_retention, in_doubt_after_s=self.in_doubt_alert_after)

    async def open_ledger(self, metrics: PrometheusMetrics, *, instance: str,
                          policy: Policy, timeout_s: float) -> PostgresLedger | None:
        """Open the audit ledger (None without one), its rows keyed and normalized by the
        dedup ``policy``'s secret and case rule; each call on it may take ``timeout_s``.
        Raises :class:`StartupError` when its schema is missing or old, :class:`StoreError`
        for a URL the driver refuses."""
        if self.ledger is None:
            return None
        from relay.store.postgres.ledger import PostgresLedger  # the postgres extra

        metrics.declare_ledger()
        return await PostgresLedger.open(
            self.ledger, metrics=metrics,
            options=self.ledger_options(
                instance=instance, secret=policy.secret,
                local_part_case_sensitive=policy.local_part_case_sensitive),
            op_timeout_s=timeout_s)

    def describe_ledger(self) -> str:
        """The ledger for check-config's line: ``, ledger URL (required)``, or nothing."""
        if self.ledger is None:
            return ""
        return f", ledger {redact_url(self.ledger)}{' (required)' if self.ledger_required else ''}"
