"""Fixtures of the nodes tests: real ``mesh serve --model tiny`` processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.serve_proc import ServeProc, running, small_project


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_project(tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory, cache: Path,
            project: Path) -> Iterator[ServeProc]:
    """A real OpenAI-compatible server: mesh's own ``/v1/completions`` on the tiny model
    (llama.cpp decoding), ungated (``--policy none``: the front's gate admits)."""
    root = tmp_path_factory.mktemp("backend")
    with running(root / "data", project, cache, "--policy", "none") as served:
        yield served


def tiny_path(cache: Path) -> Path:
    """The tiny GGUF the served processes wrote (same file, so the same tokenizer)."""
    path = cache / "mesh" / "models" / "mesh-tiny-llama-v1.gguf"
    assert path.is_file(), f"no tiny model at {path}"
    return path
