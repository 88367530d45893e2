"""``mesh serve``'s engine flags: the native step, GPU offload, flash attention, shared-prefix
attention, the KV cache type, and the KV tier picked from a memory size
(``--kv-memory GiB|auto``)."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from mesh.engine.config import (
    FLASH_ATTN,
    GIB,
    KV_TYPES,
    PREFIX_ATTENTION,
    EngineConfig,
    KVShape,
    Tier,
    choose_tier,
)
from mesh.engine.llama import LlamaModel

__all__ = ["add_engine_flags", "apply_engine_flags", "engine_options", "free_gpu_bytes",
           "kv_memory_bytes", "pick_tier"]

_HEADROOM = 1.0  # GiB left for compute buffers when --kv-memory auto reads the GPU


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--native", choices=("auto", "on", "off"), default="auto",
                   help="the native step (native/, built at install): auto uses it when "
                        "built, on requires it, off runs the Python step")
    p.add_argument("--gpu-layers", type=int, default=-1,
                   help="model layers to offload to the GPU (-1: all; 0: none; needs "
                        "llama-cpp-python built with a GPU backend)")
    p.add_argument("--flash-attn", choices=FLASH_ATTN, default="auto",
                   help="llama.cpp flash attention (default auto: the path measured "
                        "fastest for the device, KV type, prefix length and --max-sessions)")
    p.add_argument("--prefix-attention", choices=PREFIX_ATTENTION, default="auto",
                   help="decode rows attend the shared prefix together (mesh's llama.cpp "
                        "patch, CPU): shared requires it and turns flash attention on; off "
                        "keeps llama.cpp's path; auto (default): shared where the patch is "
                        "built and the pool runs on the CPU")
    p.add_argument("--kv-type", choices=KV_TYPES, default=None,
                   help="KV cache element type (default f16, or what --kv-memory picks)")
    p.add_argument("--max-attached", type=int, default=None,
                   help="sessions that may be attached at once, parked ones included "
                        "(default 4 x --max-sessions); idle sessions are parked off the KV "
                        "cache when a session needs room and come back before their next turn")
    p.add_argument("--park-idle", type=float, default=None, metavar="SECONDS",
                   help="also park a session idle this long (default: only when room is "
                        "needed)")
    p.add_argument("--park-memory", type=float, default=1.0, metavar="GiB",
                   help="host memory for parked sessions' KV (swap: exact, ~20 ms a resume "
                        "here); past it, or at 0, a parked session is re-prefilled (default 1)")
    p.add_argument("--kv-memory", default=None, metavar="GiB|auto",
                   help="memory the KV cache may use: picks the KV type (f16 > q8_0 > "
                        "q4_0) at which --max-sessions sessions fit, and as many session "
                        "slots as fit; auto: free GPU memory (nvidia-smi) less the model")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the flags (before any tier)."""
    native = {"auto": None, "on": True, "off": False}[args.native]
    if args.park_memory < 0:
        raise ValueError(f"--park-memory must be >= 0 GiB, got {args.park_memory:g}")
    return {"native": native, "n_gpu_layers": args.gpu_layers, "flash_attn": args.flash_attn,
            "prefix_attention": args.prefix_attention, "kv_type": args.kv_type or "f16",
            "max_attached": args.max_attached,
            "park_idle_s": args.park_idle, "park_memory": int(args.park_memory * GIB)}


def free_gpu_bytes() -> int | None:
    """Free memory of the first NVIDIA GPU, from nvidia-smi (None without one)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.split()[0]) * 1024 * 1024
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def kv_memory_bytes(spec: str, model_path: str) -> int:
    """``--kv-memory``: GiB as a number, or ``auto`` (free GPU memory less the model file
    and 1 GiB of headroom). ValueError naming the fix."""
    if spec == "auto":
        free = free_gpu_bytes()
        if free is None:
            raise ValueError("--kv-memory auto found no GPU (nvidia-smi); pass --kv-memory "
                             "GiB, the memory the KV cache may use")
        return int(free - Path(model_path).stat().st_size - _HEADROOM * GIB)
    try:
        gib = float(spec)
    except ValueError:
        raise ValueError(f"--kv-memory takes GiB (e.g. 12) or auto, got {spec!r}") from None
    if gib <= 0:
        raise ValueError(f"--kv-memory must be positive, got {spec}")
    return int(gib * GIB)


def pick_tier(args: argparse.Namespace, model_path: str, prefix_tokens: int,
              shape: KVShape) -> Tier | None:
    """The tier for ``--kv-memory`` (None without it). An explicit ``--kv-type`` is kept:
    only the session slots are sized then."""
    if args.kv_memory is None:
        return None
    memory = kv_memory_bytes(args.kv_memory, model_path)
    types = (args.kv_type,) if args.kv_type is not None else KV_TYPES
    tier = choose_tier(shape, memory, prefix_tokens=prefix_tokens,
                       session_budget=args.session_budget, want_sessions=args.max_sessions,
                       types=types)
    if tier.kv_type != "f16" and args.flash_attn == "off":
        raise ValueError(f"--kv-memory picked a {tier.kv_type} cache, which needs flash "
                         "attention; drop --flash-attn off or pass --kv-type f16")
    return tier


def apply_engine_flags(cfg: EngineConfig, args: argparse.Namespace,
                       prefix_text: str) -> EngineConfig:
    """``cfg`` with the engine flags applied; with ``--kv-memory``, the tier it picks
    (KV type, session slots, cells), printed with the capacity it gives."""
    cfg = dataclasses.replace(cfg, **engine_options(args))
    if args.kv_memory is None:
        return cfg
    vocab = LlamaModel(cfg.model_path, vocab_only=True)
    try:
        prefix = len(vocab.tokenize(prefix_text, add_bos=vocab.add_bos))
        layers, kv_heads, head_k, head_v, _ = vocab.kv_shape()
    finally:
        vocab.close()
    shape = KVShape(layers=layers, kv_heads=kv_heads, head_k=head_k, head_v=head_v)
    tier = pick_tier(args, cfg.model_path, prefix, shape)
    assert tier is not None
    print(tier.describe(), file=sys.stderr)
    return dataclasses.replace(cfg, kv_type=tier.kv_type, max_sessions=tier.sessions,
                               n_ctx=tier.n_ctx)
