"""An :class:`OpenAIEngine` on a given server URL with the tiny model's tokenizer: the
backend tests' one way to open the engine, whatever serves the OpenAI wire."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from mesh.backends.openai import BackendConfig, OpenAIEngine
from mesh.engine.llama import LlamaModel
from tests.backends.conftest import tiny_path


@contextlib.asynccontextmanager
async def tiny_openai_engine(url: str, prefix: str, cache: Path) -> AsyncIterator[OpenAIEngine]:
    """Started on enter (4 sessions of 256 tokens), closed on exit."""
    vocab = LlamaModel(str(tiny_path(cache)), vocab_only=True)
    eng = OpenAIEngine(
        BackendConfig(url=url, max_sessions=4, session_budget=256),
        prefix,
        tokenize=lambda t: vocab.tokenize(t, add_bos=False),
        prefix_ids=vocab.tokenize(prefix, add_bos=vocab.add_bos),
        on_close=vocab.close,
    )
    await eng.start()
    try:
        yield eng
    finally:
        await eng.aclose()
