"""Start-up wiring: the engine-thread parts of a pool, assembled from what ``build`` made.

:func:`assemble` makes the cell ledger, the turns, the session registry and the step
runner (with the native step when its library is loaded) over one
:class:`~mesh.engine.build.Built`; :meth:`Parts.close` frees the native handles, runner
first, context before model. The pool owns the sessions dict and the outbox and shares
them with the parts.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from mesh.engine.build import PREFIX_SEQ, Built
from mesh.engine.census import CellCensus, header_bytes, parse_cell_census
from mesh.engine.ledger import CellLedger
from mesh.engine.native import NativeBatch, NativeStepper
from mesh.engine.registry import SessionRegistry
from mesh.engine.session import SeqState
from mesh.engine.step import StepRunner
from mesh.engine.turns import Outbox, Turns
from mesh.engine.types import EngineConfig, PoolInfo

__all__ = ["Parts", "assemble"]


@dataclass
class Parts:
    """Everything the engine thread works with for one started pool."""

    built: Built
    ledger: CellLedger
    turns: Turns
    registry: SessionRegistry
    runner: StepRunner

    def seq_pos_ranges(self, seqs: list[int]) -> dict[int, tuple[int, int]]:
        """llama.cpp's own (min, max) position of the prefix sequence and of ``seqs``."""
        ctx = self.built.ctx
        return {s: ctx.seq_pos_range(s) for s in [PREFIX_SEQ, *seqs]}

    def cell_census(self, info: PoolInfo) -> CellCensus | None:
        """llama.cpp's own count of occupied cells and sequence references."""
        head = self.built.ctx.state_head(-1, header_bytes(info.n_ctx, info.n_seq_max))
        return parse_cell_census(head, info.n_ctx, info.n_seq_max)

    def close(self) -> None:
        """Free the native step, the batch, the context and the model (in that order)."""
        self.runner.close()
        for handle in (self.built.batch, self.built.ctx, self.built.model):
            handle.close()  # context before model


def assemble(built: Built, config: EngineConfig, lib: ctypes.CDLL | None,
             sessions: dict[int, SeqState], outbox: Outbox) -> Parts:
    """Wire the parts; ``lib`` is the loaded native library or None (the Python step)."""
    ledger = CellLedger(
        n_ctx=built.info.n_ctx, shared=built.shared_cells, max_sessions=config.max_sessions,
        attach_need=1 if config.share_prefix else len(built.prefix) + 1,
        max_attached=config.attached_limit,
    )
    turns = Turns(built.model, ledger, outbox, config.seed)
    stepper, nbatch = None, None
    if lib is not None:
        stepper = NativeStepper(lib, config.n_batch,
                                threads=config.n_threads or os.cpu_count() or 1)
        nbatch = NativeBatch(config.n_batch)
    registry = SessionRegistry(built, ledger, outbox, config, sessions)
    runner = StepRunner(built, ledger, turns, sessions, stepper, nbatch)
    return Parts(built, ledger, turns, registry, runner)
