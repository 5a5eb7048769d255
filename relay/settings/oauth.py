"""The OAuth2 tokens of smarthost AUTH XOAUTH2 / OAUTHBEARER (RFC 7628): who issues them
(``oauth_provider``), with which credential, for which scope; built into
:class:`relay.upstream.oauth.TokenProvider` over the provider's
:class:`relay.upstream.oauth.TokenSource` (docs/upstream.md, "OAuth2")."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from pydantic import Field, model_validator

from relay.core.errors import ConfigError
from relay.core.http_rules import endpoint_refusal, printable_excerpt
from relay.settings.common import (
    FileCheck,
    SecretFile,
    Section,
    SettingsRuleError,
    ca_bundle,
    extra_missing,
    secret_setting,
)

if TYPE_CHECKING:
    from relay.upstream.oauth import TokenProvider, TokenSource

_T = TypeVar("_T")

# the scope a provider's token is asked for when oauth_scope is unset
DEFAULT_SCOPES = {"microsoft": "https://outlook.office365.com/.default",
                  "google": "https://mail.google.com/"}
# the settings only one provider reads
_PROVIDER_ONLY = {"oauth_certificate_file": "microsoft", "oauth_federated_token_file": "microsoft",
                  "oauth_managed_identity": "microsoft", "oauth_service_account_file": "google"}
# the credentials of a token endpoint client, by provider (one of them is needed)
_CLIENT_CREDENTIALS = {
    "generic": ("oauth_client_secret_file", "oauth_refresh_token_file"),
    "microsoft": ("oauth_client_secret_file", "oauth_certificate_file",
                  "oauth_federated_token_file"),
}
# the module each provider's library is (the oauth extra)
_LIBRARY = {"microsoft": "msal", "google": "google.auth"}


class OAuthSettings(Section):
    """Where the smarthost's OAuth2 access tokens come from."""

    TITLE: ClassVar[str] = "OAuth2 tokens (smarthost XOAUTH2 / OAUTHBEARER)"
    # a reload compares their content (a new secret needs a restart); not the refresh token
    # file (the relay itself writes a rotated one there) nor the federated token (rotated by
    # its issuer, read for each token)
    FILES: ClassVar[tuple[str, ...]] = (
        "oauth_client_secret_file", "oauth_ca_file", "oauth_certificate_file",
        "oauth_service_account_file")

    oauth_provider: Literal["generic", "microsoft", "google"] = Field("generic", description=(
        "who issues the tokens: generic (the relay POSTs the client-credentials or "
        "refresh-token grant to oauth_token_url itself), microsoft (msal: a client secret, a "
        "certificate, workload identity or a managed identity) or google (google-auth: a "
        "service account with domain-wide delegation); microsoft and google need the oauth "
        "extra"))
    oauth_token_url: str | None = Field(None, description=(
        "OAuth2 token endpoint (https://login.microsoftonline.com/TENANT/oauth2/v2.0/token, "
        "https://oauth2.googleapis.com/token)"))
    oauth_client_id: str | None = Field(None, description="OAuth2 client (application) id")
    oauth_client_secret_file: Path | None = Field(None, description=(
        "file holding the OAuth2 client secret"))
    oauth_refresh_token_file: Path | None = Field(None, description=(
        "file holding an OAuth2 refresh token: the refresh-token grant (generic provider); "
        "without it, the client-credentials grant. Read again before each refresh; a "
        "refresh token the endpoint rotates is written back to this file (its folder "
        "writable: the workers lock .<name>.lock there)"))
    oauth_certificate_file: Path | None = Field(None, description=(
        "microsoft: PEM file holding the app registration's certificate and its unencrypted "
        "private key (a signed client assertion instead of a secret)"))
    oauth_federated_token_file: Path | None = Field(None, description=(
        "microsoft: file holding a federated token (workload identity: Kubernetes' projected "
        "service account token, the path of AZURE_FEDERATED_TOKEN_FILE), read for each "
        "token"))
    oauth_managed_identity: str | None = Field(None, description=(
        "microsoft: an Azure managed identity instead of a client: system, or the client id "
        "of a user-assigned identity (no oauth_token_url, client id or secret then)"))
    oauth_service_account_file: Path | None = Field(None, description=(
        "google: JSON key of a service account with domain-wide delegation; the token is "
        "for the mailbox upstream_user"))
    oauth_scope: str | None = Field(None, description=(
        "OAuth2 scope; unset: https://outlook.office365.com/.default (microsoft), "
        "https://mail.google.com/ (google), none (generic)"))
    oauth_ca_file: Path | None = Field(None, description=(
        "PEM CA certificates that sign the token endpoint's certificate (private endpoints, "
        "tests); default: the system's"))

    @model_validator(mode="after")
    def _check_oauth(self) -> OAuthSettings:
        if self.oauth_token_url is not None and not self.oauth_token_url.startswith("https://"):
            raise SettingsRuleError("oauth_token_url must be an https:// URL: the client "
                                    "secret and the tokens cross it", "oauth_token_url")
        provider = self.oauth_provider
        for name, owner in _PROVIDER_ONLY.items():
            if getattr(self, name) is not None and provider != owner:
                raise SettingsRuleError(f"{name} is read by oauth_provider = {owner} only "
                                        f"(it is {provider})", name, "oauth_provider")
        if provider == "microsoft":
            self._check_microsoft()
        library = _LIBRARY.get(provider)
        missing = extra_missing(library) if library is not None else None
        if missing is not None:
            raise SettingsRuleError(f"oauth_provider {provider}: {missing}", "oauth_provider")
        return self

    def _check_microsoft(self) -> None:
        """One credential; the token endpoint Entra's shape (its authority is msal's)."""
        from relay.upstream.oauth import entra_authority

        if self.oauth_refresh_token_file is not None:
            raise SettingsRuleError(
                "oauth_refresh_token_file is the generic provider's refresh-token grant "
                "(oauth_provider = generic)", "oauth_refresh_token_file", "oauth_provider")
        given = [name for name in (*_CLIENT_CREDENTIALS["microsoft"], "oauth_managed_identity")
                 if getattr(self, name) is not None]
        if len(given) > 1:
            raise SettingsRuleError(f"oauth_provider microsoft takes one credential, got "
                                    f"{' and '.join(given)}", *given)
        if self.oauth_token_url is not None and self.oauth_managed_identity is None:
            try:
                entra_authority(self.oauth_token_url)
            except ValueError as exc:
                raise SettingsRuleError(f"oauth_token_url: {exc}", "oauth_token_url") from None

    def oauth_missing(self) -> list[str]:
        """The settings (or ``a or b`` alternatives) ``oauth_provider`` still needs before it
        can fetch a token; empty when it can."""
        provider = self.oauth_provider
        if provider == "google":
            return [] if self.oauth_service_account_file is not None else [
                "oauth_service_account_file"]
        if provider == "microsoft" and self.oauth_managed_identity is not None:
            return []
        missing = [n for n in ("oauth_token_url", "oauth_client_id") if not getattr(self, n)]
        credentials = _CLIENT_CREDENTIALS[provider]
        if all(getattr(self, name) is None for name in credentials):
            missing.append(" or ".join(credentials))
        return missing

    @property
    def oauth_scope_value(self) -> str | None:
        """``oauth_scope``, else the provider's default (:data:`DEFAULT_SCOPES`)."""
        return self.oauth_scope or DEFAULT_SCOPES.get(self.oauth_provider)

    def oauth_secret_values(self) -> tuple[str | None, str | None]:
        """The OAuth2 client secret and refresh token, read from their files (None where no
        file is set). Raises ConfigError when a file cannot be read or holds nothing."""
        secret = refresh = None
        if self.oauth_client_secret_file is not None:
            secret = secret_setting(self.oauth_client_secret_file, "oauth_client_secret_file")
        if self.oauth_refresh_token_file is not None:
            refresh = secret_setting(self.oauth_refresh_token_file, "oauth_refresh_token_file")
        return secret, refresh

    def file_checks(self, *, live: bool) -> list[FileCheck]:
        """The secret files (read), the token endpoint's CA bundle, the certificate and
        service account key (loaded as the provider will load them), the federated token
        (read)."""
        checks: list[FileCheck] = [
            (("oauth_client_secret_file", "oauth_refresh_token_file"),
             self.oauth_secret_values)]
        if self.oauth_ca_file is not None:
            path = self.oauth_ca_file
            checks.append((("oauth_ca_file",), ca_bundle(path, f"{path}: no PEM CA file")))
        if self.oauth_certificate_file is not None:
            checks.append((("oauth_certificate_file",), self._certificate))
        if self.oauth_service_account_file is not None:
            checks.append((("oauth_service_account_file",), self._service_account))
        if self.oauth_federated_token_file is not None:
            path = self.oauth_federated_token_file
            checks.append((("oauth_federated_token_file",),
                           lambda: secret_setting(path, "oauth_federated_token_file")))
        if self.oauth_managed_identity is not None:
            checks.append((("oauth_managed_identity",),
                           lambda: managed_identity_endpoints(os.environ)))
        return checks

    def secret_files(self) -> list[SecretFile]:
        """The client secret, the refresh token, the certificate's private key, the service
        account's key and the federated token."""
        return [(name, path) for name in (
            "oauth_client_secret_file", "oauth_refresh_token_file", "oauth_certificate_file",
            "oauth_service_account_file", "oauth_federated_token_file")
            for path in [getattr(self, name)] if path is not None]

    def _certificate(self) -> dict[str, str]:
        from relay.upstream.oauth_libraries import load_certificate

        assert self.oauth_certificate_file is not None
        return _loaded(load_certificate, self.oauth_certificate_file, "oauth_certificate_file")

    def _service_account(self) -> dict[str, Any]:
        from relay.upstream.oauth_libraries import load_service_account

        assert self.oauth_service_account_file is not None
        return _loaded(load_service_account, self.oauth_service_account_file,
                       "oauth_service_account_file")

    def token_provider(self, *, mailbox: str | None, timeout_s: float, shared: bool = True,
                       on_failure: Callable[[str], None] | None = None
                       ) -> TokenProvider | None:
        """The token provider of smarthost AUTH XOAUTH2 / OAUTHBEARER (one per process, shared
        by every upstream that uses it), None while ``oauth_provider`` lacks a setting
        (:meth:`oauth_missing`). ``mailbox``: the user a Google token is for; ``timeout_s``:
        each token request's bound; ``shared``: several workers refresh the token (never
        without its lock); ``on_failure``: called with the kind of each failed fetch. Reads
        the secret files once (a new secret needs a restart); raises ConfigError when one is
        bad."""
        from relay.upstream.oauth import TokenProvider

        if self.oauth_missing():
            return None
        return TokenProvider(self._source(mailbox, timeout_s, shared), on_failure=on_failure)

    def _source(self, mailbox: str | None, timeout_s: float, shared: bool) -> TokenSource:
        from relay.upstream.oauth import FormGrant, OAuthConfig

        scope, ca = self.oauth_scope_value, self.oauth_ca_file
        if self.oauth_provider == "generic":
            assert self.oauth_token_url is not None and self.oauth_client_id is not None
            secret, refresh = self.oauth_secret_values()
            return FormGrant(OAuthConfig(
                token_url=self.oauth_token_url, client_id=self.oauth_client_id,
                client_secret=secret, refresh_token=refresh, scope=scope, ca_file=ca,
                timeout_s=timeout_s, refresh_token_file=self.oauth_refresh_token_file,
                shared=shared))
        from relay.upstream import oauth_libraries as libraries

        assert scope is not None
        if self.oauth_provider == "google":
            if not mailbox:
                raise ConfigError("oauth_provider google: the token is for upstream_user, "
                                  "which is unset")
            return libraries.GoogleServiceAccount(
                info=self._service_account(), subject=mailbox, scope=scope, ca_file=ca,
                timeout_s=timeout_s)
        if self.oauth_managed_identity is not None:
            return libraries.EntraManagedIdentity(
                identity=self.oauth_managed_identity, scope=scope, ca_file=ca,
                timeout_s=timeout_s)
        assert self.oauth_token_url is not None and self.oauth_client_id is not None
        secret, _ = self.oauth_secret_values()
        credential = libraries.EntraCredential(
            client_secret=secret,
            certificate=self._certificate() if self.oauth_certificate_file else None,
            federated_token_file=self.oauth_federated_token_file)
        return libraries.EntraClient(
            token_url=self.oauth_token_url, client_id=self.oauth_client_id,
            credential=credential, scope=scope, ca_file=ca, timeout_s=timeout_s)


# the environment variables whose URL msal's managed identity asks for its token
_MANAGED_IDENTITY_ENDPOINTS = ("IDENTITY_ENDPOINT", "MSI_ENDPOINT",
                               "AZURE_POD_IDENTITY_AUTHORITY_HOST")


def managed_identity_endpoints(env: Mapping[str, str]) -> None:
    """Raise ConfigError naming the variable when an endpoint of a managed identity the
    environment ``env`` names is one a token may not cross
    (:func:`relay.core.http_rules.endpoint_refusal`: https, else loopback or link-local)."""
    for name in _MANAGED_IDENTITY_ENDPOINTS:
        url = env.get(name)
        why = None if url is None else endpoint_refusal(url, link_local=True)
        if why is not None:
            raise ConfigError(f"oauth_managed_identity: {name} {printable_excerpt(str(url))}: "
                              f"{why}: the managed identity's token would cross it")


def _loaded(load: Callable[[Path], _T], path: Path, setting: str) -> _T:
    """``load(path)``; its ValueError or OSError as a ConfigError naming ``setting``."""
    try:
        result = load(path)
    except ValueError as exc:
        raise ConfigError(f"{setting}: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{setting}: {exc.strerror}: {path}") from None
    return result
