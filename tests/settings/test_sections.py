"""The settings sections mix into one Settings without hiding each other: every field, validator
and method of a section is reachable on the mixed object as the section wrote it; each section
validates on its own; the operator surface (field order, names) is the sections' in order."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from relay.settings import (
    RELOADABLE,
    SECTIONS,
    AccessSettings,
    DedupSettings,
    OperationsSettings,
    Settings,
    UpstreamSettings,
    section_fields,
)
from relay.settings.common import Section

# the protocol every section implements; called through the class, never the mixed object
SHARED = {"TITLE", "LIVE", "FILES", "file_checks", "secret_files", "model_config"}


def _own_names(section: type[Section]) -> set[str]:
    decorators = section.__pydantic_decorators__
    names = {n for n in vars(section) if not n.startswith("__") and n != "_abc_impl"}
    names |= set(decorators.field_validators) | set(decorators.model_validators)
    return (names | set(section_fields(section))) - SHARED


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.__name__)
def test_no_section_defines_a_name_another_section_defines(section: type[Section]) -> None:
    """Mixed into Settings, a name two sections define would reach only the first in the MRO
    (a validator of the other silently never runs)."""
    others = set().union(*(_own_names(s) for s in SECTIONS if s is not section))
    assert _own_names(section) & others == set()


def test_the_mixed_settings_have_the_sections_fields_in_section_order() -> None:
    """Flags, --help and docs/settings.md list the fields section by section."""
    assert list(Settings.model_fields) == [f for s in SECTIONS for f in section_fields(s)]


def test_every_section_validator_runs_on_the_mixed_settings() -> None:
    """A rule of each section refuses through Settings as through the section alone."""
    cases: list[tuple[type[Section], dict[str, object]]] = [
        (AccessSettings, {"allowed_networks": "10.0.0.0/33"}),
        (AccessSettings, {"allowed_senders": "*@a.example,*@b.example", "tls_required": True}),
        (DedupSettings, {"dedupe_headers": "X-Key:"}),
        (UpstreamSettings, {"upstream": "a:25,maildir:x"}),
        (OperationsSettings, {"metrics_listen": "nowhere"}),
    ]
    for section, values in cases:
        alone: dict[str, object] = (
            {"upstream": "127.0.0.1:25", **values} if section is UpstreamSettings else values)
        with pytest.raises(ValidationError):
            section.model_validate(alone)
        with pytest.raises(ValidationError):
            Settings.model_validate({"upstream": "127.0.0.1:25", **values})


def test_a_comma_separated_list_is_split_by_each_section() -> None:
    """The env var / flag form of list settings reaches each section split."""
    settings = Settings.model_validate({
        "upstream": "a.example:25, b.example:25", "allowed_networks": "10.0.0.0/8, ::1/128",
        "allowed_senders": "*@a.example", "proxy_networks": "10.1.0.0/16",
        "dedupe_headers": "X-A, X-B", "template_headers": "X-T"})
    assert [e.address for e in settings.upstream] == ["a.example:25", "b.example:25"]
    assert settings.allowed_networks == ("10.0.0.0/8", "::1/128")
    assert settings.allowed_senders == ("*@a.example",)
    assert settings.proxy_networks == ("10.1.0.0/16",)
    assert settings.dedupe_headers == ("X-A", "X-B")
    assert settings.template_headers == ("X-T",)


def test_the_live_settings_are_each_sections_own_fields() -> None:
    """A section applies on reload only settings it holds."""
    for section in SECTIONS:
        assert set(section.LIVE) <= set(section_fields(section)), section.__name__
        assert set(section.FILES) <= set(section_fields(section)), section.__name__
    assert len(RELOADABLE) == len(set(RELOADABLE))


def test_a_section_builds_its_part_from_itself_alone(tmp_path: Path) -> None:
    """A section's builder needs nothing but the section (and the values it is given)."""
    upstream = UpstreamSettings.model_validate({"upstream": "smtp.example:587",
                                                "upstream_pool_size": 3})
    config = upstream.smtp_upstream_config(upstream.upstream[0], None,
                                           local_hostname="relay.example", default_pool_size=9)
    assert (config.host, config.port, config.pool_size) == ("smtp.example", 587, 3)
    dedup = DedupSettings.model_validate({"dedup_window": 7200, "lease": 600})
    policy = dedup.policy(key_prefix="p:", key_format="hex", secret=None)
    assert (policy.window_s, policy.lease_s, policy.key_prefix) == (7200.0, 600.0, "p:")
