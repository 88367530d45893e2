"""llama.cpp's process-wide state: the bindings, one-time backend start, its log, the
build's facts (GPU offload, version). This is the one module that imports ``llama_cpp``;
the rest of the package reaches it through :data:`ll` here, nothing outside may."""

from __future__ import annotations

import ctypes
import os
import threading

import llama_cpp
import llama_cpp.llama_cpp as ll

__all__ = ["FLASH_ATTN", "backend_init", "gpu_offload_supported", "library_version", "ll"]

FLASH_ATTN = {"auto": ll.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": ll.LLAMA_FLASH_ATTN_TYPE_ENABLED,
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
