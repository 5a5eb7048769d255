"""Fixtures of the core tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from tests.support.relays import REDIS_URL, delete_prefix


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A random key prefix, deleted afterwards."""
    p = f"test:{uuid.uuid4().hex}:"
    yield p
    delete_prefix(REDIS_URL, p)
