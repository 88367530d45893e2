"""Warm start: the prefix sequence saved to disk and restored instead of re-prefilled.

A snapshot is keyed by everything that changes the bytes in the KV cells: the model
file's hash, the prefix token hash, and the context parameters that shape the cache
(cells, sequences, SWA mode, unified). A snapshot that does not load, or whose tokens
differ from the prefix, is deleted and rebuilt: it can only ever cost a prefill. That is
said once, as a warning on this module's logger (``mesh serve`` prints it as one line), so
an operator whose warm start silently became a cold one knows why.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

from mesh.engine.llama import LlamaContext

__all__ = ["restore", "save", "snapshot_path"]

_FORMAT = "v1"

logger = logging.getLogger(__name__)


def _model_key(model_path: str) -> str:
    """A cheap, stable key for the model file: its sha256 when the memo has it, else
    its resolved path, size and mtime (a changed file changes the key either way)."""
    try:
        from mesh.engine.models import file_sha256

        return file_sha256(Path(model_path))
    except Exception:
        st = os.stat(model_path)
        return f"{Path(model_path).resolve()}:{st.st_size}:{st.st_mtime_ns}"


def snapshot_path(cache_dir: Path, model_path: str, prefix_hash: str, ctx_key: str) -> Path:
    key = hashlib.sha256(
        f"{_FORMAT}|{_model_key(model_path)}|{prefix_hash}|{ctx_key}".encode()
    ).hexdigest()[:32]
    return cache_dir / f"prefix-{key}.kv"


def save(ctx: LlamaContext, path: Path, seq: int, tokens: list[int]) -> bool:
    """Write the snapshot atomically (temp file + rename). Failure is not fatal."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        written = ctx.save_seq(tmp, seq, tokens)
        if written <= 0:
            tmp.unlink(missing_ok=True)
            return False
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def restore(ctx: LlamaContext, path: Path, seq: int, tokens: list[int]) -> bool:
    """Load the snapshot into ``seq``; True only if it holds exactly ``tokens``.

    A snapshot that is there but unusable is removed (from ``seq`` and from disk) and
    reported as a warning naming the file and what was wrong; the caller then rebuilds it.
    """
    if not path.is_file():
        return False
    loaded = ctx.load_seq(path, seq, capacity=len(tokens))
    if loaded is None:
        problem = "llama.cpp could not load it"
    elif loaded != tokens:
        problem = f"it holds {len(loaded)} tokens that are not this prefix's {len(tokens)}"
    else:
        lo, hi = ctx.seq_pos_range(seq)
        # With an iSWA cache (Gemma 3) the restored sliding-window part holds only the
        # last window of positions, so the minimum can be above 0; SWA layers never
        # attend further back, so generation is unaffected.
        if 0 <= lo <= hi == len(tokens) - 1:
            return True
        problem = f"its cells hold positions {lo}..{hi}, not 0..{len(tokens) - 1}"
    ctx.seq_remove(seq)  # a partial or stale restore must leave nothing behind
    with contextlib.suppress(OSError):
        path.unlink()
    logger.warning("prefix snapshot at %s is corrupt (%s); rebuilding it", path, problem)
    return False
