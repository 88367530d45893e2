"""The sampler seam and the parts of sampling that need no llama.cpp.

:class:`TokenSampler` is what a turn samples with; :class:`GreedySampler` is argmax over the
logits row (numpy only). The grammar-checked redraw of :class:`mesh.engine.llama.Sampler`
follows :func:`redraw`'s policy here: first among the :data:`REDRAW_TOP` best logits, the
whole vocabulary only if none of those is allowed; the adapter supplies the draw itself
(llama.cpp's grammar and chain over a :func:`token_data` array).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["REDRAW_TOP", "REPETITION_TOP_K", "TOKEN_DATA", "ContextView", "GreedySampler",
           "Ids", "Logits", "ProseTracker", "TokenSampler", "redraw", "token_data"]

REDRAW_TOP = 256  # best logits a redraw tries before masking the whole vocabulary
# Repetition samplers run after a top-k of this many (llama.cpp: "avoid using on the full
# vocabulary"): a penalty only lowers logits, so with greedy decoding the pick is the same
# unless all of the best 40 tokens were penalized below the 41st.
REPETITION_TOP_K = 40
# llama_token_data as numpy sees it: {int32 id; float logit; float p}, 12 bytes, no padding.
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])

Ids = npt.NDArray[np.int32]
Logits = npt.NDArray[np.float32]


class ContextView(Protocol):
    """What a sampler reads of a decoded context (:class:`mesh.engine.llama.LlamaContext`)."""

    @property
    def handle(self) -> Any: ...

    def logits_row(self, index: int) -> Logits: ...


class TokenSampler(Protocol):
    """A per-turn sampler: pick the next token from batch row ``index``; ``close`` frees it.

    ``handle`` is the native llama.cpp sampler chain the native step samples with (None:
    argmax over the logits row)."""

    @property
    def handle(self) -> int | None: ...

    def sample(self, ctx: ContextView, index: int) -> int: ...

    def constrain(self, ctx: ContextView, index: int, tok: int) -> int:
        """The token to take when ``tok`` was drawn from row ``index`` by the chain alone
        (the native step): a grammar checks it here and may redraw."""
        ...

    def close(self) -> None: ...


class GreedySampler:
    """argmax over the logits row: 5x cheaper than llama.cpp's sampler chain here."""

    handle = None

    def sample(self, ctx: ContextView, index: int) -> int:
        return int(np.argmax(ctx.logits_row(index)))

    def constrain(self, ctx: ContextView, index: int, tok: int) -> int:
        return tok

    def close(self) -> None:
        return None


def token_data(ids: Ids, logits: Logits) -> npt.NDArray[Any]:
    """A ``llama_token_data`` array of the candidates (p left 0) for llama.cpp to edit."""
    cand = np.empty(len(ids), dtype=TOKEN_DATA)
    cand["id"] = ids
    cand["logit"] = logits
    cand["p"] = 0.0
    return cand


def redraw(logits: Logits, n_vocab: int,
           draw_among: Callable[[Ids, Logits], int | None]) -> tuple[int, bool]:
    """A token ``draw_among`` allows: first among the ``REDRAW_TOP`` best logits (exact for
    greedy, and the chain keeps only its top-k anyway), then among the whole vocabulary.
    Returns (token, whether the whole vocabulary was needed)."""
    top = min(REDRAW_TOP, n_vocab)
    ids = np.argpartition(logits, -top)[-top:].astype(np.int32)
    tok = draw_among(ids, logits[ids])
    full = tok is None
    if tok is None:
        tok = draw_among(np.arange(n_vocab, dtype=np.int32), logits)
    if tok is None:
        raise RuntimeError("the grammar allows no token here (is it complete?)")
    return tok, full


class ProseTracker:
    """Whether the next token of a turn is prose, from the text generated so far.

    Under a grammar, repetition control must act on prose only, never on structure (tags,
    call syntax, JSON keys: penalizing a forced token's usual spelling makes the grammar
    pick an odd tokenization of it). Prose starts at the turn's start when ``first`` and
    after any of ``opens``, and ends at the character ``close``. ``feed`` takes each token's
    bytes as generated (the markers are ASCII, so bytes are read as latin-1). Cost: a few
    character comparisons per character generated.
    """

    def __init__(self, opens: tuple[str, ...], close: str, first: bool) -> None:
        self.opens = opens
        self.close = close
        self.prose = first
        self._keep = max((len(o) for o in opens), default=0)
        self._tail = ""

    def feed(self, data: bytes) -> None:
        for ch in data.decode("latin-1"):
            if self.prose:
                if ch == self.close:
                    self.prose = False
                    self._tail = ch
                continue
            if not self._keep:
                continue
            self._tail = (self._tail + ch)[-self._keep:]
            if any(self._tail.endswith(o) for o in self.opens):
                self.prose = True
                self._tail = ""
