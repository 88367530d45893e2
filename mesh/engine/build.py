"""A pool's native state at start: the model, the context, the prefix (decoded once or
restored from the warm-start cache).

**Warm start.** The prefix sequence saved to disk and restored instead of re-prefilled. A
snapshot is keyed by everything that changes the bytes in the KV cells: the model file's
hash, the prefix token hash, and the context parameters that shape the cache (cells,
sequences, SWA mode, unified). A snapshot that does not load, or whose tokens differ from
the prefix, is deleted and rebuilt: it can only ever cost a prefill. That is said once, as a
warning on this module's logger (``mesh serve`` prints it as one line), so an operator
whose warm start silently became a cold one knows why.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mesh.engine import llama
from mesh.engine.config import (
    EngineConfig,
    KVShape,
    elements_per_block,
    resolve_flash_attn,
    resolve_prefix_attention,
)
from mesh.engine.interface import PoolInfo
from mesh.engine.llama import Batch, LlamaContext, LlamaModel, gpu_offload_supported
from mesh.engine.models import cpu_weights

__all__ = [
    "PREFIX_SEQ", "Built", "Progress", "build", "check_context", "resolve_attention",
    "restore_snapshot", "save_snapshot", "snapshot_path"
]


# -------------------- warm start ----------------------------------------------

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


def save_snapshot(ctx: LlamaContext, path: Path, seq: int, tokens: list[int]) -> bool:
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


def restore_snapshot(ctx: LlamaContext, path: Path, seq: int, tokens: list[int]) -> bool:
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

# -------------------- the build -----------------------------------------------

Progress = Callable[[int, int], None]
PREFIX_SEQ = 0


@dataclass
class Built:
    model: LlamaModel
    ctx: LlamaContext
    batch: Batch
    prefix: list[int]
    info: PoolInfo
    shared_cells: int  # cells the prefix sequence holds (0 in naive mode)


def build(cfg: EngineConfig, prefix_input: str | list[int], progress: Progress | None) -> Built:
    """Load the model, size and create the context, build or restore the prefix."""
    t0 = time.monotonic()
    on_gpu = cfg.n_gpu_layers != 0 and gpu_offload_supported()
    weights = cpu_weights(cfg.model_path, cfg.weights, on_gpu=on_gpu,
                          threads=cfg.n_threads or 0)
    model = LlamaModel(weights.path, n_gpu_layers=cfg.n_gpu_layers,
                       extra_buffers=cfg.extra_buffers or weights.extra_buffers)
    try:
        built = _build(cfg, model, prefix_input, progress, t0, str(weights.path), on_gpu)
        built.info = replace(built.info, weights=weights.described)
        return built
    except BaseException:
        model.close()
        raise


def _build(cfg: EngineConfig, model: LlamaModel, prefix_input: str | list[int],
           progress: Progress | None, t0: float, loaded: str, on_gpu: bool) -> Built:
    if isinstance(prefix_input, str):
        tokens = model.tokenize(prefix_input, add_bos=model.add_bos)
    else:
        tokens = list(prefix_input)
    if not tokens:
        raise ValueError("the prefix is empty; a pool needs at least one prefix token")
    check_context(model.n_ctx_train, len(tokens), cfg.session_budget, model.description)
    if cfg.kv_type != "f16":
        layers, kv_heads, head_k, head_v, _ = model.kv_shape()
        if not KVShape(layers, kv_heads, head_k, head_v).supports(cfg.kv_type):
            raise ValueError(
                f"a {cfg.kv_type} KV cache needs heads of whole {elements_per_block(cfg.kv_type)}"
                f"-element blocks; {model.description} has heads of {head_k} elements: "
                "use --kv-type f16")
    if cfg.share_prefix:
        n_ctx = cfg.n_ctx or len(tokens) + cfg.suffix_cells  # one pool, sized to need
    else:
        n_ctx = cfg.n_ctx or cfg.max_sessions * (len(tokens) + cfg.session_budget)
    n_ctx = -(-n_ctx // 256) * 256  # llama.cpp pads the cache to 256 cells anyway
    if len(tokens) >= n_ctx:
        raise ValueError(
            f"the prefix is {len(tokens)} tokens but the KV buffer has {n_ctx} cells; "
            "raise n_ctx or shrink the prefix"
        )
    n_seq_max = cfg.max_sessions + 1
    threads = cfg.n_threads or os.cpu_count() or 1
    # n_outputs_max: at most one logits row per session per step. llama.cpp requires it to
    # be >= n_seq_max at construction; the default (n_batch rows of a 262K vocabulary)
    # would allocate a 514 MiB logits buffer.
    prefix_attention, flash_attn = resolve_attention(cfg, on_gpu=on_gpu,
                                                     prefix_tokens=len(tokens))
    ctx = LlamaContext(model, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=cfg.n_batch,
                       n_outputs_max=n_seq_max, n_threads=threads, swa_full=cfg.swa_full,
                       flash_attn=flash_attn, kv_type=cfg.kv_type)
    batch = Batch(cfg.n_batch)
    prefix_hash = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in tokens)).hexdigest()
    warm_started = False
    snap = None
    if cfg.cache_dir and cfg.share_prefix:
        # keyed by the file loaded: converted weights give other K/V than the source's
        snap = snapshot_path(Path(cfg.cache_dir), loaded, prefix_hash,
                                  ctx_key=_ctx_key(n_ctx, n_seq_max, cfg.swa_full, flash_attn,
                                                   prefix_attention))
        warm_started = restore_snapshot(ctx, snap, PREFIX_SEQ, tokens)
    if cfg.share_prefix and not warm_started:
        _prefill_prefix(ctx, batch, tokens, cfg.prefill_chunk, progress)
        if snap is not None:
            save_snapshot(ctx, snap, PREFIX_SEQ, tokens)
    elif cfg.share_prefix and progress is not None:
        progress(len(tokens), len(tokens))
    info = PoolInfo(
        model_path=str(cfg.model_path), model_name=model.description, n_ctx=ctx.n_ctx,
        n_seq_max=n_seq_max, max_sessions=cfg.max_sessions,
        session_budget=cfg.session_budget, n_vocab=model.n_vocab,
        prefix_tokens=len(tokens), prefix_hash=prefix_hash, warm_started=warm_started,
        build_s=time.monotonic() - t0, n_params=model.n_params,
        flash_attn=flash_attn, prefix_attention=prefix_attention,
        cell_bytes=KVShape(*model.kv_shape()[:4]).cell_bytes(cfg.kv_type),
    )
    shared = len(tokens) if cfg.share_prefix else 0  # naive: no shared prefix sequence
    return Built(model=model, ctx=ctx, batch=batch, prefix=tokens, info=info,
                 shared_cells=shared)


def resolve_attention(cfg: EngineConfig, *, on_gpu: bool, prefix_tokens: int) -> tuple[str, str]:
    """(prefix attention, flash attention) for this pool: ``shared``/``off`` and the mode
    handed to llama.cpp. Sets the shared-prefix kernel's switch for the process (it reads an
    environment variable, before the context's first decode); ValueError naming the fix
    when ``--prefix-attention shared`` cannot run."""
    # A naive pool (share_prefix False) has no prefix every row shares: 0 shared tokens.
    sharing = resolve_prefix_attention(
        cfg.prefix_attention, available=llama.shared_prefix_attn_available(),
        on_gpu=on_gpu, flash_attn=cfg.flash_attn,
        prefix_tokens=prefix_tokens if cfg.share_prefix else 0,
        min_prefix=llama.min_prefix(), disabled_by_env=llama.disabled_by_env())
    llama.set_shared_prefix_attn(sharing == "shared")
    # Rows that may decode at once: every session slot (a naive pool's rows hold private
    # prefix copies, which the table's shared-prefix measurements do not cover).
    flash_attn = resolve_flash_attn(cfg.flash_attn, cfg.kv_type, on_gpu=on_gpu,
                                    prefix_tokens=prefix_tokens, rows=cfg.max_sessions,
                                    shared_prefix=sharing == "shared")
    return sharing, flash_attn


def _ctx_key(n_ctx: int, n_seq_max: int, swa_full: bool, flash_attn: str,
             prefix_attention: str) -> str:
    """The warm-start snapshot's context key: what changes the prefix's cached K/V bytes.
    A snapshot does not restore across flash-attention modes (V is stored transposed
    without it); shared-prefix attention is keyed apart too (a different kernel)."""
    key = f"{n_ctx}:{n_seq_max}:{swa_full}:unified:fa-{flash_attn}"
    return key + (":pa-shared" if prefix_attention == "shared" else "")


def check_context(n_ctx_train: int, prefix: int, session_budget: int, name: str) -> None:
    """Every session reads positions up to prefix + its budget: past the model's training
    context it would decode garbage. ValueError naming the fix (n_ctx_train 0: unknown)."""
    if n_ctx_train > 0 and prefix + session_budget > n_ctx_train:
        raise ValueError(
            f"the prefix ({prefix} tokens) plus one session's budget ({session_budget}) "
            f"reaches position {prefix + session_budget}, past the {n_ctx_train}-token "
            f"context {name} was trained for; lower --prefix-tokens or --session-budget "
            "so they sum to at most that, or use a model trained for longer contexts")


def _prefill_prefix(ctx: LlamaContext, batch: Batch, tokens: list[int], chunk: int,
                    progress: Progress | None) -> None:
    for start in range(0, len(tokens), chunk):
        batch.clear()
        for i, tok in enumerate(tokens[start : start + chunk]):
            batch.add(tok, start + i, PREFIX_SEQ, False)
        rc = ctx.decode(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}) while building the prefix")
        if progress is not None:
            progress(min(start + chunk, len(tokens)), len(tokens))
