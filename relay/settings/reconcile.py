"""Reconciliation (docs/operating/reconciliation.md): how often the reconciler asks the
evidence sources about the in-doubt messages, when it gives a doubt up, and the
``[[reconcile_source]]`` tables (a Postfix or Exim smarthost's log, or a command), each with
the upstreams it speaks for; built into the sources of :mod:`relay.reconcile`."""

from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relay.core.errors import ConfigError
from relay.settings.common import FileCheck, Section, SettingsRuleError

if TYPE_CHECKING:
    from relay.reconcile.evidence import EvidenceSource

SOURCE_KINDS = ("postfix_log", "exim_log", "command")
"""The keys of a ``[[reconcile_source]]``, exactly one of which it sets."""


class ReconcileSource(BaseModel):
    """One ``[[reconcile_source]]`` of the config file: its ``name`` (unique; the ``source``
    label of ``relay_reconciled_total``), exactly one of ``postfix_log`` (a Postfix mail log's
    path), ``exim_log`` (Exim's main log's path) or ``command`` (a program and its arguments,
    run with the Message-ID and the attempt's time), and the ``upstreams`` it speaks for
    (names from the upstream list; None: all)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    postfix_log: Path | None = None
    exim_log: Path | None = None
    command: tuple[str, ...] | None = None
    upstreams: tuple[str, ...] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> ReconcileSource:
        given = [k for k in SOURCE_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"reconcile_source {self.name!r}: set exactly one of "
                             f"{', '.join(SOURCE_KINDS)} (got "
                             f"{', '.join(given) if given else 'none'})")
        if self.command is not None and (not self.command or not self.command[0]):
            raise ValueError(f"reconcile_source {self.name!r}: command is empty (a program "
                             "and its arguments: [\"/path/to/script\", \"arg\"])")
        if self.upstreams is not None and not self.upstreams:
            raise ValueError(f"reconcile_source {self.name!r}: upstreams is empty (leave it "
                             "out: the source speaks for every upstream)")
        return self

    @property
    def log_path(self) -> Path | None:
        """The log it reads (None: a command)."""
        return self.postfix_log if self.postfix_log is not None else self.exim_log

    def speaks_for(self, upstream: str) -> bool:
        """Whether it answers for messages the ledger says went to ``upstream``."""
        return self.upstreams is None or upstream in self.upstreams

    def build(self) -> EvidenceSource:
        """The source (:mod:`relay.reconcile`: ``PostfixLog``, ``EximLog``, ``Command``),
        nothing opened yet."""
        if self.command is not None:
            built = _source_class("command", "Command")(self.name, self.command)
        elif self.postfix_log is not None:
            built = _source_class("postfix", "PostfixLog")(self.name, self.postfix_log)
        else:
            built = _source_class("exim", "EximLog")(self.name, self.exim_log)
        return cast("EvidenceSource", built)

    def check(self) -> None:
        """Raise ConfigError when its log cannot be read, or its program is not found or not
        executable."""
        path = self.log_path
        if path is not None:
            try:
                with path.open("rb"):
                    pass
            except OSError as exc:
                raise ConfigError(f"reconcile_source {self.name!r}: cannot read the log "
                                  f"{path}: {exc.strerror or exc}") from exc
            return
        assert self.command is not None
        program = self.command[0]
        found = shutil.which(program) if os.sep not in program else (
            program if os.access(program, os.X_OK) and Path(program).is_file() else None)
        if found is None:
            raise ConfigError(f"reconcile_source {self.name!r}: the command's program "
                              f"{program} is not found or not executable")


def _source_class(module: str, name: str) -> Callable[..., object]:
    """The source class ``name`` of ``relay.reconcile.<module>``, imported when first built."""
    return cast("Callable[..., object]",
                getattr(importlib.import_module(f"relay.reconcile.{module}"), name))


@dataclass(frozen=True)
class AnsweringSource:
    """A built source and the upstreams it speaks for (None: all)."""

    source: EvidenceSource
    upstreams: frozenset[str] | None

    def speaks_for(self, upstream: str) -> bool:
        """Whether it answers for messages the ledger says went to ``upstream``."""
        return self.upstreams is None or upstream in self.upstreams


class ReconcileSettings(Section):
    """How the in-doubt messages are resolved by the smarthosts' own records."""

    TITLE: ClassVar[str] = "Reconciliation"
    LIVE: ClassVar[tuple[str, ...]] = ("reconcile_interval", "reconcile_give_up",
                                       "reconcile_source")

    reconcile_interval: float = Field(default=60.0, ge=0, description=(
        "seconds between the reconciler's rounds: each asks the evidence sources "
        "([[reconcile_source]]) about the in-doubt messages of the audit ledger, oldest first; "
        "0 (or no source): off"))
    reconcile_give_up: float = Field(default=86400.0, gt=0, description=(
        "seconds after its final dot an in-doubt message no source has evidence about is "
        "left to an operator (one reconcile_given_up ledger row; never asked about again)"))
    reconcile_source: tuple[ReconcileSource, ...] = Field((), description=(
        "[[reconcile_source]] tables of the config file: name, one of postfix_log (PATH), "
        "exim_log (PATH) or command ([PROGRAM, ARGS...]), and upstreams (names from the "
        "upstream list; default all); they need the audit ledger"))

    @field_validator("reconcile_source")
    @classmethod
    def _check_names(cls, value: tuple[ReconcileSource, ...]) -> tuple[ReconcileSource, ...]:
        names: set[str] = set()
        for entry in value:
            if entry.name in names:
                raise ValueError(f"reconcile_source {entry.name!r}: two sources have this name")
            names.add(entry.name)
        return value

    @property
    def reconciling(self) -> bool:
        """Whether the reconciler runs (a source, and an interval)."""
        return bool(self.reconcile_source) and self.reconcile_interval > 0

    def file_checks(self, *, live: bool) -> list[FileCheck]:
        """Each source's log readable, each command's program executable."""
        return [(("reconcile_source",), entry.check) for entry in self.reconcile_source]

    def reconcile_sources(self) -> list[AnsweringSource]:
        """The configured sources, built (nothing opened yet), in their order."""
        return [AnsweringSource(entry.build(), None if entry.upstreams is None
                                else frozenset(entry.upstreams))
                for entry in self.reconcile_source]

    def describe_reconcile(self) -> str:
        """The reconciler for start-up lines: ``, reconciling every 60 s from a, b``, or
        nothing when off."""
        if not self.reconciling:
            return ""
        names = ", ".join(entry.name for entry in self.reconcile_source)
        return f", reconciling every {self.reconcile_interval:g} s from {names}"


def reconcile_rule_problem(sources: Sequence[ReconcileSource], *, ledger: str | None,
                           upstreams: Sequence[str]) -> SettingsRuleError | None:
    """What is wrong between the sources and the other sections (None: nothing): sources
    without an audit ledger (the in-doubt list is the ledger's), a source naming an upstream
    that is not configured."""
    if sources and ledger is None:
        return SettingsRuleError(
            "[[reconcile_source]] is set but no ledger is: the reconciler's work list is the "
            "audit ledger's in-doubt list; name the ledger (postgresql://...) or remove the "
            "sources", "reconcile_source", "ledger")
    for entry in sources:
        unknown = [u for u in entry.upstreams or () if u not in upstreams]
        if unknown:
            return SettingsRuleError(
                f"reconcile_source {entry.name!r} speaks for {', '.join(unknown)}, not in the "
                f"upstream list ({', '.join(upstreams)}): name upstreams by their name "
                "(or address)", "reconcile_source", "upstream")
    return None
