"""Fixtures of the console tests: the browsers a test opens."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.console import Browser


@pytest.fixture
async def web() -> AsyncIterator[list[Browser]]:
    """The browsers a test opened (closed at its end)."""
    opened: list[Browser] = []
    yield opened
    for b in opened:
        await b.http.close()
