"""llama.cpp's own count of occupied KV cells, read from the serialized cache.

There is no public "cells used" call. The serialized state of sequence -1 lists every
occupied cell: ``n_stream`` (u32), ``cell_count`` (u32), then per cell ``pos`` (i32),
``n_seq_id`` (u32) and that many ``seq_id`` (i32); with an iSWA cache the base cache comes
first. llama-cpp-python 0.3.36 writes 8 more bytes in front, so the header offset is found
by checking that every record parses: a format change yields None, never a wrong number.
Used to cross-check the pool's own accounting in tests and benchmarks.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = ["CellCensus", "parse_cell_census"]


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
