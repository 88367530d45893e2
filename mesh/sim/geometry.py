"""Random-weight GGUF models with the exact geometry of named real models.

Serving cost (step time, KV memory, capacity) depends on a model's geometry (layers, heads,
KV heads, head size, FFN width, vocabulary, quantization), not on its weights' values. A
real 8B model cannot travel to a GPU machine that reaches nothing and takes 64 MiB per
call; its geometry can: :data:`GEOMETRIES` holds each spec as a few numbers (Meta's
published configs for ``llama-3.1-8b`` and ``llama-3.2-1b``, with llama3 rope scaling;
``gemma-3-270m`` copied from the GGUF mesh ships, sliding window 512 on llama.cpp's default
5-local-then-1-global pattern), and :func:`write_geometry_model` writes the model in
seconds to a minute.

The weights: 2-D matrices in Q4_0, Q8_0 or F16 with standard deviation ``1/sqrt(fan_in)``
(a block's output as large as its input); norms exactly 1. To write 8B parameters quickly,
one pool of ~16.8M random values is quantized once (``gguf.quants.quantize``: valid block
scales, no NaN or Inf) and every tensor is that pool tiled from a random block offset, its
block scales multiplied by the tensor's gain. The tokenizer is the tiny models'
SentencePiece vocabulary (:func:`mesh.engine.models.add_vocabulary`) padded to the
geometry's size. Same arguments, same bytes.

    python -m mesh.sim.geometry llama-3.1-8b /tmp/llama8b.gguf [--type q4_0]
    python -m mesh.sim.geometry gemma-3-270m /tmp/g.gguf --scale-down 4   # a twin
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
from numpy.typing import NDArray

from mesh.engine.config import KVShape
from mesh.engine.models import add_vocabulary, vocabulary_size

__all__ = ["GEOMETRIES", "QTYPES", "Geometry", "TensorPlan", "plan", "write_geometry_model"]

Arch = Literal["llama", "gemma3"]
Q = gguf.GGMLQuantizationType
# name -> (ggml type of the 2-D weights, GGUF general.file_type)
QTYPES: dict[str, tuple[Q, int]] = {
    "q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
}
_POOL_BLOCKS = (1 << 19) + 3  # blocks of 32 in the random pool; odd, so rows do not align
_BLOCK = 32


@dataclass(frozen=True)
class Geometry:
    """A model's shape: everything serving cost depends on, nothing else."""

    name: str
    arch: Arch
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rope_theta: float
    rms_eps: float
    tied_output: bool
    sliding_window: int = 0  # gemma3: cells a local layer attends to
    # llama3 rope scaling (factor, low_freq_factor, high_freq_factor, original context)
    llama3_rope: tuple[float, float, float, int] | None = None

    def kv_shape(self) -> KVShape:
        return KVShape(self.n_layer, self.n_head_kv, self.head_dim, self.head_dim)

    def scaled_down(self, k: int) -> Geometry:
        """A twin ``k`` times smaller: fewer layers, heads and width, the same head size and
        GQA ratio, a vocabulary ``k`` times smaller (never below the tokenizer's)."""
        if k <= 1:
            return self
        ratio = self.n_head // self.n_head_kv
        kv = max(1, self.n_head_kv // k)

        def width(n: int) -> int:  # quantized rows are whole 32-element blocks
            return max(_BLOCK, n // k // _BLOCK * _BLOCK)

        return dataclasses.replace(
            self, name=f"{self.name}/{k}", n_layer=max(2, self.n_layer // k),
            n_embd=width(self.n_embd), n_head=kv * ratio, n_head_kv=kv, n_ff=width(self.n_ff),
            n_vocab=max(vocabulary_size(), self.n_vocab // k))


GEOMETRIES: dict[str, Geometry] = {g.name: g for g in (
    Geometry("llama-3.1-8b", "llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=8,
             head_dim=128, n_ff=14336, n_vocab=128256, n_ctx_train=131072,
             rope_theta=500000.0, rms_eps=1e-5, tied_output=False,
             llama3_rope=(8.0, 1.0, 4.0, 8192)),
    Geometry("llama-3.2-1b", "llama", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8,
             head_dim=64, n_ff=8192, n_vocab=128256, n_ctx_train=131072,
             rope_theta=500000.0, rms_eps=1e-5, tied_output=True,
             llama3_rope=(32.0, 1.0, 4.0, 8192)),
    Geometry("gemma-3-270m", "gemma3", n_layer=18, n_embd=640, n_head=4, n_head_kv=1,
             head_dim=256, n_ff=2048, n_vocab=262144, n_ctx_train=32768,
             rope_theta=1000000.0, rms_eps=1e-6, tied_output=True, sliding_window=512),
)}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor: GGUF name, numpy shape (rows, cols) or (n,), and whether it is a norm
    (F32 ones) rather than a weight matrix (quantized, std ``1/sqrt(cols)``)."""

    name: str
    shape: tuple[int, ...]
    kind: Literal["weight", "norm", "rope_freqs"]

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def plan(g: Geometry) -> list[TensorPlan]:
    """Every tensor of ``g`` in file order (llama.cpp checks each shape when it loads)."""
    q, kv = g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    out = [TensorPlan("token_embd.weight", (g.n_vocab, g.n_embd), "weight"),
           TensorPlan("output_norm.weight", (g.n_embd,), "norm")]
    if not g.tied_output:
        out.append(TensorPlan("output.weight", (g.n_vocab, g.n_embd), "weight"))
    if g.llama3_rope is not None:
        out.append(TensorPlan("rope_freqs.weight", (g.head_dim // 2,), "rope_freqs"))
    for i in range(g.n_layer):
        b = f"blk.{i}."
        out += [TensorPlan(b + "attn_norm.weight", (g.n_embd,), "norm"),
                TensorPlan(b + "attn_q.weight", (q, g.n_embd), "weight"),
                TensorPlan(b + "attn_k.weight", (kv, g.n_embd), "weight"),
                TensorPlan(b + "attn_v.weight", (kv, g.n_embd), "weight"),
                TensorPlan(b + "attn_output.weight", (g.n_embd, q), "weight"),
                TensorPlan(b + "ffn_norm.weight", (g.n_embd,), "norm"),
                TensorPlan(b + "ffn_gate.weight", (g.n_ff, g.n_embd), "weight"),
                TensorPlan(b + "ffn_up.weight", (g.n_ff, g.n_embd), "weight"),
                TensorPlan(b + "ffn_down.weight", (g.n_embd, g.n_ff), "weight")]
        if g.arch == "gemma3":
            out += [TensorPlan(b + "attn_q_norm.weight", (g.head_dim,), "norm"),
                    TensorPlan(b + "attn_k_norm.weight", (g.head_dim,), "norm"),
                    TensorPlan(b + "post_attention_norm.weight", (g.n_embd,), "norm"),
                    TensorPlan(b + "post_ffw_norm.weight", (g.n_embd,), "norm")]
    return out


def _rope_freqs(g: Geometry) -> NDArray[np.float32]:
    """llama3 rope scaling factors, as llama.cpp's converter computes them."""
    assert g.llama3_rope is not None
    factor, low, high, old_ctx = g.llama3_rope
    freqs = 1.0 / g.rope_theta ** (np.arange(0, g.head_dim, 2) / g.head_dim)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


class _Pool:
    """One quantized pool of standard-normal values; tensors are tiled from it."""

    def __init__(self, qtype: Q, rng: np.random.Generator, blocks: int) -> None:
        self.qtype = qtype
        values = rng.standard_normal(blocks * _BLOCK, dtype=np.float32).reshape(-1, _BLOCK)
        if qtype == Q.F16:
            self.blocks: NDArray[np.uint8] = values.astype(np.float16).view(np.uint8)
        else:
            self.blocks = gguf.quants.quantize(values, qtype)  # (blocks, bytes per block)
        self._scaled: dict[float, NDArray[np.uint8]] = {}

    def scaled(self, gain: float) -> NDArray[np.uint8]:
        """The pool with every value multiplied by ``gain`` (block scales, or F16 values)."""
        if gain not in self._scaled:
            out = self.blocks.copy()
            if self.qtype == Q.F16:
                f = out.view(np.float16)
                f *= np.float16(gain)
            else:  # Q4_0 and Q8_0 blocks start with their fp16 scale d
                d = out[:, :2].copy().view(np.float16)
                out[:, :2] = (d.astype(np.float32) * gain).astype(np.float16).view(np.uint8)
            self._scaled[gain] = out
        return self._scaled[gain]

    def tensor(self, rows: int, cols: int, gain: float,
               rng: np.random.Generator) -> NDArray[np.uint8] | NDArray[np.float16]:
        pool = self.scaled(gain)
        n_blocks = rows * cols // _BLOCK
        start = int(rng.integers(len(pool)))
        tiled = np.resize(np.roll(pool, -start, axis=0), (n_blocks, pool.shape[1]))
        if self.qtype == Q.F16:
            return tiled.view(np.float16).reshape(rows, cols)
        return tiled.reshape(rows, -1)


def write_geometry_model(path: str | os.PathLike[str], geometry: Geometry | str, *,
                         qtype: str = "q4_0", seed: int = 0) -> Path:
    """Write a random-weight GGUF of ``geometry`` (a :class:`Geometry` or a name in
    :data:`GEOMETRIES`) to ``path`` and return the path. ValueError names the fix for an
    unknown name or quantization, or a width that is not whole 32-element blocks."""
    g = GEOMETRIES.get(geometry) if isinstance(geometry, str) else geometry
    if g is None:
        raise ValueError(f"unknown geometry {geometry!r}; use one of {sorted(GEOMETRIES)}")
    if qtype not in QTYPES:
        raise ValueError(f"unknown weight type {qtype!r}; use one of {sorted(QTYPES)}")
    if g.n_head % g.n_head_kv or any(n % _BLOCK for n in (g.n_embd, g.n_ff, g.head_dim)):
        raise ValueError(f"{g.name}: n_head must divide by n_head_kv, and n_embd, n_ff and "
                         "head_dim must be multiples of 32 (quantized blocks)")
    ggml_type, file_type = QTYPES[qtype]
    path = Path(path)
    rng = np.random.default_rng(seed)
    tensors = plan(g)
    blocks = min(_POOL_BLOCKS, max(t.n_elements for t in tensors) // _BLOCK + 1)
    pool = _Pool(ggml_type, rng, blocks)

    w = gguf.GGUFWriter(path, g.arch)
    _add_metadata(w, g, qtype, file_type)
    n_vocab = add_vocabulary(w, g.n_vocab)
    assert n_vocab == g.n_vocab, (n_vocab, g.n_vocab)
    for t in tensors:
        if t.kind == "weight":
            rows, cols = t.shape
            if ggml_type == Q.F16:
                w.add_tensor_info(t.name, t.shape, np.dtype(np.float16), t.n_elements * 2)
            else:
                size = gguf.GGML_QUANT_SIZES[ggml_type][1]
                byte_shape = (rows, cols // _BLOCK * size)
                w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), rows * byte_shape[1],
                                  raw_dtype=ggml_type)
        else:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_elements * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for data in _data(g, tensors, pool, rng):  # in add_tensor_info's order
        w.write_tensor_data(data)
    w.close()
    return path


def _data(g: Geometry, tensors: list[TensorPlan], pool: _Pool,
          rng: np.random.Generator) -> Iterator[NDArray[np.uint8] | NDArray[np.float16]
                                                | NDArray[np.float32]]:
    for t in tensors:
        if t.kind == "norm":
            yield np.ones(t.shape, dtype=np.float32)  # norms at 1: activations stay sane
        elif t.kind == "rope_freqs":
            yield _rope_freqs(g)
        else:
            rows, cols = t.shape
            yield pool.tensor(rows, cols, 1.0 / math.sqrt(cols), rng)


def _add_metadata(w: gguf.GGUFWriter, g: Geometry, qtype: str, file_type: int) -> None:
    w.add_name(f"mesh-geometry {g.name} (random weights, {qtype.upper()})")
    w.add_context_length(g.n_ctx_train)
    w.add_embedding_length(g.n_embd)
    w.add_block_count(g.n_layer)
    w.add_feed_forward_length(g.n_ff)
    w.add_head_count(g.n_head)
    w.add_head_count_kv(g.n_head_kv)
    w.add_key_length(g.head_dim)
    w.add_value_length(g.head_dim)
    w.add_layer_norm_rms_eps(g.rms_eps)
    w.add_rope_freq_base(g.rope_theta)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if g.arch == "llama":
        w.add_rope_dimension_count(g.head_dim)
        w.add_vocab_size(g.n_vocab)
    if g.sliding_window:
        w.add_sliding_window(g.sliding_window)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mesh.sim.geometry",
                                description="Write a random-weight GGUF of a real model's "
                                "geometry.")
    p.add_argument("name", help=f"one of {', '.join(sorted(GEOMETRIES))}")
    p.add_argument("out", help="the .gguf file to write (overwritten)")
    p.add_argument("--scale-down", type=int, default=1, metavar="K",
                   help="a twin K times smaller (same head size and GQA ratio)")
    p.add_argument("--type", default="q4_0", choices=sorted(QTYPES), help="2-D weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-ctx-train", type=int, default=None, metavar="N",
                   help="declare another trained context (e.g. 262144, so a 128K prefix "
                   "plus 128K private tokens pass mesh's context check); nothing else changes")
    a = p.parse_args(argv)
    if a.name not in GEOMETRIES:
        p.error(f"unknown geometry {a.name!r}; use one of {', '.join(sorted(GEOMETRIES))}")
    g = GEOMETRIES[a.name].scaled_down(a.scale_down)
    if a.n_ctx_train is not None:
        g = dataclasses.replace(g, n_ctx_train=a.n_ctx_train)
    t0 = time.monotonic()
    path = write_geometry_model(a.out, g, qtype=a.type, seed=a.seed)
    n_params = sum(t.n_elements for t in plan(g))
    kv = g.kv_shape()
    print(f"wrote {path}: {g.name}, {n_params / 1e9:.3f}B parameters, {a.type}, "
          f"{path.stat().st_size / 2**30:.2f} GiB in {time.monotonic() - t0:.1f} s; "
          f"KV per token {kv.cell_bytes('f16') / 1024:.1f} KiB f16, "
          f"{kv.cell_bytes('q8_0') / 1024:.1f} KiB q8_0", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
