"""Fixtures of the SMTP-side tests: one PKI per module (test_security, test_handler_data)."""

from __future__ import annotations

import pytest

from tests.support.pki import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA and a certificate for 127.0.0.1 / relay.test, shared by one module's tests."""
    return make_pki(tmp_path_factory.mktemp("pki"))
