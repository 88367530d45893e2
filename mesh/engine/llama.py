"""The llama.cpp adapter, the one module that imports ``llama_cpp`` (the rest of the
package reaches the bindings through :data:`ll` here): small owners of llama.cpp's native
handles, each freed in ``close()`` (idempotent). Nothing here is thread-safe: the pool calls
every method that touches the context from its engine thread; :class:`LlamaModel`'s
tokenizer methods only read the vocabulary and may be called from any thread. Importing it
loads the bindings, no model. Read top to bottom:

**The bindings.** Process-wide state: one-time backend start, the log, the build's facts
(GPU offload, version).

**The model.** A loaded GGUF model and its vocabulary.

**The batch and the context.** A reusable ``llama_batch`` and the context that decodes it:
one unified KV cache shared by every sequence, its per-sequence edits (copy, remove,
positions) and the state reads and writes parking and the warm-start cache use. llama.cpp
aborts the whole process on some invalid batches (more output rows than
``n_outputs_max``, a sequence id out of range); :meth:`LlamaContext.decode` checks those
itself and raises :class:`ValueError` instead.

**The shared-prefix attention patch.** The patch (native/patches/, applied by
scripts/install.sh) makes ggml-cpu's flash-attention kernel attend decode rows over their
shared prefix together. Its contract:

* the patched libggml-cpu exports ``int ggml_cpu_shared_prefix_attn_version(void)`` (1);
* ``GGML_CPU_SHARED_PREFIX_ATTN=0`` in the environment disables the path; the kernel reads
  it once, so it is set before the first decode in the process (the patch's
  ``ggml_cpu_shared_prefix_attn_set``, where exported, switches it later); process-wide:
  two pools in one process share one setting;
* ``GGML_CPU_SHARED_PREFIX_MIN`` (default 256) is the shortest prefix it applies to;
* it runs only with flash attention on.

The lookup asks the libraries the process already loaded: ``libllama`` (from the wheel, or
from ``LLAMA_CPP_LIB_PATH``) and the libggml-cpu beside it. An unpatched wheel lacks the
symbol.

**The cell census.** llama.cpp's own count of occupied KV cells, read from the serialized
cache (there is no public "cells used" call). The serialized state of sequence -1 lists
every occupied cell: ``n_stream`` (u32), ``cell_count`` (u32), then per cell ``pos`` (i32),
``n_seq_id`` (u32) and that many ``seq_id`` (i32); with an iSWA cache the base cache comes
first. llama-cpp-python 0.3.36 writes 8 more bytes in front, so the header offset is found
by checking that every record parses: a format change yields None, never a wrong number.
Used to cross-check the pool's own accounting in tests and benchmarks.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as ll
import numpy as np
import numpy.typing as npt

from mesh.engine.config import KV_GGML_TYPE, batch_problem, kv_shape_from_meta
from mesh.engine.interface import ModelError

__all__ = [
    "ENV_DISABLE", "ENV_MIN", "FLASH_ATTN_TYPE", "SET_SYMBOL", "SYMBOL", "Batch", "CellCensus",
    "LlamaContext", "LlamaModel", "backend_init", "disabled_by_env", "gpu_offload_supported",
    "library_version", "ll", "llama_library", "min_prefix", "parse_cell_census", "quantize_file",
    "set_shared_prefix_attn", "shared_prefix_attn_available", "shared_prefix_attn_version",
    "switched_on", "system_info", "version_in"
]


# -------------------- the bindings --------------------------------------------

FLASH_ATTN_TYPE = {"auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
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


def library_version() -> str:
    return str(getattr(llama_cpp, "__version__", "unknown"))

def system_info() -> str:
    """llama.cpp's build line (``AVX2 = 1 | ... | REPACK = 1 | AMX_INT8 = 0 ...``)."""
    return bytes(ll.llama_print_system_info()).decode("utf-8", "replace")


def quantize_file(src: str | Path, dst: str | Path, ftype: int, threads: int) -> None:
    """Write ``src``'s weights as llama.cpp file type ``ftype`` (``LLAMA_FTYPE_*``) to
    ``dst``, requantizing quantized tensors. ModelError when llama.cpp refuses."""
    backend_init()
    params = ll.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = threads
    rc = ll.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise ModelError(f"llama.cpp could not convert {src} to file type {ftype} (code {rc}); "
                         "pass --weights as-is to load the file unchanged")


# -------------------- the model -----------------------------------------------

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

# -------------------- the batch and the context -------------------------------

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
        params.flash_attn_type = FLASH_ATTN_TYPE[flash_attn]
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

    def seq_get_data(self, seq: int, max_bytes: int | None = None) -> bytes:
        """The serialized cells of ``seq`` (-1: every cell; shared ones included: drop it
        from cells it should not carry first), their first ``max_bytes`` when given; b""
        when it holds none or on failure."""
        size = int(ll.llama_state_seq_get_size(self.handle, seq))
        if size <= 0:
            return b""
        buf = (ctypes.c_uint8 * size)()
        n = int(ll.llama_state_seq_get_data(self.handle, buf, size, seq))
        if n <= 0:
            return b""
        return ctypes.string_at(buf, n if max_bytes is None else min(n, max_bytes))

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

# -------------------- the shared-prefix attention patch -----------------------

SYMBOL = "ggml_cpu_shared_prefix_attn_version"
SET_SYMBOL = "ggml_cpu_shared_prefix_attn_set"  # (int enabled, int64 min_prefix)
ENV_DISABLE = "GGML_CPU_SHARED_PREFIX_ATTN"
ENV_MIN = "GGML_CPU_SHARED_PREFIX_MIN"
DEFAULT_MIN = 256  # the kernel's default for ENV_MIN


def _candidates(llama: ctypes.CDLL) -> list[ctypes.CDLL]:
    """Libraries that may hold the symbol: ``llama`` itself (its handle's lookup also
    searches the libraries it links, and a static ggml build has the kernel inside), then
    each ggml-cpu library beside it that the process has loaded (RTLD_NOLOAD: never a
    second copy, nor a CPU variant a backend-DL build did not pick)."""
    libs = [llama]
    name = getattr(llama, "_name", None)
    if not name:
        return libs
    files = sorted(p for p in Path(name).parent.glob("*ggml-cpu*")
                   if p.suffix in {".so", ".dylib", ".dll"} or ".so." in p.name)
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for path in files:
        try:
            libs.append(ctypes.CDLL(str(path)) if sys.platform == "win32"
                        else ctypes.CDLL(str(path), mode=mode))
        except OSError:  # not loaded in this process
            continue
    return libs


def _function(llama: ctypes.CDLL, symbol: str) -> Any | None:
    """``symbol`` from ``llama`` or a ggml-cpu loaded beside it (None: not exported)."""
    for lib in _candidates(llama):
        try:
            return getattr(lib, symbol)
        except AttributeError:
            continue
    return None


def version_in(llama: ctypes.CDLL) -> int:
    """The patch's version exported by ``llama`` or the ggml-cpu loaded beside it (0: none)."""
    fn = _function(llama, SYMBOL)
    if fn is None:
        return 0
    fn.argtypes = []
    fn.restype = ctypes.c_int
    return int(fn())


@functools.cache
def shared_prefix_attn_version() -> int:
    """The patch's version in the llama.cpp this process loaded (0: not patched); cached."""
    backend_init()  # a backend-DL build loads its CPU library here
    return version_in(llama_library())


def llama_library() -> ctypes.CDLL:
    """The ``libllama`` this process loaded (through llama-cpp-python's bindings)."""
    lib: ctypes.CDLL = ll._lib
    return lib


def shared_prefix_attn_available() -> bool:
    """Whether this llama.cpp was built with mesh's shared-prefix attention patch."""
    return shared_prefix_attn_version() >= 1


_switched: bool | None = None  # what set_shared_prefix_attn last asked the kernel for


def switched_on() -> bool | None:
    """The kernel's path as :func:`set_shared_prefix_attn` last set it (None: never set)."""
    return _switched


def disabled_by_env() -> bool:
    """Whether the user's environment turns the kernel's path off (exactly
    ``GGML_CPU_SHARED_PREFIX_ATTN=0``, as the kernel reads it)."""
    return os.environ.get(ENV_DISABLE) == "0"


def min_prefix() -> int:
    """The shortest prefix the kernel applies to, parsed as the kernel does
    (``GGML_CPU_SHARED_PREFIX_MIN``: unset 256, else its leading integer, at least 1)."""
    value = os.environ.get(ENV_MIN)
    if value is None:
        return DEFAULT_MIN
    lead = re.match(r"\s*[+-]?\d+", value)
    return max(int(lead.group()) if lead else 0, 1)


def set_shared_prefix_attn(on: bool) -> None:
    """Switch the kernel's path for this process through the patch's setter
    (``ggml_cpu_shared_prefix_attn_set``), which holds even after an earlier pool's decodes
    read the environment. Process-wide: the last pool built sets it for every pool in the
    process. Nothing to switch without the patch. Writes no environment variable."""
    global _switched
    _switched = on
    if not shared_prefix_attn_available():
        return
    fn = _function(llama_library(), SET_SYMBOL)
    if fn is not None:  # (enabled, min_prefix < 1: re-read GGML_CPU_SHARED_PREFIX_MIN)
        fn.argtypes = [ctypes.c_int, ctypes.c_int64]
        fn.restype = None
        fn(1 if on else 0, 0)

# -------------------- the cell census -----------------------------------------

@dataclass(frozen=True)
class CellCensus:
    cells: int  # occupied cells
    seq_refs: int  # Σ sequences per cell: what the cells would be without sharing


def parse_cell_census(data: bytes, n_ctx: int, n_seq_max: int) -> CellCensus | None:
    for off in (0, 4, 8, 16):
        if off + 8 > len(data):
            break
        n_stream, cells = struct.unpack_from("<II", data, off)
        if n_stream != 1 or cells > n_ctx:
            continue
        pos, refs, ok = off + 8, 0, True
        for _ in range(cells):
            if pos + 8 > len(data):
                ok = False
                break
            p, k = struct.unpack_from("<iI", data, pos)
            if p < 0 or not 1 <= k <= n_seq_max or pos + 8 + 4 * k > len(data):
                ok = False
                break
            refs += k
            pos += 8 + 4 * k
        if ok:
            return CellCensus(cells=cells, seq_refs=refs)
    return None


def header_bytes(n_ctx: int, n_seq_max: int) -> int:
    """Enough bytes of the serialized state to hold every cell's metadata."""
    return 32 + n_ctx * (8 + 4 * n_seq_max)
