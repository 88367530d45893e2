"""Which engine ``mesh serve`` builds: the local pool, pools as Ray actors (``--ray``), or
``--engine openai:URL``.

The CLI builds objects; this keeps ``serve.py``'s part to one call.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
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
    p.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="run the pools as Ray actors (pip install mesh[cluster]): auto joins "
                        "this machine's Ray cluster or starts one; ADDRESS (HOST:PORT of the "
                        "head, as `ray start --head` prints it) joins that cluster. Each pool "
                        "is one actor with --max-sessions sessions; --model and --prefix-cache "
                        "must be readable at the same paths on every node")
    p.add_argument("--ray-pools", type=int, default=2, metavar="N",
                   help="pool actors to place with --ray (default 2)")
    p.add_argument("--ray-gpus", type=float, default=0.0, metavar="G",
                   help="GPUs each pool actor asks Ray for (default 0; 1 for a pool per GPU)")
    p.add_argument("--ray-memory", type=float, default=0.0, metavar="GIB",
                   help="RAM (GiB) each pool actor reserves on its node (default: none)")
    p.add_argument("--prefix-cache", default=None, metavar="DIR",
                   help="prefix snapshot directory, shareable between machines (snapshots are "
                        "keyed by model file hash, prefix hash and context shape; default "
                        "DATA_DIR/prefix-cache)")


def build_engine(args: argparse.Namespace, cfg: EngineConfig, prefix_text: str) -> Any:
    """The engine ``args.engine`` names, not started (``await engine.start(progress)``)."""
    from mesh.backends.openai import BackendConfig, OpenAIEngine
    from mesh.backends.remote_wire import parse_engine_spec

    url = parse_engine_spec(getattr(args, "engine", "llama.cpp"))
    if url is None and getattr(args, "ray", None):
        return _ray_pools(args, cfg, prefix_text)
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


def _ray_pools(args: argparse.Namespace, cfg: EngineConfig, prefix_text: str) -> Any:
    """``--ray``: join or start the cluster (ValueError naming ``--ray`` when it cannot be
    reached), then the pools as actors, not started. Paths become absolute: an actor runs in
    Ray's own working directory."""
    from mesh.cluster.connect import connect, parse_ray_address
    from mesh.cluster.pools import PoolPlacement, RayPools
    from mesh.engine.llama import LlamaModel
    from mesh.engine.pool import SharedKVPool

    print(connect(parse_ray_address(args.ray)), file=sys.stderr)
    cfg = dataclasses.replace(
        cfg, model_path=str(Path(cfg.model_path).resolve()),
        cache_dir=str(Path(cfg.cache_dir).resolve()) if cfg.cache_dir else cfg.cache_dir)
    vocab = LlamaModel(cfg.model_path, vocab_only=True)
    placement = PoolPlacement(num_cpus=float(cfg.n_threads or 1), num_gpus=args.ray_gpus,
                              memory=int(args.ray_memory * 2**30))
    return RayPools(functools.partial(SharedKVPool, cfg, prefix_text),
                    num_pools=args.ray_pools, placement=placement,
                    tokenize=lambda text: vocab.tokenize(text, add_bos=False),
                    on_close=vocab.close)


def prefix_cache_dir(args: argparse.Namespace, data_dir: Path) -> str:
    """``--prefix-cache DIR`` or ``DATA_DIR/prefix-cache``."""
    return str(Path(args.prefix_cache) if args.prefix_cache else data_dir / "prefix-cache")
