"""The model's name on the OpenAI API: its GGUF ``general.name`` and file name.

``general.name`` is read from the start of the GGUF header only: converters write the
``general.*`` keys first, so the scan stops at the first array of strings (the vocabulary,
262K entries for Gemma 3: reading it all took ~1 s) or after :data:`_MAX_KEYS` keys.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from mesh.engine.interface import PoolInfo

__all__ = ["gguf_name", "model_names"]

_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_KEYS = 64
_MAX_STRING = 1 << 20


def model_names(info: PoolInfo) -> tuple[str, str]:
    """(id, file name) of the pool's model: the GGUF's ``general.name`` (else the file's
    stem) and the file's name; an engine without a local file keeps its own name."""
    path = Path(info.model_path)
    if not path.is_file():
        return info.model_name, info.model_path
    name = gguf_name(path)
    return (name or path.stem), path.name


def gguf_name(path: Path) -> str | None:
    """``general.name`` of a GGUF file, None when it is not among the first keys or the
    file is not a readable GGUF."""
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                return None
            _u(f, "<I")  # version
            _u(f, "<Q")  # tensors
            for _ in range(min(_u(f, "<Q"), _MAX_KEYS)):
                key = _string(f)
                kind = _u(f, "<I")
                if kind == _STRING:
                    value = _string(f)
                    if key == "general.name":
                        return value.strip() or None
                elif kind == _ARRAY:
                    inner, n = _u(f, "<I"), _u(f, "<Q")
                    if inner not in _SIZES:
                        return None  # an array of strings: the vocabulary; no name before it
                    f.seek(_SIZES[inner] * n, 1)
                elif kind in _SIZES:
                    f.seek(_SIZES[kind], 1)
                else:
                    return None
    except (OSError, struct.error, UnicodeDecodeError, ValueError):
        return None
    return None


def _u(f: BinaryIO, fmt: str) -> int:
    data = f.read(struct.calcsize(fmt))
    value: int = struct.unpack(fmt, data)[0]
    return value


def _string(f: BinaryIO) -> str:
    n = _u(f, "<Q")
    if n > _MAX_STRING:
        raise ValueError("a GGUF string longer than 1 MiB")
    return f.read(n).decode("utf-8")
