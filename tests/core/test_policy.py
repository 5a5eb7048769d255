"""Per-template policy resolution (design.md §4.6): first match per template value, unset rules
from the relay's settings, the strictest rule by rule over several values, and the
``[[template_policy]]`` tables of a config file reaching the core unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.core.errors import ConfigError
from relay.core.policy import Policy, TemplateRule
from relay.settings import load_settings

RELAY = Policy(window_s=3600.0, unknown="suppress", templates=(
    TemplateRule(match="otp-*", dedup=False),
    TemplateRule(match="receipt-*", window_s=86400.0 * 7, duplicate_reply="550"),
    TemplateRule(match="receipt-refund", dedup=False),  # shadowed by the entry above
    TemplateRule(match="news*", mode="shadow", unknown="send"),
    TemplateRule(match="*", missing_key="reject"),
))


def test_without_entries_the_relay_policy_is_every_message_policy() -> None:
    plain = Policy()
    assert plain.for_templates(("anything",)) is plain


@pytest.mark.parametrize(("template", "dedup", "window", "reply", "missing"), [
    ("otp-login", False, 3600.0, "250", "relay"),
    ("receipt-refund", True, 604800.0, "550", "relay"),  # the first match wins
    ("welcome", True, 3600.0, "250", "reject"),  # the default entry
    ("", True, 3600.0, "250", "reject"),  # no template: the default entry too
    ("OTP-login", True, 3600.0, "250", "reject"),  # globs are case-sensitive
])
def test_the_first_matching_entry_gives_the_rules_the_rest_from_the_relay(
        template: str, dedup: bool, window: float, reply: str, missing: str) -> None:
    got = RELAY.for_templates((template,) if template else ())
    assert (got.dedup, got.window_s, got.duplicate_reply, got.missing_key) == (
        dedup, window, reply, missing)
    assert got.key_prefix == RELAY.key_prefix and got.templates == RELAY.templates


def test_several_template_values_take_the_strictest_rule_of_each() -> None:
    """otp-* (exempt) with receipt-* (7-day window, 550) and news* (shadow, send): dedup on,
    the longest window, 550, enforce over shadow, suppress over send."""
    got = RELAY.for_templates(("news-1", "otp-a", "receipt-b"))
    assert got.dedup is True
    assert got.window_s == 604800.0
    assert got.duplicate_reply == "550"
    assert got.mode == "enforce"
    assert got.unknown == "suppress"
    assert got.missing_key == "relay"  # none of the three matched the reject default
    hold = Policy(templates=(TemplateRule(match="a", unknown="hold"),
                             TemplateRule(match="b", unknown="send")))
    assert hold.for_templates(("a", "b")).unknown == "hold"


def test_config_file_tables_reach_the_core(tmp_path: Path) -> None:
    config = tmp_path / "relay.toml"
    config.write_text('upstream = "maildir:md"\nmode = "shadow"\n'
                      '[[template_policy]]\nmatch = "otp-*"\ndedup = false\n'
                      '[[template_policy]]\nmatch = "*"\ndedup_window = 7200\n'
                      'duplicate_reply = "550"\nunknown_policy = "hold"\nmode = "enforce"\n')
    policy = load_settings({}, config).dedup_policy()
    assert policy.mode == "shadow"
    assert policy.templates == (
        TemplateRule(match="otp-*", dedup=False),
        TemplateRule(match="*", window_s=7200.0, duplicate_reply="550", unknown="hold",
                     mode="enforce"))


@pytest.mark.parametrize(("table", "named"), [
    ('match = "a"\ndedup_window = 10\n', "must not be shorter than the lease"),
    ('match = "a"\nduplicate_reply = "554"\n', "duplicate_reply"),
    ('match = "a"\nmode = "audit"\n', "mode"),
    ('match = "a"\nwindow = 60\n', "window"),  # a typo is refused, not ignored
    ('dedup = false\n', "match"),  # no match
])
def test_a_bad_entry_is_refused_with_its_name(tmp_path: Path, table: str, named: str) -> None:
    config = tmp_path / "relay.toml"
    config.write_text('upstream = "maildir:md"\n[[template_policy]]\n' + table)
    with pytest.raises(ConfigError, match=named):
        load_settings({}, config)


def test_resolved_rules_are_cached_per_template_set_and_bounded() -> None:
    """A message's template set repeats: its rules are resolved once (the same object comes
    back), and at most 1024 sets are kept (a client inventing templates grows nothing)."""
    policy = Policy(templates=(TemplateRule(match="r-*", window_s=7200.0),))
    first = policy.for_templates(("r-1",))
    assert policy.for_templates(("r-1",)) is first and first.window_s == 7200.0
    for n in range(3000):
        assert policy.for_templates((f"x-{n}",)).window_s == policy.window_s
    assert len(policy._resolved) <= 1024
    assert policy.for_templates(("r-1",)).window_s == 7200.0


def test_the_window_rule_names_the_entry_as_the_other_messages_do(tmp_path: Path) -> None:
    """Entries are counted from 0 in every message (pydantic's ``template_policy.2.mode``)."""
    config = tmp_path / "relay.toml"
    config.write_text('upstream = "maildir:md"\n' + "".join(
        f'[[template_policy]]\nmatch = "t{n}"\n' for n in range(2))
        + '[[template_policy]]\nmatch = "short-*"\ndedup_window = 10\n')
    with pytest.raises(ConfigError, match=r"template_policy\.2 \(match 'short-\*'\)"):
        load_settings({}, config)
