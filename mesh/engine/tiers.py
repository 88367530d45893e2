"""The KV tier: given the memory the KV cache may take, pick its element type and the number
of session slots that fit. Pure arithmetic (no llama.cpp), tested on its own.

A KV cell costs, per layer, K and V elements of the cache's type: f16 2 bytes, q8_0 34 bytes
per 32 elements, q4_0 18 per 32 (ggml's block sizes). With ``swa_full`` every layer keeps
full-size caches, so ``layers * (k + v) * bytes`` is the cost of one cell. The pool needs
``prefix + sessions * session_budget`` cells; a naive server (every session with its own
copy of the prefix) needs ``sessions * (prefix + session_budget)``.

Rule: the highest-precision type (f16, then q8_0, then q4_0) at which ``want_sessions``
sessions fit; its slots are all that fit, up to ``cap``. If even q4_0 does not hold
``want_sessions``, q4_0 with as many as fit; if not one session fits, ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.engine.types import KV_TYPES

__all__ = ["KVShape", "Tier", "choose_tier", "elements_per_block"]

GIB = 1024**3
_PAD = 255  # llama.cpp rounds the cache up to a multiple of 256 cells
_BYTES_PER_BLOCK = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}  # (bytes, elements)


def elements_per_block(kv_type: str) -> int:
    return _BYTES_PER_BLOCK[kv_type][1]


@dataclass(frozen=True)
class KVShape:
    """What one KV cell holds: per layer, ``kv_heads`` heads of ``head_k`` K and ``head_v``
    V elements."""

    layers: int
    kv_heads: int
    head_k: int
    head_v: int

    @property
    def k(self) -> int:
        return self.kv_heads * self.head_k

    @property
    def v(self) -> int:
        return self.kv_heads * self.head_v

    def cell_bytes(self, kv_type: str) -> float:
        size, per = _BYTES_PER_BLOCK[kv_type]
        return self.layers * (self.k + self.v) * size / per

    def supports(self, kv_type: str) -> bool:
        """llama.cpp quantizes a cache only when the block size divides each head."""
        per = elements_per_block(kv_type)
        return self.head_k % per == 0 and self.head_v % per == 0


@dataclass(frozen=True)
class Tier:
    kv_type: str
    sessions: int  # session slots pooled in the memory
    naive_sessions: int  # sessions with a private prefix copy each, same memory and type
    n_ctx: int  # cells: prefix + sessions * session_budget
    memory_bytes: int
    cell_bytes: float
    prefix_tokens: int
    session_budget: int

    def describe(self) -> str:
        used = self.n_ctx * self.cell_bytes / GIB
        return (f"kv tier: {self.kv_type} cache in {self.memory_bytes / GIB:.2f} GiB "
                f"({self.cell_bytes / 1024:.1f} KiB a cell): {self.sessions} session slots "
                f"x {self.session_budget} tokens + a {self.prefix_tokens}-token prefix "
                f"({self.n_ctx} cells, {used:.2f} GiB) pooled; "
                f"{self.naive_sessions} with a prefix copy each")


def _fit(shape: KVShape, kv_type: str, memory: int, prefix: int, budget: int,
         cap: int) -> tuple[int, int, int]:
    cells = int(memory // shape.cell_bytes(kv_type)) - _PAD  # the pool pads n_ctx up
    pooled = max(0, min(cap, (cells - prefix) // budget)) if cells > prefix else 0
    naive = min(cap, cells // (prefix + budget))
    return pooled, naive, cells


def choose_tier(shape: KVShape, memory_bytes: int, *, prefix_tokens: int, session_budget: int,
                want_sessions: int, cap: int = 255,
                types: tuple[str, ...] = KV_TYPES) -> Tier:
    """The tier for ``memory_bytes`` of KV cache among ``types`` (highest precision
    first); see the module docstring."""
    if memory_bytes <= 0:
        raise ValueError(f"the KV memory must be positive, got {memory_bytes} bytes")
    usable = [t for t in types if shape.supports(t)]
    if not usable:
        raise ValueError(f"this model's KV heads ({shape.head_k} K, {shape.head_v} V "
                         f"elements) are not whole {'/'.join(types)} blocks; use --kv-type f16")
    best: tuple[str, int, int] | None = None
    for kv_type in usable:
        pooled, naive, _ = _fit(shape, kv_type, memory_bytes, prefix_tokens, session_budget,
                                cap)
        best = (kv_type, pooled, naive)
        if pooled >= min(want_sessions, cap):
            break
    assert best is not None
    kv_type, pooled, naive = best
    if pooled < 1:
        need = (prefix_tokens + session_budget) * shape.cell_bytes(kv_type) / GIB
        raise ValueError(
            f"{memory_bytes / GIB:.2f} GiB of KV memory holds not even the prefix "
            f"({prefix_tokens} tokens) and one session ({session_budget}) at {kv_type} "
            f"(needs {need:.2f} GiB); raise --kv-memory or lower --prefix-tokens or "
            "--session-budget")
    return Tier(kv_type=kv_type, sessions=pooled, naive_sessions=naive,
                n_ctx=prefix_tokens + pooled * session_budget, memory_bytes=memory_bytes,
                cell_bytes=shape.cell_bytes(kv_type), prefix_tokens=prefix_tokens,
                session_budget=session_budget)
