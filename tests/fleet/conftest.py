"""Fixtures of the peer (fleet) tests: asyncio only (anyio would also run each test on trio)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
