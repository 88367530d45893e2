"""The gate's configuration: one frozen object, validated without I/O.

``policy`` is one of:

* ``floor`` — the decode gate (:mod:`mesh.gate.decode_gate`): every *turn* waits until
  the measured step can take one more row within ``1/floor_tps``; workers are admitted by
  memory only (sessions and cells), since a worker between turns costs no step time.
* ``none`` — admit everything the pool can physically hold; turns run when asked.

Those are the product's two. The simulation's comparison policies (``projection``,
``legacy``, ``static:N``: :mod:`mesh.sim.policies`) plug in as a
:class:`~mesh.gate.decide.WorkerRule` handed to the gate beside a config naming them.

Every policy is bound by hard limits: ``max_workers`` (default: the pool's session slots)
and the pool's free sequence ids.

The wait queue is bounded twice, in places (one per subtask or session waiting): ``max_queue``
in all, and ``max_queue_per_caller`` per caller (default: half of ``max_queue``), so one
caller filling its share leaves the rest of the queue to the others (see
:mod:`mesh.gate.queue`). With auth off every request is the one anonymous caller, whose
share is the whole queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["POLICIES", "GateConfig"]

POLICIES = ("floor", "none")  # the product's policies; comparison ones come with a rule


@dataclass(frozen=True)
class GateConfig:
    """How the gate admits workers. Build with ``GateConfig.create(...)`` to parse a policy
    string; :meth:`validate` raises ``ValueError`` with a readable message and does no I/O.
    """

    floor_tps: float = 5.0
    # --floor-tps auto (policy floor): the decode gate holds the rows at the knee of
    # aggregate tokens/s it measures (mesh.gate.decode_gate), not at floor_tps.
    auto_floor: bool = False
    # "floor" or "none"; another name only beside the WorkerRule that implements it.
    policy: str = "floor"
    max_queue: int = 64  # waiters beyond this are refused (HTTP 429)
    # Places one authenticated caller may hold in the queue (None: max_queue // 2, at
    # least 1); past it that caller is refused while the others still queue.
    max_queue_per_caller: int | None = None
    max_workers: int | None = None  # None: the pool's max_sessions
    use_idle_estimate: bool = True  # count workers by their observed duty cycle
    idle_quantile: float = 0.9  # share of steps in which the floor must hold
    # The projection (/capacity's headroom) counts a worker as fitting only while it
    # clears the floor by this fraction: the projection is an estimate (measured here:
    # within ~10 % of the rate workers then got).
    margin: float = 0.1
    # A duty cycle observed over a short life is noise (a worker waiting for its first
    # turn looks idle); younger sessions count as always decoding.
    min_duty_age_s: float = 5.0
    recheck_s: float = 0.25  # how often the queue's head re-checks while load changes
    default_retry_s: float = 2.0  # retry-after before any ticket has been released
    max_retry_s: float = 300.0
    new_worker_cells: int = 256  # private cells assumed for a worker not yet measured

    @classmethod
    def create(cls, **kwargs: object) -> GateConfig:
        """Build and validate a config (``policy`` case-insensitive)."""
        if isinstance(policy := kwargs.get("policy"), str):
            kwargs["policy"] = policy.strip().lower()
        config = cls(**kwargs)  # type: ignore[arg-type]
        config.validate()
        return config

    @property
    def queue_share(self) -> int:
        """Places one authenticated caller may hold in the wait queue."""
        if self.max_queue_per_caller is not None:
            return self.max_queue_per_caller
        return max(1, self.max_queue // 2)

    def validate(self) -> None:
        if not (math.isfinite(self.floor_tps) and self.floor_tps > 0):
            raise ValueError(f"floor_tps must be a finite number > 0, got {self.floor_tps}")
        if not self.policy or self.policy != self.policy.strip().lower():
            raise ValueError(f"gate policy must be a lower-case name, got {self.policy!r}")
        if self.auto_floor and self.policy != "floor":
            raise ValueError(f"--floor-tps auto needs --policy floor (the decode gate finds "
                             f"the knee); policy {self.policy} takes a number")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_queue_per_caller is not None and not (
                1 <= self.max_queue_per_caller <= max(1, self.max_queue)):
            raise ValueError(
                f"max_queue_per_caller must be between 1 and max_queue ({self.max_queue}), "
                f"got {self.max_queue_per_caller}")
        if self.max_workers is not None and self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if not 0.0 < self.idle_quantile <= 1.0:
            raise ValueError(f"idle_quantile must be in (0, 1], got {self.idle_quantile}")
        if not self.recheck_s > 0:
            raise ValueError(f"recheck_s must be > 0 seconds, got {self.recheck_s}")
        if not 0 < self.default_retry_s <= self.max_retry_s:
            raise ValueError(
                f"need 0 < default_retry_s ({self.default_retry_s}) <= "
                f"max_retry_s ({self.max_retry_s})"
            )
        if self.new_worker_cells < 0:
            raise ValueError(f"new_worker_cells must be >= 0, got {self.new_worker_cells}")
