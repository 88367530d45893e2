"""A reusable ``llama_batch`` and the context that decodes it: one unified KV cache shared
by every sequence, its per-sequence edits (copy, remove, positions) and the state reads and
writes parking and the warm-start cache use.

llama.cpp aborts the whole process on some invalid batches (more output rows than
``n_outputs_max``, a sequence id out of range). :meth:`LlamaContext.decode` checks those
preconditions itself and raises :class:`ValueError` instead of handing such a batch over.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mesh.engine.llama.backend import FLASH_ATTN, ll
from mesh.engine.llama.model import LlamaModel
from mesh.engine.llama_rules import KV_GGML_TYPE, batch_problem
from mesh.engine.types import ModelError

__all__ = ["Batch", "LlamaContext"]


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
        params.flash_attn_type = FLASH_ATTN[flash_attn]
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
