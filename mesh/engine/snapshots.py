"""The pool's published load snapshot: when the engine thread rebuilds it, and reads of it.

Every command that changes the pool publishes; a step publishes when a turn started or
ended (``Turns.changes`` moved) or when the last snapshot is older than
:data:`SNAPSHOT_INTERVAL_S`. Readers on any thread get the last published
:class:`~mesh.engine.stats.Capture`, so ``load()`` never waits on the engine thread.
"""

from __future__ import annotations

import time

from mesh.engine.build import Built
from mesh.engine.ledger import CellLedger
from mesh.engine.registry import SessionRegistry
from mesh.engine.stats import Capture, Parking, StepStats
from mesh.engine.types import EngineConfig, PoolLoad

__all__ = ["SNAPSHOT_INTERVAL_S", "Snapshots"]

# Between turn starts and ends, the load snapshot is rebuilt at most this often (building
# it touches every session; a step at N = 255 can take a few milliseconds).
SNAPSHOT_INTERVAL_S = 0.05


class Snapshots:
    """Builds (engine thread) and serves (any thread) the pool's load snapshot."""

    def __init__(self, stats: StepStats) -> None:
        self._stats = stats
        self._capture: Capture | None = None
        self._at = 0.0
        self._changes = -1

    def publish(self, registry: SessionRegistry, built: Built, ledger: CellLedger,
                config: EngineConfig, changes: int | None) -> None:
        """Rebuild the snapshot of every attached session (resident and parked);
        ``changes`` is the turns' counter it reflects."""
        self._at = time.monotonic()
        if changes is not None:
            self._changes = changes
        self._capture = self._stats.snapshot(
            registry.all_states(), prefix_cells=built.shared_cells,
            prefix_len=len(built.prefix), n_ctx=built.info.n_ctx,
            free_seq_ids=ledger.free_seq_ids, max_sessions=config.max_sessions,
            session_budget=config.session_budget, sessions_attached=registry.attached,
            sessions_reaped=registry.reaped,
            parking=Parking(ledger.max_attached, registry.parked_tokens(), registry.parks,
                            registry.resumes, registry.resume_tokens,
                            registry.parked_bytes, registry.swaps, config.park_memory))

    def due(self, changes: int, now: float) -> bool:
        """Whether a step that ends at ``now`` publishes (see the module docstring)."""
        return changes != self._changes or now - self._at >= SNAPSHOT_INTERVAL_S

    def load(self) -> PoolLoad:
        if self._capture is None:
            raise RuntimeError("the pool is not started")
        return self._capture.load()
