"""Start-up wiring and the engine step: the engine-thread parts of a started pool.

:func:`assemble` makes the :class:`~mesh.engine.scheduler.Scheduler` (sessions, ledger,
turns, snapshots) and the :class:`~mesh.engine.step.StepRunner` (with the native step when
its library is loaded) over one :class:`~mesh.engine.build.Built`. :meth:`Parts.step` is
one engine step, schedule → decode → sample → record; the pool's engine thread
(:mod:`mesh.engine.thread`) calls it and posts the step's items after.
:meth:`Parts.close` frees the native handles, runner first, context before model.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass

from mesh.engine.build import PREFIX_SEQ, Built
from mesh.engine.census import CellCensus, header_bytes, parse_cell_census
from mesh.engine.native import NativeBatch, NativeStepper
from mesh.engine.scheduler import Scheduler, StepLimits
from mesh.engine.snapshots import Snapshots
from mesh.engine.stats import StepStats
from mesh.engine.step import DecodeFailed, StepRunner
from mesh.engine.types import EngineConfig

__all__ = ["Parts", "assemble"]


@dataclass
class Parts:
    """Everything the engine thread works with for one started pool (tests and benches
    reach the owners through it: ``pool.parts.scheduler.ledger``, ``pool.parts.built.ctx``)."""

    built: Built
    scheduler: Scheduler
    runner: StepRunner
    stats: StepStats

    def step(self) -> None:
        """One engine step: the scheduler plans, the runner decodes and samples, the
        scheduler republishes (the items wait in the scheduler for the engine thread)."""
        t0 = time.monotonic()
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return
        plan, cells = scheduled
        done = self.runner.decode(plan, step_started=t0, cells_used=cells)
        if isinstance(done, DecodeFailed):
            self.scheduler.decode_failed(done.seqs, done.reason)
            return
        self.runner.sample(plan, done)
        self.scheduler.stepped(self.runner.record(plan, done, self.stats))

    def seq_pos_ranges(self) -> dict[int, tuple[int, int]]:
        """llama.cpp's own (min, max) position of the prefix sequence and of every resident
        session's sequence (engine thread: ``await pool.call(pool.parts.seq_pos_ranges)``)."""
        ctx = self.built.ctx
        return {s: ctx.seq_pos_range(s)
                for s in [PREFIX_SEQ, *self.scheduler.registry.resident()]}

    def cell_census(self) -> CellCensus | None:
        """llama.cpp's own count of occupied cells and sequence references (engine thread:
        ``await pool.call(pool.parts.cell_census)``)."""
        info = self.built.info
        head = self.built.ctx.state_head(-1, header_bytes(info.n_ctx, info.n_seq_max))
        return parse_cell_census(head, info.n_ctx, info.n_seq_max)

    def close(self) -> None:
        """Free the native step, the batch, the context and the model (in that order)."""
        self.runner.close()
        for handle in (self.built.batch, self.built.ctx, self.built.model):
            handle.close()  # context before model


def assemble(built: Built, config: EngineConfig, lib: ctypes.CDLL | None,
             limits: StepLimits, snapshots: Snapshots, stats: StepStats) -> Parts:
    """Wire the parts; ``lib`` is the loaded native library or None (the Python step)."""
    scheduler = Scheduler(built, config, limits, snapshots, stats)
    stepper, nbatch = None, None
    if lib is not None:
        stepper = NativeStepper(lib, config.n_batch,
                                threads=config.n_threads or os.cpu_count() or 1)
        nbatch = NativeBatch(config.n_batch)
    runner = StepRunner(built, scheduler.ledger, scheduler.turns,
                        scheduler.registry.resident(), stepper, nbatch)
    return Parts(built, scheduler, runner, stats)
