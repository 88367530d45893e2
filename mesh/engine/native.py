"""The native step: ``native/build/libmesh_native.so`` loaded with ctypes.

One foreign call per engine step fills the ``llama_batch`` from arrays, runs
``llama_decode`` and samples every output row (argmax for greedy turns, the turn's own
llama.cpp sampler chain otherwise: seeded draws and grammars included), so Python crosses
into C once a step and the GIL is released for all of it (ctypes drops it for the call).
Python keeps every piece of bookkeeping and sees a list of sampled tokens.

The library is built at install time (``python -m native.build``, run by
``scripts/install.sh``) against the llama.cpp that llama-cpp-python ships; it links the
same ``libllama.so`` the bindings in :mod:`mesh.engine.llama` load. When it is missing or
was built for another llama-cpp-python, :func:`resolve` says so once and the pool runs the
Python step. ``MESH_NATIVE_LIB`` points at a library elsewhere.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mesh.engine.interface import EngineError
from mesh.engine.llama import LlamaContext, library_version

__all__ = ["NativeBatch", "NativeStepper", "library_path", "load", "resolve"]

ABI = 2
_BUILD_HINT = "build it with: .venv/bin/python -m native.build"
_I32P = ctypes.POINTER(ctypes.c_int32)
_lock = threading.Lock()
_loaded: tuple[ctypes.CDLL | None, str] | None = None
_told = False


def library_path() -> Path:
    """Where the library is looked for (``MESH_NATIVE_LIB`` or the checkout's native/build)."""
    env = os.environ.get("MESH_NATIVE_LIB")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "native" / "build" / "libmesh_native.so"


def _open(path: Path) -> ctypes.CDLL:
    if not path.is_file():
        raise OSError(f"{path} does not exist")
    stamp = path.with_suffix(".json")
    if stamp.is_file():
        built_for = json.loads(stamp.read_text()).get("llama_cpp_python")
        if built_for != library_version():
            raise OSError(f"it was built for llama-cpp-python {built_for}, "
                          f"{library_version()} is installed")
    lib = ctypes.CDLL(str(path))
    lib.mesh_native_abi.restype = ctypes.c_int32
    if lib.mesh_native_abi() != ABI:
        raise OSError(f"{path} has ABI {lib.mesh_native_abi()}, this mesh needs {ABI}")
    lib.mesh_stepper_new.argtypes = [ctypes.c_int32]
    lib.mesh_stepper_new.restype = ctypes.c_void_p
    lib.mesh_stepper_free.argtypes = [ctypes.c_void_p]
    lib.mesh_stepper_free.restype = None
    lib.mesh_step.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
        _I32P, _I32P, _I32P, ctypes.POINTER(ctypes.c_int8),
        ctypes.c_int32, _I32P, ctypes.POINTER(ctypes.c_void_p), _I32P,
        ctypes.POINTER(ctypes.c_double), ctypes.c_int32,
    ]
    lib.mesh_step.restype = ctypes.c_int32
    lib.mesh_argmax.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int32]
    lib.mesh_argmax.restype = ctypes.c_int32
    return lib


def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not). Tried once per process."""
    global _loaded
    with _lock:
        if _loaded is None:
            path = library_path()
            try:
                _loaded = (_open(path), "")
            except (OSError, ValueError, AttributeError) as exc:
                _loaded = (None, f"{path}: {exc}")
        return _loaded


def resolve(want: bool | None) -> ctypes.CDLL | None:
    """The library to step with, for ``EngineConfig.native``: False: none; True: it must
    load (EngineError naming the fix otherwise); None: it if it loads, else one line on
    stderr (once per process) and the Python step."""
    global _told
    if want is False:
        return None
    lib, why = load()
    if lib is not None:
        return lib
    if want:
        raise EngineError(f"the native step is not available ({why}); {_BUILD_HINT}, "
                          "or run with --native off")
    with _lock:
        if not _told:
            _told = True
            print(f"mesh: native step not available ({why}); using the Python step "
                  f"({_BUILD_HINT})", file=sys.stderr)
    return None


class NativeBatch:
    """The next step's batch as plain lists (the same ``clear``/``add`` as
    :class:`mesh.engine.llama.Batch`); :class:`NativeStepper` copies them in one go."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens: list[int] = []
        self.pos: list[int] = []
        self.seq: list[int] = []
        self.logits: list[int] = []
        self.n_outputs = 0
        self.max_seq = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.tokens.clear()
        self.pos.clear()
        self.seq.clear()
        self.logits.clear()
        self.n_outputs = 0
        self.max_seq = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        i = len(self.tokens)
        if i >= self.capacity:
            raise ValueError(f"batch is full ({self.capacity} tokens)")
        self.tokens.append(token)
        self.pos.append(pos)
        self.seq.append(seq)
        self.logits.append(1 if logits else 0)
        if logits:
            self.n_outputs += 1
        if seq > self.max_seq:
            self.max_seq = seq
        return i

    def add_rows(self, tokens: list[int], pos: list[int], seqs: list[int]) -> int:
        """Append one output row per token (the decode rows); returns the first index."""
        i, k = len(self.tokens), len(tokens)
        if i + k > self.capacity:
            raise ValueError(f"batch is full ({self.capacity} tokens)")
        self.tokens += tokens
        self.pos += pos
        self.seq += seqs
        self.logits += [1] * k
        self.n_outputs += k
        if k:
            self.max_seq = max(self.max_seq, max(seqs))
        return i


class NativeStepper:
    """One native batch of ``capacity`` tokens and its step call (engine thread only)."""

    def __init__(self, lib: ctypes.CDLL, capacity: int, threads: int = 1) -> None:
        self._lib = lib
        self.capacity = capacity
        self.threads = threads  # threads that sample rows (large vocabularies only)
        self.force_threads = False  # tests: sample on `threads` threads whatever the size
        handle = lib.mesh_stepper_new(capacity)
        if not handle:
            raise MemoryError(f"mesh_stepper_new({capacity}) failed")
        self._handle: Any = handle
        self._tokens: Any = (ctypes.c_int32 * capacity)()
        self._pos: Any = (ctypes.c_int32 * capacity)()
        self._seq: Any = (ctypes.c_int32 * capacity)()
        self._logits: Any = (ctypes.c_int8 * capacity)()
        self._rows: Any = (ctypes.c_int32 * capacity)()
        self._samplers: Any = (ctypes.c_void_p * capacity)()
        self._out: Any = (ctypes.c_int32 * capacity)()
        self._timing = (ctypes.c_double * 4)()
        self.last_sample_s = 0.0
        self.sample_s = 0.0  # summed over steps: sampling inside the call
        self.gil_wait_s = 0.0  # summed: GIL hand-offs around the call (see step)

    def step(self, ctx: LlamaContext, batch: NativeBatch, rows: Sequence[int],
             samplers: Sequence[int | None]) -> tuple[int, list[int], float]:
        """Decode ``batch`` and sample ``rows`` (batch indices) with ``samplers`` (native
        chain handles, None for argmax). Returns (llama_decode's status, the sampled
        tokens, seconds inside llama_decode). Raises ValueError for a batch llama.cpp
        would abort the process on, as :meth:`LlamaContext.decode` does."""
        n = batch.n_tokens
        ctx.check_batch(n, batch.n_outputs, batch.max_seq)
        if n > self.capacity:
            raise ValueError(f"batch of {n} tokens exceeds the native batch {self.capacity}")
        k = len(rows)
        self._tokens[:n] = batch.tokens
        self._pos[:n] = batch.pos
        self._seq[:n] = batch.seq
        self._logits[:n] = batch.logits
        if k:
            self._rows[:k] = rows
            self._samplers[:k] = samplers
        before = time.monotonic()
        rc = int(self._lib.mesh_step(self._handle, ctx.address, n, self._tokens, self._pos,
                                     self._seq, self._logits, k, self._rows, self._samplers,
                                     self._out, self._timing,
                                     -self.threads if self.force_threads else self.threads))
        back = time.monotonic()
        self.last_sample_s = self._timing[1]
        self.sample_s += self._timing[1]
        if rc == 0:  # GIL hand-offs: releasing it before the call, taking it back after
            self.gil_wait_s += (max(0.0, self._timing[3] - before)
                                + max(0.0, back - self._timing[2]))
        if rc == -1000:
            raise ValueError(f"the native step refused a batch of {n} tokens")
        if rc == -1001:
            raise RuntimeError("llama.cpp gave no logits for a sampled row")
        if rc == -1002:
            raise MemoryError("the native step could not allocate its sampling buffers")
        return rc, (self._out[:k] if rc == 0 else []), self._timing[0]

    def close(self) -> None:
        if self._handle is not None:
            self._lib.mesh_stepper_free(self._handle)
            self._handle = None
