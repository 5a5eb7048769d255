"""Which fingerprint an operator's selection names (relay.admin.selected_key), the one rule of
the command line's selection options and the console's forms."""

from __future__ import annotations

import pytest

from relay.admin import (
    FingerprintInput,
    Selection,
    SelectionError,
    SelectionProblem,
    key_for,
    own_store_key,
    selected_key,
)
from relay.settings import Settings, load_settings

RCPT, KEY = "user@example.com", "order-1"


@pytest.fixture
def settings() -> Settings:
    """A relay's settings with its own key prefix."""
    return load_settings({"upstream": "maildir:md", "store_prefix": "acme:fp:"})


def test_a_recipient_with_its_key_names_the_key_the_relay_computes(settings: Settings) -> None:
    """A recipient, template and key select the store key the relay derives for them."""
    expected = key_for(settings, FingerprintInput(rcpt=RCPT, templates=["welcome"],
                                                  keys=[KEY]))[1]
    given = Selection(rcpt=RCPT, templates=["welcome"], keys=[KEY])
    assert selected_key(settings, given) == expected


def test_a_store_key_of_the_relay_is_taken_as_given(settings: Settings) -> None:
    """A store key that starts with store_prefix selects itself."""
    assert selected_key(settings, Selection(store_key="acme:fp:abc")) == "acme:fp:abc"


@pytest.mark.parametrize(("given", "problem"), [
    (Selection(store_key="acme:fp:abc", rcpt=RCPT), SelectionProblem.BOTH),
    (Selection(store_key="acme:fp:abc", keys=[KEY]), SelectionProblem.BOTH),
    (Selection(store_key="acme:fp:abc", templates=["welcome"]), SelectionProblem.BOTH),
    (Selection(store_key="acme:fp:abc", auth_user="app"), SelectionProblem.BOTH),
    (Selection(store_key="email:fp:abc"), SelectionProblem.FOREIGN),
    (Selection(rcpt=RCPT), SelectionProblem.INCOMPLETE),
    (Selection(keys=[KEY]), SelectionProblem.INCOMPLETE),
    (Selection(), SelectionProblem.INCOMPLETE),
    (Selection(rcpt="not an address", keys=[KEY]), SelectionProblem.REFUSED),
    (Selection(rcpt=RCPT, keys=[KEY], auth_user="app"), SelectionProblem.REFUSED),
])
def test_a_selection_that_names_no_fingerprint_is_refused_with_its_problem(
        settings: Settings, given: Selection, problem: SelectionProblem) -> None:
    """Both kinds at once, a store key outside store_prefix, no key, or inputs the relay
    refuses raise SelectionError naming the problem."""
    with pytest.raises(SelectionError) as info:
        selected_key(settings, given)
    assert info.value.problem is problem


def test_an_empty_store_key_is_no_fingerprint_of_the_relay(settings: Settings) -> None:
    """A console form's empty store key is refused as outside store_prefix."""
    with pytest.raises(SelectionError) as info:
        own_store_key(settings, "")
    assert info.value.problem is SelectionProblem.FOREIGN
