"""The online throughput model: how long one engine step takes for a given load.

    step_s ≈ a + b·num_decode + c·sum_context + d·num_prefill_tokens
             + e·(num_decode + num_prefill_tokens)·cells_used + f·cells_used

``a`` is fixed per-step work, ``b`` the cost of one more decoding row (on a CPU mostly the
output layer), ``c`` the attention cost per context token read, ``d`` the cost of one
prefilled token riding in the same step, ``e`` the cost per batch row per cell in use: with
one unified KV cache every row of the batch attends over every used cell (masked), idle
sessions' cells included, so step time grows with rows × cells used, not only with each
session's own context; ``f`` the cost per cell in use per step, whatever the rows: K and V
read once for all rows (llama.cpp's non-flash CPU path multiplies every row's query against
the cells in one product; a shared-prefix kernel reads the prefix once per step).

The prefix term: with ``P`` prefix cells and ``R`` decoding rows, ``sum_context`` and the
rows × cells feature each hold ``R·P``, ``cells_used`` holds ``P`` once. Today's engine pays
the prefix per row (``c``, ``e``); an engine that attends the prefix once per step moves
that cost to ``f`` (what is left per row is the rows × prefix FLOPs), and the fit follows it
from live steps: nothing here assumes which. ``f`` starts at zero and its ridge is firm, so
it moves only on steps whose cells vary apart from their rows, and a pool that runs at one
number of cells leaves it near zero instead of splitting the intercept into it
(``bench/prefix_attention_bench.py`` measures the per-step and per-row slopes).

A decoding session emits one token per step, so its tokens/s is ``1 / step_s``.

Fit: weighted least squares with exponential forgetting (recursive least squares in its
sufficient-statistics form: ``XᵀX`` and ``Xᵀy`` decay by ``forget`` per observed sample),
regularised towards a prior. The prior is the default parameters plus whatever
:meth:`ThroughputModel.seed` added (a start-up micro-benchmark); seeded samples never decay,
so they keep the slope identifiable when the pool runs at a constant number of sessions for
a long time. Coefficients are kept physical (``b > 0``, ``a, c, d, e, f ≥ 0``) by an active set:
a negative coefficient is pinned at zero and the rest re-fitted.

Everything here is pure and synchronous: no clock, no I/O. The model is mutable (it
learns), and is read by :func:`mesh.gate.decide.decide`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from mesh.engine.interface import PoolLoad, StepSample

__all__ = ["DEFAULT_PRIOR", "StepCost", "ThroughputModel"]

# Feature scales keep the 6×6 normal equations well conditioned: context in thousands of
# tokens, prefill in hundreds, rows × cells in millions, cells in thousands.
_SCALE = (1.0, 1.0, 1e-3, 1e-2, 1e-6, 1e-3)
_N = len(_SCALE)
# A typical magnitude of each scaled feature, to size the ridge towards the prior. The
# prefill term is kept loose on purpose: it is well identified whenever prefill happens, and
# irrelevant to the projection (decode-only steps) when it does not; a firm prior on it
# leaks into the intercept. The per-step cells term is firm on purpose (ten times a typical
# 1K cells): at a constant number of cells it is collinear with the intercept, and a loose
# prior would hand it half of any gap between the prior and the data (here ~14 %).
_TYPICAL = (1.0, 4.0, 4.0, 0.1, 0.5, 10.0)
_MIN_STEP_S = 1e-6


@dataclass(frozen=True)
class StepCost:
    """Parameters of the step-time model, in seconds (``c`` per context token, ``d`` per
    prefill token, ``e`` per batch row per cell in use, ``f`` per cell in use per step)."""

    a: float
    b: float
    c: float
    d: float = 0.0
    e: float = 0.0
    f: float = 0.0

    def step_s(
        self,
        num_decode: float,
        sum_context: float,
        num_prefill: float = 0.0,
        cells_used: float = 0.0,
    ) -> float:
        """Projected wall time of one step (never below a microsecond)."""
        t = (self.a + self.b * num_decode + self.c * sum_context + self.d * num_prefill
             + self.e * (num_decode + num_prefill) * cells_used + self.f * cells_used)
        return max(t, _MIN_STEP_S)

    def as_dict(self) -> dict[str, float]:
        return {"a_s": self.a, "b_s": self.b, "c_s": self.c, "d_s": self.d, "e_s": self.e,
                "f_s": self.f}


# Shaped like the probe on a 2-core CPU (Gemma 3 270M, 900-token prefix): ~10 ms per step
# plus ~20 ms per decoding session. It is only a starting point: real samples replace it
# within a few dozen steps, and a seed replaces it at start-up.
# ``e``: 32 sessions each gaining 1,024 private cells cost +108 ms a step on this machine's
# default model (175 → 283 ms), about 1e-7 s per row per cell.
# ``f``: zero until steps show a per-step cells cost (see the module docstring).
DEFAULT_PRIOR = StepCost(a=0.010, b=0.020, c=1e-6, d=0.005, e=1e-7, f=0.0)


def _features(
    num_decode: float, sum_context: float, num_prefill: float, cells_used: float = 0.0
) -> tuple[float, ...]:
    raw = (1.0, num_decode, sum_context, num_prefill, (num_decode + num_prefill) * cells_used,
           cells_used)
    return tuple(x * s for x, s in zip(raw, _SCALE, strict=True))


def _is_usable(sample: StepSample) -> bool:
    return (
        sample.step_s > 0
        and sample.step_s < 3600
        and sample.num_decode >= 0
        and sample.sum_context >= 0
        and sample.num_prefill_tokens >= 0
        and sample.cells_used >= 0
        and sample.num_decode + sample.num_prefill_tokens > 0
    )


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-18:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


class ThroughputModel:
    """Learns :class:`StepCost` online from :class:`StepSample`s. See the module docstring.

    ``prior_weight`` is the ridge strength in pseudo-samples; ``forget`` the per-sample
    decay of live observations (0.998: about the last 500 steps count).
    """

    def __init__(
        self,
        prior: StepCost = DEFAULT_PRIOR,
        *,
        forget: float = 0.998,
        prior_weight: float = 1.0,
    ) -> None:
        if not 0.0 < forget <= 1.0:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self._prior = prior
        self._forget = forget
        self._prior_weight = prior_weight
        n = _N
        self._live_xx = [[0.0] * n for _ in range(n)]
        self._live_xy = [0.0] * n
        self._seed_xx = [[0.0] * n for _ in range(n)]
        self._seed_xy = [0.0] * n
        self._live_weight = 0.0
        self._num_live = 0
        self._num_seeded = 0
        self._cached: StepCost | None = prior
        self._shape: StepCost | None = prior
        self._last_seen: StepSample | None = None  # held so its identity stays unique

    # ------------------------------------------------------------------ learning

    def seed(self, samples: Iterable[StepSample], weight: float = 1.0) -> int:
        """Add samples that never decay (a start-up micro-benchmark). Returns how many."""
        count = 0
        for s in samples:
            if _is_usable(s):
                self._accumulate(self._seed_xx, self._seed_xy, s, weight)
                count += 1
        self._num_seeded += count
        if count:
            self._cached = self._shape = None
        return count

    def add(self, sample: StepSample) -> bool:
        """Learn from one live step; older live samples decay. False if it was unusable."""
        if not _is_usable(sample):
            return False
        f = self._forget
        for row in self._live_xx:
            for k in range(len(row)):
                row[k] *= f
        for k in range(len(self._live_xy)):
            self._live_xy[k] *= f
        self._live_weight = self._live_weight * f + 1.0
        self._accumulate(self._live_xx, self._live_xy, sample, 1.0)
        self._num_live += 1
        self._cached = None
        return True

    def observe(self, load: PoolLoad) -> int:
        """Learn from the steps in ``load.recent_steps`` not seen in an earlier snapshot.

        Successive snapshots may repeat samples (a window of recent steps). A sample is
        recognised by identity: everything after the last sample seen is new; if that sample
        is not in the window, the whole window is new.
        """
        steps = load.recent_steps
        if not steps:
            return 0
        start = 0
        if self._last_seen is not None:
            for i in range(len(steps) - 1, -1, -1):
                if steps[i] is self._last_seen:
                    start = i + 1
                    break
        for s in steps[start:]:
            self.add(s)
        self._last_seen = steps[-1]
        return len(steps) - start

    @staticmethod
    def _accumulate(xx: list[list[float]], xy: list[float], s: StepSample, weight: float) -> None:
        x = _features(s.num_decode, s.sum_context, s.num_prefill_tokens, s.cells_used)
        for i, xi in enumerate(x):
            xy[i] += weight * xi * s.step_s
            row = xx[i]
            for j, xj in enumerate(x):
                row[j] += weight * xi * xj

    # ------------------------------------------------------------------ reading

    @property
    def params(self) -> StepCost:
        """The current fit (cached until the next sample)."""
        if self._cached is None:
            self._cached = self._fit()
        return self._cached

    @property
    def num_samples(self) -> int:
        """Live samples learned so far (not counting seeded ones)."""
        return self._num_live

    @property
    def num_seeded(self) -> int:
        return self._num_seeded

    def step_s(
        self,
        num_decode: float,
        sum_context: float,
        num_prefill: float = 0.0,
        cells_used: float = 0.0,
    ) -> float:
        return self.params.step_s(num_decode, sum_context, num_prefill, cells_used)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for ``/capacity``."""
        p = self.params
        source = "live" if self._num_live else ("seed" if self._num_seeded else "prior")
        return {
            **p.as_dict(),
            "num_samples": self._num_live,
            "num_seeded": self._num_seeded,
            "source": source,
        }

    @property
    def shape(self) -> StepCost:
        """The fit of the seed (and prior) alone, without live steps: the *shape* of step
        time over rows, context and prefill as measured across 1, 2 and 4 sessions at
        start-up. Live steps taken at one number of rows cannot separate the fixed cost
        from the per-row cost (a pool that ran one worker for a minute fits ``a = 0`` and
        a per-row cost of the whole step); the decode gate multiplies this shape by the
        measured ratio of the latest steps instead."""
        if self._shape is None:
            self._shape = self._fit(live=False)
        return self._shape

    def _fit(self, live: bool = True) -> StepCost:
        p = self._prior
        theta0 = [v / scale
                  for v, scale in zip((p.a, p.b, p.c, p.d, p.e, p.f), _SCALE, strict=True)]
        n = _N
        w = 1.0 if live else 0.0
        data_xx = [[w * self._live_xx[i][j] + self._seed_xx[i][j] for j in range(n)]
                   for i in range(n)]
        data_xy = [w * self._live_xy[i] + self._seed_xy[i] for i in range(n)]
        # Rescale the prior to the data's magnitude (the best multiple of the prior's
        # predictions), so the ridge keeps the prior's *shape* where the data cannot tell
        # (e.g. a constant number of sessions) without biasing a machine 20x faster.
        pred2 = sum(theta0[i] * data_xx[i][j] * theta0[j] for i in range(n) for j in range(n))
        if pred2 > 0:
            kappa = sum(theta0[i] * data_xy[i] for i in range(n)) / pred2
            theta0 = [t * min(max(kappa, 1e-3), 1e3) for t in theta0]
        ridge = [self._prior_weight * t * t for t in _TYPICAL]
        xx = [[data_xx[i][j] + (ridge[i] if i == j else 0.0) for j in range(n)] for i in range(n)]
        xy = [data_xy[i] + ridge[i] * theta0[i] for i in range(n)]
        theta = _constrained_solve(xx, xy, theta0)
        return StepCost(*(t * s for t, s in zip(theta, _SCALE, strict=True)))


def _constrained_solve(
    xx: Sequence[Sequence[float]], xy: Sequence[float], fallback: Sequence[float]
) -> list[float]:
    """Solve the normal equations with a ≥ 0, b > 0, c, d, e, f ≥ 0 by pinning negatives at
    zero (``b`` at its prior) and re-solving the free coefficients."""
    n = len(xy)
    pinned: dict[int, float] = {}
    for _ in range(n):
        free = [i for i in range(n) if i not in pinned]
        m = [[xx[i][j] for j in free] for i in free]
        v = [xy[i] - sum(xx[i][k] * val for k, val in pinned.items()) for i in free]
        sol = _solve(m, v)
        if sol is None:
            return list(fallback)
        theta = dict(pinned)
        theta.update(zip(free, sol, strict=True))
        bad = [i for i in free if theta[i] < 0 or (i == 1 and theta[i] <= 0)]
        if not bad:
            return [theta[i] for i in range(n)]
        worst = min(bad, key=lambda i: theta[i])
        pinned[worst] = fallback[1] if worst == 1 else 0.0
    return list(fallback)
