"""A throwaway PostgreSQL for this folder's tests (:mod:`bench.common.postgres`): started once per
session on a free loopback port, stopped and deleted at the end; a fresh database per test.

Never skipped: where ``initdb`` is missing the tests fail, saying how to install it
(``scripts/test.sh`` installs Debian's ``postgresql`` when run as root).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest

from bench.common.postgres import PostgresMissing, Throwaway, throwaway_postgres

_numbers = itertools.count(1)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Throwaway]:
    try:
        with throwaway_postgres() as server:
            yield server
    except PostgresMissing as exc:
        pytest.fail(f"the PostgreSQL tests need a local PostgreSQL: {exc}", pytrace=False)


@pytest.fixture
def pg_url(postgres_server: Throwaway) -> str:
    """A URL of a fresh, empty database on the throwaway server."""
    import asyncpg

    name = f"test_{next(_numbers)}"

    async def create() -> None:
        conn = await asyncpg.connect(postgres_server.url)
        try:
            await conn.execute(f"CREATE DATABASE {name}")
        finally:
            await conn.close()

    asyncio.run(create())
    return postgres_server.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
