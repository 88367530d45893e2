"""Fixtures shared by the whole suite. A test that needs a model makes it; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.engine.models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight ``llama`` GGUF (seed 0), written once per session."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight ``gemma3`` GGUF (sliding window, iSWA cache), seed 0."""
    return write_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny-gemma3.gguf", variant="gemma3"
    )
