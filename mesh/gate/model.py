"""The gate's throughput model of a step, and seeding it from a probe of this machine.
Read top to bottom:

**The model.** The online throughput model: how long one engine step takes for a given load.

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
(``bench/prefix_attention`` measures the per-step and per-row slopes).

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

**Seeding.** Seeding the throughput model at start-up: a short probe, cached per model and machine.

This is the gate's only module with I/O (the engine and one small JSON file); the model
itself stays pure. A seed is a handful of :class:`StepSample`s; :meth:`ThroughputModel.seed`
keeps them for good, so the model can tell fixed cost from per-session cost even before
the pool has seen varied load.

``mesh serve`` seeds from :func:`quick_probe` (a few steps at 1, 2 and 4 sessions: about a
second on the default model on a quiet 2-core machine), and the model learns
the rest online from the pool's own steps, whose live samples soon outweigh the seed; the
model's prior fills in what the probe cannot tell apart. :func:`micro_benchmark` with its
defaults (1 to 16 sessions, 512 private tokens each: a minute or more on a CPU) is the full
measurement ``bench/gate`` uses and ``seed_model(..., full=True)`` asks for.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from mesh.engine.config import SamplingParams
from mesh.engine.interface import Engine, PoolInfo, PoolLoad, Session, StepSample

__all__ = [
    "DEFAULT_PRIOR", "QUICK_PRIVATE_TOKENS", "QUICK_SIZES", "QUICK_TOKENS", "SeedError", "StepCost",
    "ThroughputModel", "load_seed", "micro_benchmark", "quick_probe", "read_seed", "save_seed",
    "seed_model", "seed_path"
]


# -------------------- the model -----------------------------------------------

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

# -------------------- seeding -------------------------------------------------

# 2: sizes up to 16 (a fit on 1, 2, 4 under-estimated the slope at 8+); 3: cells_used, and
# each size also run with private text held (the rows × cells term). A quick probe's seed
# has the same schema (fewer samples), so a full benchmark cached earlier is still read.
_FORMAT = 3

# The start-up probe: 3 sizes × 6 steps (plus each size's prefill step of a few tokens).
# Small on purpose: the slope at 8+ sessions and the cells terms come from the prior, then
# from live steps. No private text: on SmolLM2 (2 busy cores) prefilling 96 private tokens
# per session cost 19 of the probe's 23 s, for a cells term it barely identified.
QUICK_SIZES = (1, 2, 4)
QUICK_TOKENS = 6
QUICK_PRIVATE_TOKENS = (0,)


class SeedError(ValueError):
    """A cached seed exists but cannot be used; the message says why."""


def seed_path(cache_dir: str | os.PathLike[str], info: PoolInfo) -> Path:
    """Where the seed for this model on this machine lives."""
    key = json.dumps(
        {
            "format": _FORMAT,
            "model": info.model_name,
            "model_path": os.path.basename(info.model_path),
            "n_vocab": info.n_vocab,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "node": platform.node(),
            "cpus": os.cpu_count(),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir) / f"gate-seed-{digest}.json"


def read_seed(path: Path) -> tuple[StepSample, ...] | None:
    """The cached samples; None if there is no file; :class:`SeedError` if the file is
    there but unreadable, of another format, or holds no sample."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise SeedError(f"cannot read it: {exc}") from None
    try:
        raw = json.loads(text)
        if raw.get("format") != _FORMAT:
            raise SeedError(f"format {raw.get('format')!r}, this mesh reads {_FORMAT}")
        samples = tuple(
            StepSample(
                num_decode=int(s["num_decode"]),
                num_prefill_tokens=int(s["num_prefill_tokens"]),
                sum_context=int(s["sum_context"]),
                step_s=float(s["step_s"]),
                cells_used=int(s.get("cells_used", 0)),
            )
            for s in raw["samples"]
        )
    except SeedError:
        raise
    except ValueError as exc:  # json.JSONDecodeError is one
        raise SeedError(f"not valid: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise SeedError(f"not a seed file ({type(exc).__name__}: {exc})") from None
    if not samples:
        raise SeedError("it holds no samples")
    return samples


def load_seed(path: Path) -> tuple[StepSample, ...] | None:
    """The cached samples, or None if missing or unreadable (a bad cache is ignored)."""
    try:
        return read_seed(path)
    except SeedError:
        return None


def save_seed(path: Path, samples: Sequence[StepSample]) -> None:
    """Write the samples atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "format": _FORMAT,
        "samples": [
            {
                "num_decode": s.num_decode,
                "num_prefill_tokens": s.num_prefill_tokens,
                "sum_context": s.sum_context,
                "step_s": s.step_s,
                "cells_used": s.cells_used,
            }
            for s in samples
        ],
    }
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


async def micro_benchmark(
    engine: Engine,
    sizes: Sequence[int] = (1, 2, 4, 8, 16),
    num_tokens: int = 10,
    text: str = "Count slowly from one to twenty:",
    private_tokens: Sequence[int] = (0, 512),
) -> tuple[StepSample, ...]:
    """Run ``num_tokens`` steps with each number of sessions in ``sizes`` decoding together,
    once per entry of ``private_tokens``: each session first holds about that many tokens
    of private text (clamped to half its budget), so the fit sees step time grow with
    rows × cells used, not only with the number of rows.

    Returns the engine's own step samples taken meanwhile; an engine that reports none gets
    one synthesized sample per size (wall time / tokens). Sizes the pool cannot attach are
    skipped. Every session attached here is detached before returning.
    """
    samples: list[StepSample] = []
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, stop_at_eos=False)
    room = max(0, engine.info.session_budget // 2 - num_tokens - 32)
    for size, private in [(n, p) for p in private_tokens for n in sizes]:
        filler = " one" * min(max(private, 0), room)
        sessions: list[Session] = []
        try:
            for _ in range(size):
                if not engine.check_attach().ok:
                    break
                sessions.append(await engine.attach())
            if len(sessions) < size:
                continue
            before = engine.load().recent_steps
            last = before[-1] if before else None
            started = anyio.current_time()
            async with anyio.create_task_group() as tg:
                for s in sessions:
                    s.append(filler + " " + text if filler else text)
                    tg.start_soon(_drain, s, params)
            wall = anyio.current_time() - started
            steps = engine.load().recent_steps
            new = steps
            for i in range(len(steps) - 1, -1, -1):
                if steps[i] is last:
                    new = steps[i + 1 :]
                    break
            if new:
                samples.extend(new)
            else:
                ctx = sum(s.context_len for s in sessions)
                samples.append(StepSample(size, 0, ctx, wall / num_tokens,
                                          engine.load().cells_used))
        finally:
            with anyio.CancelScope(shield=True):
                for s in sessions:
                    await s.detach()
    return tuple(samples)


async def _drain(session: Session, params: SamplingParams) -> None:
    async for _ in session.generate(params):
        pass


async def quick_probe(engine: Engine) -> tuple[StepSample, ...]:
    """The start-up probe: :func:`micro_benchmark` at :data:`QUICK_SIZES` sessions,
    :data:`QUICK_TOKENS` steps each, with :data:`QUICK_PRIVATE_TOKENS` private text."""
    return await micro_benchmark(engine, sizes=QUICK_SIZES, num_tokens=QUICK_TOKENS,
                                 private_tokens=QUICK_PRIVATE_TOKENS)


async def seed_model(
    model: ThroughputModel,
    engine: Engine,
    cache_dir: str | os.PathLike[str] | None,
    *,
    refresh: bool = False,
    announce: Callable[[], None] | None = None,
    on_corrupt: Callable[[Path, str], None] | None = None,
    full: bool = False,
) -> str:
    """Seed ``model`` from the cache, else from a probe (then cached): :func:`quick_probe`
    (seconds), or with ``full`` the whole :func:`micro_benchmark` (a minute or more).

    ``announce`` is called just before a probe runs because there was no seed;
    ``on_corrupt(path, reason)`` instead when there was one that cannot be used (it is
    then replaced; without ``on_corrupt``, ``announce`` is called in that case too).
    Returns where the seed came from: ``"cache"`` or ``"benchmark"``.
    """
    path = seed_path(cache_dir, engine.info) if cache_dir is not None else None
    corrupt: str | None = None
    if path is not None and not refresh:
        try:
            cached = read_seed(path)
        except SeedError as exc:
            cached, corrupt = None, str(exc)
        if cached:
            model.seed(cached)
            return "cache"
    if corrupt is not None and path is not None and on_corrupt is not None:
        on_corrupt(path, corrupt)
    elif announce is not None:
        announce()
    samples = await (micro_benchmark(engine) if full else quick_probe(engine))
    model.seed(samples)
    if path is not None and samples:
        # A read-only cache only costs the next start another probe.
        with contextlib.suppress(OSError):
            save_seed(path, samples)
    return "benchmark"
