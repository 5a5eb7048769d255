"""The rules of the OAuth2 section and of its use by smarthost AUTH (relay.settings.oauth and
relay.settings.Settings): one row per rule, the settings built from keyword values as the
config file gives them; a refused row names the setting the operator must change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from relay.settings import Settings

ENTRA = "https://login.microsoftonline.com/contoso/oauth2/v2.0/token"
F = Path("/run/secrets/x")


def build(**values: Any) -> Settings:
    base: dict[str, Any] = {"upstream": "smtp.example.com:587", "upstream_auth": "xoauth2",
                            "upstream_user": "relay@example.com"}
    return Settings(**{**base, **values})


ACCEPTED: dict[str, dict[str, Any]] = {
    "generic client credentials": {"oauth_token_url": ENTRA, "oauth_client_id": "c",
                                   "oauth_client_secret_file": F},
    "generic refresh token": {"oauth_token_url": "https://oauth2.googleapis.com/token",
                              "oauth_client_id": "c", "oauth_refresh_token_file": F},
    "microsoft secret": {"oauth_provider": "microsoft", "oauth_token_url": ENTRA,
                         "oauth_client_id": "c", "oauth_client_secret_file": F},
    "microsoft certificate": {"oauth_provider": "microsoft", "oauth_token_url": ENTRA,
                              "oauth_client_id": "c", "oauth_certificate_file": F},
    "microsoft workload identity": {"oauth_provider": "microsoft", "oauth_token_url": ENTRA,
                                    "oauth_client_id": "c", "oauth_federated_token_file": F},
    "microsoft managed identity alone": {"oauth_provider": "microsoft",
                                         "oauth_managed_identity": "system"},
    "google service account alone": {"oauth_provider": "google",
                                     "oauth_service_account_file": F},
    "password auth ignores an unfinished oauth section": {
        "upstream_auth": "password", "oauth_token_url": ENTRA},
}

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "generic without a credential": (
        {"oauth_token_url": ENTRA, "oauth_client_id": "c"},
        "oauth_client_secret_file or oauth_refresh_token_file"),
    "generic without a token url": (
        {"oauth_client_id": "c", "oauth_client_secret_file": F}, "oauth_token_url"),
    "a token url over http": (
        {"oauth_token_url": "http://idp/token", "oauth_client_id": "c",
         "oauth_client_secret_file": F}, "https://"),
    "microsoft without a credential": (
        {"oauth_provider": "microsoft", "oauth_token_url": ENTRA, "oauth_client_id": "c"},
        "oauth_certificate_file"),
    "microsoft with two credentials": (
        {"oauth_provider": "microsoft", "oauth_token_url": ENTRA, "oauth_client_id": "c",
         "oauth_client_secret_file": F, "oauth_certificate_file": F}, "one credential"),
    "microsoft with a managed identity and a secret": (
        {"oauth_provider": "microsoft", "oauth_managed_identity": "system",
         "oauth_client_secret_file": F}, "one credential"),
    "microsoft with a refresh token": (
        {"oauth_provider": "microsoft", "oauth_token_url": ENTRA, "oauth_client_id": "c",
         "oauth_refresh_token_file": F}, "oauth_provider = generic"),
    "microsoft with a token url not Entra's": (
        {"oauth_provider": "microsoft", "oauth_token_url": "https://idp.example/token",
         "oauth_client_id": "c", "oauth_client_secret_file": F}, "/oauth2/v2.0/token"),
    "a certificate for the generic provider": (
        {"oauth_token_url": ENTRA, "oauth_client_id": "c", "oauth_client_secret_file": F,
         "oauth_certificate_file": F}, "oauth_provider = microsoft only"),
    "a service account for microsoft": (
        {"oauth_provider": "microsoft", "oauth_managed_identity": "system",
         "oauth_service_account_file": F}, "oauth_provider = google only"),
    "google without a service account": (
        {"oauth_provider": "google"}, "oauth_service_account_file"),
    "google for an upstream that logs in as another mailbox": (
        {"oauth_provider": "google", "oauth_service_account_file": F,
         "upstream": [{"address": "smtp.gmail.com:587", "user": "other@example.com"}]},
        "upstream_user only"),
    "an upstream's own xoauth2 without a provider that can fetch": (
        {"upstream_auth": "password",
         "upstream": [{"address": "smtp.example.com:587", "auth": "xoauth2"}]},
        "upstream smtp.example.com:587: auth xoauth2 needs"),
}


@pytest.mark.parametrize("values", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_accepted(values: dict[str, Any]) -> None:
    build(**values)


@pytest.mark.parametrize(("values", "named"), REFUSED.values(), ids=REFUSED.keys())
def test_refused(values: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError) as refused:
        build(**values)
    assert named in str(refused.value)


def test_a_provider_default_scope() -> None:
    assert build(**ACCEPTED["microsoft managed identity alone"]).oauth_scope_value == (
        "https://outlook.office365.com/.default")
    assert build(**ACCEPTED["google service account alone"]).oauth_scope_value == (
        "https://mail.google.com/")
    assert build(**ACCEPTED["generic client credentials"]).oauth_scope_value is None
