"""The one module that imports ``llama_cpp``: small owners of llama.cpp's native handles.

Each class owns one handle and frees it in ``close()`` (idempotent). Nothing here is
thread-safe: the pool calls every method that touches the context from its engine thread.
:class:`LlamaModel`'s tokenizer methods only read the vocabulary and may be called from any
thread.

llama.cpp aborts the whole process on some invalid batches (more output rows than
``n_outputs_max``, a sequence id out of range). :meth:`LlamaContext.decode` checks those
preconditions itself and raises :class:`ValueError` instead of handing such a batch over.

What needs no ``llama_cpp`` lives beside it: the sampler seam, greedy sampling and the
redraw policy in :mod:`mesh.engine.sampling`; KV type ids, the GGUF keys of the KV shape
and the batch preconditions in :mod:`mesh.engine.llama_rules`.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as ll
import numpy as np
import numpy.typing as npt

from mesh.engine.llama_rules import KV_GGML_TYPE, batch_problem, kv_shape_from_meta
from mesh.engine.sampling import (
    REPETITION_TOP_K,
    ContextView,
    GreedySampler,
    Ids,
    Logits,
    ProseTracker,
    TokenSampler,
    redraw,
    token_data,
)
from mesh.engine.types import ModelError, SamplingParams

__all__ = ["Batch", "GreedySampler", "LlamaContext", "LlamaModel", "Sampler", "TokenSampler",
           "backend_init", "gpu_offload_supported", "make_sampler"]

_FLASH_ATTN = {"auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
               "off": ll.LLAMA_FLASH_ATTN_TYPE_DISABLED}
_backend_lock = threading.Lock()
_backend_ready = False


def _silent_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    return None


_LOG_CB = ll.llama_log_callback(_silent_log)  # kept alive for the process's life


def gpu_offload_supported() -> bool:
    """Whether this llama.cpp build can offload layers to a GPU (CUDA, Metal, ...)."""
    backend_init()
    return bool(ll.llama_supports_gpu_offload())


def backend_init(verbose: bool = False) -> None:
    """Initialise llama.cpp once per process; silence its log unless ``verbose``."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        if not verbose and not os.environ.get("MESH_LLAMA_VERBOSE"):
            ll.llama_log_set(_LOG_CB, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _backend_ready = True


class LlamaModel:
    """A loaded GGUF model and its vocabulary."""

    def __init__(
        self,
        path: str | Path,
        *,
        n_gpu_layers: int = 0,
        extra_buffers: bool = False,
        vocab_only: bool = False,
    ) -> None:
        backend_init()
        p = Path(path)
        if not p.is_file():
            raise ModelError(f"model file not found at {p}; pass --model PATH or set MESH_MODEL")
        params = ll.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        # llama.cpp's "extra" CPU buffer types (weight repacking, AMX) segfault inside
        # ggml_backend_amx_mul_mat on AMX-capable Xeons (measured on the dev machine);
        # the plain path is safe and was faster there.
        params.use_extra_bufts = extra_buffers
        params.vocab_only = vocab_only
        handle = ll.llama_model_load_from_file(str(p).encode(), params)
        if not handle:
            raise ModelError(
                f"llama.cpp could not load {p}: not a supported GGUF model "
                "(set MESH_LLAMA_VERBOSE=1 to see llama.cpp's log)"
            )
        self._handle: Any = handle
        self.path = p
        vocab = ll.llama_model_get_vocab(handle)
        self._vocab = vocab
        self.n_vocab: int = ll.llama_vocab_n_tokens(vocab)
        self.n_ctx_train: int = ll.llama_model_n_ctx_train(handle)
        self.n_swa: int = ll.llama_model_n_swa(handle)
        self.n_params: int = int(ll.llama_model_n_params(handle))
        self.bos: int = ll.llama_vocab_bos(vocab)
        self.eos: int = ll.llama_vocab_eos(vocab)
        self.add_bos: bool = bool(ll.llama_vocab_get_add_bos(vocab))
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(handle, buf, ctypes.sizeof(buf))
        self.description = buf.value.decode("utf-8", "replace")
        self._pieces: dict[int, bytes] = {}

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise RuntimeError("model is closed")
        return self._handle

    @property
    def vocab(self) -> Any:
        """The native vocabulary handle (for samplers that need it, e.g. grammars)."""
        return self._vocab

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (None when the model has no such key)."""
        buf = ctypes.create_string_buffer(256)
        n = ll.llama_model_meta_val_str(self._handle, key.encode(), buf, ctypes.sizeof(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def kv_shape(self) -> tuple[int, int, int, int, int]:
        """(layers, KV heads, K and V elements per head, training context) from the GGUF
        metadata (readable from a vocabulary-only load too)."""
        return kv_shape_from_meta(self.meta)

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        """Token ids of ``text``; special tokens (``<start_of_turn>``...) are parsed."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        arr = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self._vocab, data, len(data), arr, cap, add_bos, True)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            arr = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._vocab, data, len(data), arr, cap, add_bos, True)
        return list(arr[:n])

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token renders to (special tokens render as nothing)."""
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def piece(self, token: int) -> bytes:
        """:meth:`token_bytes`, cached (the vocabulary never changes)."""
        data = self._pieces.get(token)
        if data is None:
            data = self._pieces[token] = self.token_bytes(token)
        return data

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self._vocab, token))

    def close(self) -> None:
        if self._handle is not None:
            ll.llama_model_free(self._handle)
            self._handle = None


class Batch:
    """A reusable ``llama_batch`` of up to ``capacity`` tokens, one sequence id each."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._batch: Any = ll.llama_batch_init(capacity, 0, 1)
        self.n_tokens = 0
        self.n_outputs = 0
        self.max_seq = 0

    def clear(self) -> None:
        self.n_tokens = 0
        self.n_outputs = 0
        self.max_seq = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append one token; returns its index in the batch (the logits row if requested)."""
        i = self.n_tokens
        if i >= self.capacity:
            raise ValueError(f"batch is full ({self.capacity} tokens)")
        b = self._batch
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = 1 if logits else 0
        self.n_tokens = i + 1
        self.n_outputs += 1 if logits else 0
        self.max_seq = max(self.max_seq, seq)
        return i

    def add_rows(self, tokens: list[int], pos: list[int], seqs: list[int]) -> int:
        """Append one output row per token; returns the first index."""
        first = self.n_tokens
        for tok, p, seq in zip(tokens, pos, seqs, strict=True):
            self.add(tok, p, seq, True)
        return first

    @property
    def raw(self) -> Any:
        self._batch.n_tokens = self.n_tokens
        return self._batch

    def close(self) -> None:
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None


class LlamaContext:
    """One llama.cpp context with a unified KV cache shared by every sequence."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        n_ctx: int,
        n_seq_max: int,
        n_batch: int,
        n_outputs_max: int,
        n_threads: int,
        swa_full: bool,
        flash_attn: str = "auto",
        kv_type: str = "f16",
    ) -> None:
        params = ll.llama_context_default_params()
        params.flash_attn_type = _FLASH_ATTN[flash_attn]
        params.type_k = params.type_v = KV_GGML_TYPE[kv_type]
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_outputs_max = n_outputs_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.kv_unified = True  # prefix sharing is metadata-only only with a unified cache
        params.swa_full = swa_full
        params.no_perf = True
        handle = ll.llama_init_from_model(model.handle, params)
        if not handle:
            raise ModelError(
                f"llama.cpp could not create a context of {n_ctx} cells for {n_seq_max} "
                f"sequences with a {kv_type} KV cache (out of memory? a quantized cache "
                "without flash attention?); lower --max-sessions or --session-budget, or "
                "use --kv-type f16"
            )
        self._handle: Any = handle
        self.model = model
        self.n_ctx: int = ll.llama_n_ctx(handle)
        self.n_seq_max: int = ll.llama_n_seq_max(handle)
        self.n_batch = n_batch
        self.n_outputs_max = n_outputs_max
        self._mem = ll.llama_get_memory(handle)

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise RuntimeError("context is closed")
        return self._handle

    @property
    def address(self) -> int:
        """The context's native address (for the native step)."""
        value = ctypes.cast(self.handle, ctypes.c_void_p).value
        assert value is not None
        return value

    def decode(self, batch: Batch) -> int:
        """Run one ``llama_decode``; returns llama.cpp's status (0 = ok).

        Raises ValueError for a batch that llama.cpp would abort the process on.
        """
        self.check_batch(batch.n_tokens, batch.n_outputs, batch.max_seq)
        return int(ll.llama_decode(self.handle, batch.raw))

    def check_batch(self, n_tokens: int, n_outputs: int, max_seq: int) -> None:
        """Raise ValueError for a batch shape llama.cpp would abort the process on."""
        problem = batch_problem(n_tokens, n_outputs, max_seq, n_batch=self.n_batch,
                                n_outputs_max=self.n_outputs_max, n_seq_max=self.n_seq_max)
        if problem is not None:
            raise ValueError(problem)

    def logits_row(self, index: int) -> npt.NDArray[np.float32]:
        """The logits of batch row ``index`` (a view: valid until the next decode)."""
        ptr = ll.llama_get_logits_ith(self.handle, index)
        if not ptr:
            raise RuntimeError(f"no logits for batch row {index}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    # --- KV memory: every call here edits metadata of the unified cache -----------------

    def seq_copy(self, src: int, dst: int) -> None:
        """Share every cell of ``src`` with ``dst`` (metadata only with a unified cache)."""
        ll.llama_memory_seq_cp(self._mem, src, dst, -1, -1)

    def seq_remove(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Drop ``seq`` from its cells in ``[p0, p1)``; cells no sequence holds are freed."""
        return bool(ll.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        """(min, max) position held by ``seq``; (-1, -1) when it holds none."""
        return (
            int(ll.llama_memory_seq_pos_min(self._mem, seq)),
            int(ll.llama_memory_seq_pos_max(self._mem, seq)),
        )

    def seq_state_size(self, seq: int) -> int:
        return int(ll.llama_state_seq_get_size(self.handle, seq))

    def state_head(self, seq: int, max_bytes: int) -> bytes:
        """The first ``max_bytes`` of the serialized cache of ``seq`` (-1: every cell)."""
        size = int(ll.llama_state_seq_get_size(self.handle, seq))
        if size <= 0:
            return b""
        buf = (ctypes.c_uint8 * size)()
        if int(ll.llama_state_seq_get_data(self.handle, buf, size, seq)) <= 0:
            return b""
        return ctypes.string_at(buf, min(size, max_bytes))

    def seq_get_data(self, seq: int) -> bytes:
        """The serialized cells of ``seq`` (every cell it holds, shared ones included: drop
        it from cells it should not carry first); b"" when it holds none or on failure."""
        size = int(ll.llama_state_seq_get_size(self.handle, seq))
        if size <= 0:
            return b""
        buf = (ctypes.c_uint8 * size)()
        n = int(ll.llama_state_seq_get_data(self.handle, buf, size, seq))
        return ctypes.string_at(buf, n) if n > 0 else b""

    def seq_set_data(self, seq: int, data: bytes) -> bool:
        """Write serialized cells into ``seq`` as its own new cells (llama.cpp drops what
        ``seq`` held first and finds free cells); False if they did not fit."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(ll.llama_state_seq_set_data(self.handle, buf, len(data), seq)) > 0

    def save_seq(self, path: Path, seq: int, tokens: list[int]) -> int:
        arr = (ll.llama_token * len(tokens))(*tokens)
        path_b = str(path).encode()
        return int(ll.llama_state_seq_save_file(self.handle, path_b, seq, arr, len(tokens)))

    def load_seq(self, path: Path, seq: int, capacity: int) -> list[int] | None:
        arr = (ll.llama_token * max(capacity, 1))()
        count = ctypes.c_size_t(0)
        n = ll.llama_state_seq_load_file(
            self.handle, str(path).encode(), seq, arr, capacity, ctypes.byref(count)
        )
        if n == 0:
            return None
        return list(arr[: count.value])

    def close(self) -> None:
        if self._handle is not None:
            ll.llama_free(self._handle)
            self._handle = None


class Sampler:
    """llama.cpp sampler chain: top-k -> top-p -> temperature -> seeded draw (or greedy),
    with an optional grammar checked *after* the draw, and optional repetition control.

    Applying a grammar to every candidate costs a pass over the whole vocabulary each token
    (262K entries for Gemma 3). Instead the chain draws first and the grammar checks only
    that token; only when it rejects it is the token drawn again among the allowed ones
    (the best 256 logits first, the whole vocabulary only if none of those is allowed), as
    llama.cpp's own common sampler does. A kept draw has probability p/A of the allowed
    mass A, so the result follows the grammar-masked distribution (up to the 256-logit
    shortcut's tail). ``temperature == 0`` with a grammar draws the best allowed token.
    ``grammar`` is GBNF text with root rule ``root``; an invalid one raises ValueError.
    ``grammar_first=True`` puts the grammar at the head of the chain instead (every
    candidate masked every token): the reference ``bench/grammar_bench.py``
    compares against.

    Repetition control (``rep``: a turn's :class:`SamplingParams` with
    :attr:`~SamplingParams.repetition` on) builds a second chain, top-k
    (:data:`REPETITION_TOP_K` when the turn has none) -> penalties -> DRY -> the same tail,
    that draws the *prose* tokens (:class:`ProseTracker`; every token without a grammar).
    :attr:`handle` names the chain the next token is drawn with, so the native step
    samples penalized turns through the penalties too. The repetition samplers' history is
    the turn's prose tokens only: when a grammar redraws a prose token (the chain already
    took the rejected draw) they are reset and given that history again.
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
        cost (``bench/sampling_bench.py``), no grammar check."""
        cand = token_data(np.arange(len(row), dtype=np.int32), row)
        arr = ll.llama_token_data_array(
            data=cand.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
            size=len(row), selected=-1, sorted=False,
        )
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
        cand = token_data(ids, logits)
        arr = ll.llama_token_data_array(
            data=cand.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)),
            size=len(ids), selected=-1, sorted=False,
        )
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


def library_version() -> str:
    return str(getattr(llama_cpp, "__version__", "unknown"))
