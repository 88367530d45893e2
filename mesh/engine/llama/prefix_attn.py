"""Whether the loaded llama.cpp has mesh's shared-prefix attention patch, and its switch.

The patch (native/patches/, applied by scripts/install.sh) makes ggml-cpu's flash-attention
kernel attend decode rows over their shared prefix together. Its contract:

* the patched libggml-cpu exports ``int ggml_cpu_shared_prefix_attn_version(void)`` (1);
* ``GGML_CPU_SHARED_PREFIX_ATTN=0`` in the environment disables the path; the kernel reads
  it once, so it is set before the first decode in the process (the patch's
  ``ggml_cpu_shared_prefix_attn_set``, where exported, switches it later); process-wide:
  two pools in one process share one setting;
* ``GGML_CPU_SHARED_PREFIX_MIN`` (default 256) is the shortest prefix it applies to;
* it runs only with flash attention on.

The lookup asks the libraries the process already loaded: ``libllama`` (from the wheel, or
from ``LLAMA_CPP_LIB_PATH`` where llama-cpp-python was pointed at a patched build) and the
libggml-cpu beside it. An unpatched wheel simply lacks the symbol.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
from pathlib import Path
from typing import Any

from mesh.engine.llama.backend import backend_init, ll

__all__ = ["ENV_DISABLE", "ENV_MIN", "SET_SYMBOL", "SYMBOL", "disabled_by_env", "llama_library",
           "min_prefix", "set_shared_prefix_attn", "shared_prefix_attn_available",
           "shared_prefix_attn_version", "version_in"]

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


_written: str | None = None  # the value set_shared_prefix_attn last wrote


def disabled_by_env() -> bool:
    """Whether the user's environment turns the kernel's path off (exactly
    ``GGML_CPU_SHARED_PREFIX_ATTN=0``, as the kernel reads it); a 0 this module wrote for an
    earlier ``off`` pool in the process does not count."""
    value = os.environ.get(ENV_DISABLE)
    return value is not None and value != _written and value == "0"


def min_prefix() -> int:
    """The shortest prefix the kernel applies to, parsed as the kernel does
    (``GGML_CPU_SHARED_PREFIX_MIN``: unset 256, else its leading integer, at least 1)."""
    value = os.environ.get(ENV_MIN)
    if value is None:
        return DEFAULT_MIN
    lead = re.match(r"\s*[+-]?\d+", value)
    return max(int(lead.group()) if lead else 0, 1)


def set_shared_prefix_attn(on: bool) -> None:
    """Switch the kernel's path for this process: the environment variable it reads (once,
    at its first flash-attention op) and, where the patch exports it,
    ``ggml_cpu_shared_prefix_attn_set``, so a switch after an earlier pool's decodes holds
    too. Process-wide: the last pool built sets it for every pool in the process."""
    global _written
    _written = "1" if on else "0"
    os.environ[ENV_DISABLE] = _written
    if not shared_prefix_attn_available():
        return
    fn = _function(llama_library(), SET_SYMBOL)
    if fn is not None:  # (enabled, min_prefix < 1: re-read GGML_CPU_SHARED_PREFIX_MIN)
        fn.argtypes = [ctypes.c_int, ctypes.c_int64]
        fn.restype = None
        fn(1 if on else 0, 0)
