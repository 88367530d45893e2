"""Whether the loaded llama.cpp has mesh's shared-prefix attention patch, and its switch.

The patch (native/patches/, applied by scripts/install.sh) makes ggml-cpu's flash-attention
kernel attend decode rows over their shared prefix together. Its contract:

* the patched libggml-cpu exports ``int ggml_cpu_shared_prefix_attn_version(void)`` (1);
* ``GGML_CPU_SHARED_PREFIX_ATTN=0`` in the environment disables the path; the kernel reads
  it, so it must be set before the first decode in the process (process-wide: two pools in
  one process share one setting);
* ``GGML_CPU_SHARED_PREFIX_MIN`` (default 256) is the shortest prefix it applies to;
* it runs only with flash attention on.

The lookup asks the library the process already loaded (the one beside ``libllama``, by
its file name, which the dynamic loader maps to the loaded copy): an unpatched wheel simply
lacks the symbol.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

import llama_cpp.llama_cpp as ll

from mesh.engine.llama.backend import backend_init

__all__ = ["ENV_DISABLE", "ENV_MIN", "SYMBOL", "disabled_by_env", "llama_library", "min_prefix",
           "set_shared_prefix_attn", "shared_prefix_attn_available",
           "shared_prefix_attn_version", "version_in"]

SYMBOL = "ggml_cpu_shared_prefix_attn_version"
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


def version_in(llama: ctypes.CDLL) -> int:
    """The patch's version exported by ``llama`` or the ggml-cpu loaded beside it (0: none)."""
    for lib in _candidates(llama):
        try:
            fn = getattr(lib, SYMBOL)
        except AttributeError:
            continue
        fn.argtypes = []
        fn.restype = ctypes.c_int
        return int(fn())
    return 0


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
    """Whether the user's environment turns the kernel's path off
    (``GGML_CPU_SHARED_PREFIX_ATTN=0``); a 0 this module wrote for an earlier ``off`` pool in
    the process does not count."""
    value = os.environ.get(ENV_DISABLE)
    return value is not None and value != _written and value.strip() == "0"


def min_prefix() -> int:
    """The shortest prefix the kernel applies to (``GGML_CPU_SHARED_PREFIX_MIN``, default 256;
    an unreadable value: the default)."""
    try:
        return int(os.environ.get(ENV_MIN, DEFAULT_MIN))
    except ValueError:
        return DEFAULT_MIN


def set_shared_prefix_attn(on: bool) -> None:
    """Switch the kernel's path for this process (the environment variable it reads). Call
    before the context decodes; later changes may not reach a kernel that already read it."""
    global _written
    _written = "1" if on else "0"
    os.environ[ENV_DISABLE] = _written
