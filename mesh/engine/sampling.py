"""How a turn draws its tokens: the sampler seam and its pure parts, then llama.cpp's
sampler chains over the adapter.

**The seam.** :class:`TokenSampler` is what a turn samples with; :class:`GreedySampler` is
argmax over the logits row (numpy only). The grammar-checked redraw of :class:`Sampler`
follows :func:`redraw`'s policy: first among the :data:`REDRAW_TOP` best logits, the whole
vocabulary only if none of those is allowed; the adapter supplies the draw itself
(llama.cpp's grammar and chain over a :func:`token_data` array).

**The chains.** llama.cpp's sampler chains for one turn: the draw, the grammar checked after
it, and repetition control over the turn's prose tokens (see :class:`Sampler`).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from mesh.engine.config import SamplingParams
from mesh.engine.llama import LlamaModel, ll

__all__ = [
    "REDRAW_TOP", "REPETITION_TOP_K", "TOKEN_DATA", "ContextView", "GreedySampler", "Ids", "Logits",
    "ProseTracker", "Sampler", "TokenSampler", "make_sampler", "redraw", "token_data"
]


# -------------------- the seam ------------------------------------------------

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


def _candidates(ids: Ids, logits: Logits) -> tuple[npt.NDArray[Any], Any]:
    """:func:`token_data` and the ``llama_token_data_array`` over it (nothing selected)."""
    cand = token_data(ids, logits)
    arr = ll.llama_token_data_array(
        data=cand.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
        size=len(ids), selected=-1, sorted=False,
    )
    return cand, arr


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

# -------------------- the chains ----------------------------------------------

class Sampler:
    """llama.cpp sampler chain: top-k -> top-p -> temperature -> seeded draw (or greedy),
    with an optional grammar checked *after* the draw, and optional repetition control.

    Applying a grammar to every candidate costs a pass over the whole vocabulary each token
    (262K entries for Gemma 3). Instead the chain draws first and the grammar checks only
    that token; only a rejected token is drawn again among the allowed ones (see
    :func:`redraw`), as llama.cpp's own common sampler does: a kept draw has probability
    p/A of the allowed mass A, so the result follows the grammar-masked distribution (up to
    the 256-logit shortcut's tail). ``grammar`` is GBNF text with root rule ``root``; an
    invalid one raises ValueError. ``grammar_first=True`` puts the grammar at the head of
    the chain instead (the reference ``bench/grammar`` compares against).

    Repetition control (``rep``: a turn's :class:`SamplingParams` with
    :attr:`~SamplingParams.repetition` on) builds a second chain, top-k
    (:data:`REPETITION_TOP_K` when the turn has none) -> penalties -> DRY -> the same tail,
    that draws the *prose* tokens (:class:`ProseTracker`; every token without a grammar).
    :attr:`handle` names the chain the next token is drawn with, so the native step
    samples penalized turns through the penalties too. The repetition samplers' history is
    the turn's prose tokens only: when a grammar redraws a prose token they are reset and
    given that history again.
    """

    def __init__(
        self,
        model: LlamaModel | None = None,
        *,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int,
        grammar: str | None = None,
        grammar_first: bool = False,
        rep: SamplingParams | None = None,
    ) -> None:
        self._chain: Any = None
        self._prose: Any = None  # the repetition chain (None: no repetition control)
        self._rep: list[Any] = []  # its repetition samplers (owned by the chain)
        self._addresses: dict[int, int] = {}
        self._grammar: Any = None
        self._tracker: ProseTracker | None = None
        self._history: list[int] = []  # prose tokens taken (the repetition history)
        self._model = model
        self._n_vocab = 0
        self.num_redraws = 0  # draws the grammar rejected
        self.num_full_redraws = 0  # of those, redraws that had to mask the whole vocabulary
        gram: Any = None
        if grammar is not None:
            if model is None:
                raise ValueError("a grammar sampler needs the model's vocabulary")
            gram = ll.llama_sampler_init_grammar(
                model.vocab, grammar.encode("utf-8"), b"root"
            )
            if not gram:
                raise ValueError(
                    "the GBNF grammar does not parse (llama.cpp rejected it; it needs a "
                    "rule named 'root'; set MESH_LLAMA_VERBOSE=1 to see where it failed)"
                )
            if not grammar_first:
                self._grammar = gram
                self._n_vocab = model.n_vocab
        self._chain = _chain(temperature, top_k, top_p, seed,
                             gram if grammar_first else None, [])
        if rep is not None and rep.repetition and not grammar_first:
            if model is None:
                self.close()
                raise ValueError("repetition control needs the model's vocabulary")
            self._rep = _repetition_samplers(model, rep)
            self._prose = _chain(temperature, top_k or REPETITION_TOP_K, top_p, seed, None,
                                 self._rep)
            if grammar is not None:
                self._tracker = ProseTracker(rep.prose_open, rep.prose_close, rep.prose_first)

    def _active(self) -> Any:
        """The chain the next token is drawn with."""
        if self._prose is not None and (self._tracker is None or self._tracker.prose):
            return self._prose
        return self._chain

    @property
    def handle(self) -> int | None:
        chain = self._active()
        if chain is None:
            return None
        key = id(chain)
        address = self._addresses.get(key)
        if address is None:
            address = self._addresses[key] = ctypes.cast(chain, ctypes.c_void_p).value or 0
        return address

    @property
    def penalized(self) -> bool:
        """Whether the next token is drawn under repetition control."""
        return self._prose is not None and self._active() is self._prose

    def sample(self, ctx: ContextView, index: int) -> int:
        tok = int(ll.llama_sampler_sample(self._active(), ctx.handle, index))
        return self.constrain(ctx, index, tok)

    def draw_row(self, row: Logits) -> int:
        """What the native step does with one row (every logit a candidate, the active
        chain applied, its draw accepted), on a row we hold; for measuring the chain's
        cost (``bench/sampling``), no grammar check."""
        cand, arr = _candidates(np.arange(len(row), dtype=np.int32), row)
        chain = self._active()
        ll.llama_sampler_apply(chain, ctypes.byref(arr))
        tok = int(cand["id"][arr.selected])
        ll.llama_sampler_accept(chain, tok)
        return tok

    def constrain(self, ctx: ContextView, index: int, tok: int) -> int:
        """The token to take after the chain drew ``tok`` from row ``index`` (here or in
        the native step, which samples the chain only): ``tok`` itself without a grammar
        or when the grammar allows it, else a redraw among the allowed tokens."""
        gram = self._grammar
        if gram is None:
            return tok
        chain = self._active()
        one = ll.llama_token_data(id=tok, logit=1.0, p=0.0)
        arr = ll.llama_token_data_array(data=ctypes.pointer(one), size=1, selected=-1,
                                        sorted=False)
        ll.llama_sampler_apply(gram, ctypes.byref(arr))
        if not math.isinf(one.logit):  # the grammar allows the draw
            ll.llama_sampler_accept(gram, tok)
            self._took(chain, tok, redrawn=False)
            return tok
        self.num_redraws += 1
        tok = self._redraw(ctx, index, chain)
        ll.llama_sampler_accept(gram, tok)
        self._took(chain, tok, redrawn=True)
        return tok

    def _took(self, chain: Any, tok: int, *, redrawn: bool) -> None:
        """Book a grammar turn's token: the repetition history, then the prose state."""
        if self._prose is not None and chain is self._prose:
            self._history.append(tok)
            if redrawn:  # the chain took the rejected draw and the redraw: start over
                for smpl in self._rep:
                    ll.llama_sampler_reset(smpl)
                    for t in self._history:
                        ll.llama_sampler_accept(smpl, t)
        if self._tracker is not None and self._model is not None:
            was = self._tracker.prose
            self._tracker.feed(self._model.piece(tok))
            if self._tracker.prose and not was and self._history:
                # A new prose field (an answer after the reasoning, a plan's next string)
                # is measured against itself: naming again a file the reasoning named is
                # no loop.
                self._history.clear()
                for smpl in self._rep:
                    ll.llama_sampler_reset(smpl)

    def _redraw(self, ctx: ContextView, index: int, chain: Any) -> int:
        """Draw again among the tokens the grammar allows (:func:`~mesh.engine.sampling.
        redraw`: the best logits first, the whole vocabulary only if none is allowed)."""
        tok, full = redraw(ctx.logits_row(index), self._n_vocab,
                           lambda ids, logits: self._draw_among(chain, ids, logits))
        self.num_full_redraws += full
        ll.llama_sampler_accept(chain, tok)
        return tok

    def _draw_among(self, chain: Any, ids: Ids, logits: Logits) -> int | None:
        cand, arr = _candidates(ids, logits)
        ll.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        if not np.isfinite(cand["logit"]).any():
            return None
        ll.llama_sampler_apply(chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            return None
        return int(cand["id"][arr.selected])

    def close(self) -> None:
        if self._grammar is not None:
            ll.llama_sampler_free(self._grammar)
            self._grammar = None
        for name in ("_chain", "_prose"):
            chain = getattr(self, name)
            if chain is not None:
                ll.llama_sampler_free(chain)  # frees the samplers it owns
                setattr(self, name, None)
        self._rep = []
        self._addresses.clear()


def _chain(temperature: float, top_k: int, top_p: float, seed: int, grammar: Any,
           middle: list[Any]) -> Any:
    """A chain: [grammar] -> top-k -> ``middle`` -> (greedy | top-p -> temperature -> draw).
    The chain owns (and frees) every sampler added to it."""
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    if grammar is not None:
        ll.llama_sampler_chain_add(chain, grammar)
    if top_k > 0 and (middle or temperature != 0.0):
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(top_k))
    for smpl in middle:
        ll.llama_sampler_chain_add(chain, smpl)
    if temperature == 0.0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
        return chain
    if top_p < 1.0:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(top_p, 1))
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(temperature))
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return chain


def _repetition_samplers(model: LlamaModel, p: SamplingParams) -> list[Any]:
    """llama.cpp's penalties and DRY samplers for ``p`` (those that are on)."""
    out: list[Any] = []
    if p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        out.append(ll.llama_sampler_init_penalties(model.n_vocab, p.repeat_last_n,
                                                   p.repeat_penalty, p.frequency_penalty,
                                                   p.presence_penalty))
    if p.dry_multiplier > 0.0:
        # No sequence breakers: each one costs a scan of the whole vocabulary per turn,
        # and prose under a grammar is already cut at its structure.
        out.append(ll.llama_sampler_init_dry(model.vocab, p.dry_multiplier, p.dry_base,
                                             p.dry_allowed_length, p.dry_last_n, None, 0))
    return out


def make_sampler(
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    grammar: str | None = None,
    model: LlamaModel | None = None,
    grammar_first: bool = False,
    rep: SamplingParams | None = None,
) -> TokenSampler:
    """The sampler of one turn. A grammar or repetition control (``rep``: the turn's
    params, see :class:`Sampler`) needs ``model``; raises ValueError when the grammar does
    not parse. A greedy turn with neither is argmax (:class:`GreedySampler`); a penalized
    greedy turn samples its chain, in the native step too."""
    if temperature == 0.0 and grammar is None and (rep is None or not rep.repetition):
        return GreedySampler()
    return Sampler(model, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                   grammar=grammar, grammar_first=grammar_first, rep=rep)
