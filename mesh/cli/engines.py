"""Which engine ``mesh serve`` builds: the local pool, or ``--engine openai:URL``.

The CLI builds objects; this keeps ``serve.py``'s part to one call.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from mesh.engine.config import EngineConfig

__all__ = ["add_engine_args", "build_engine"]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="llama.cpp", metavar="llama.cpp|openai:URL",
                   help="llama.cpp: the local shared KV pool (default); openai:URL: run "
                        "sessions on an OpenAI-compatible /v1/completions server (vLLM, "
                        "SGLang, llama-server, another mesh) at URL; --model then names the "
                        "same model's GGUF, for its tokenizer and chat format; the backend's "
                        "key: $MESH_BACKEND_API_KEY")
    p.add_argument("--backend-model", default=None,
                   help="model id to request from --engine openai:URL (default: the first "
                        "GET /v1/models lists)")
    p.add_argument("--node", action="append", default=[], metavar="URL",
                   help="route subtasks over A2A to this mesh server (repeatable): no local "
                        "pool; each node's prefix hash must equal this coordinator's; its "
                        "token: $MESH_NODE_TOKEN")
    p.add_argument("--prefix-cache", default=None, metavar="DIR",
                   help="prefix snapshot directory, shareable between nodes (snapshots are "
                        "keyed by model file hash, prefix hash and context shape; default "
                        "DATA_DIR/prefix-cache)")


def build_engine(args: argparse.Namespace, cfg: EngineConfig, prefix_text: str) -> Any:
    """The engine ``args.engine`` names, not started (``await engine.start(progress)``)."""
    from mesh.backends.openai import BackendConfig, OpenAIEngine
    from mesh.backends.remote_wire import parse_engine_spec

    url = parse_engine_spec(getattr(args, "engine", "llama.cpp"))
    if url is None:
        from mesh.engine.pool import SharedKVPool

        return SharedKVPool(cfg, prefix_text)
    from mesh.engine.llama import LlamaModel

    vocab = LlamaModel(cfg.model_path, vocab_only=True)
    backend = BackendConfig(url=url, model=args.backend_model, max_sessions=cfg.max_sessions,
                            session_budget=cfg.session_budget,
                            api_key=os.environ.get("MESH_BACKEND_API_KEY"))
    return OpenAIEngine(backend, prefix_text,
                        tokenize=lambda text: vocab.tokenize(text, add_bos=False),
                        prefix_ids=vocab.tokenize(prefix_text, add_bos=vocab.add_bos),
                        on_close=vocab.close)


def prefix_cache_dir(args: argparse.Namespace, data_dir: Path) -> str:
    """``--prefix-cache DIR`` or ``DATA_DIR/prefix-cache``."""
    return str(Path(args.prefix_cache) if args.prefix_cache else data_dir / "prefix-cache")
