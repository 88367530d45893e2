"""The online step-time model: fits, priors, seeding, forgetting, de-duplication."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.engine.interface import PoolLoad, StepSample
from mesh.gate.model import DEFAULT_PRIOR, StepCost, ThroughputModel

# The probe in DESIGN.md: Gemma 3 270M, 900-token prefix, 2 CPU threads.
PROBE = [(1, 0.031), (2, 0.055), (4, 0.094), (8, 0.186), (16, 0.343)]


def sample(n: int, ctx: int, step_s: float, prefill: int = 0) -> StepSample:
    return StepSample(num_decode=n, num_prefill_tokens=prefill, sum_context=ctx, step_s=step_s)


def load_with(steps: tuple[StepSample, ...]) -> PoolLoad:
    return PoolLoad(
        taken_at=0.0,
        sessions=(),
        step_ms=None,
        agg_tps=0.0,
        cells_used=0,
        cells_total=1000,
        prefix_cells=0,
        naive_cells=0,
        free_seq_ids=4,
        max_sessions=4,
        session_budget=100,
        recent_steps=steps,
    )


def test_empty_model_is_its_prior() -> None:
    model = ThroughputModel()
    assert model.params == DEFAULT_PRIOR
    assert model.describe()["source"] == "prior"
    assert model.num_samples == 0


def test_recovers_known_coefficients() -> None:
    truth = StepCost(a=0.004, b=0.011, c=3e-6, d=0.002)
    model = ThroughputModel()
    for n in (1, 2, 3, 5, 8, 13):
        for ctx_each in (500, 1500, 4000):
            for prefill in (0, 0, 64):
                model.add(sample(n, n * ctx_each, truth.step_s(n, n * ctx_each, prefill), prefill))
    got = model.params
    assert got.a == pytest.approx(truth.a, rel=0.05, abs=2e-4)
    assert got.b == pytest.approx(truth.b, rel=0.02)
    assert got.c == pytest.approx(truth.c, rel=0.05)
    assert got.d == pytest.approx(truth.d, rel=0.05)


def test_fits_the_probe_table_within_ten_percent() -> None:
    model = ThroughputModel()
    for _ in range(20):
        for n, step in PROBE:
            model.add(sample(n, n * 900, step))
    for n, step in PROBE:
        assert model.step_s(n, n * 900) == pytest.approx(step, rel=0.10)


def test_a_machine_far_from_the_prior_is_not_biased_towards_it() -> None:
    # A GPU-like pool: 4 ms a step at a constant 4 sessions, 25x faster than the prior.
    model = ThroughputModel()
    for _ in range(200):
        model.add(sample(4, 4000, 0.004))
    assert model.step_s(4, 4000) == pytest.approx(0.004, rel=0.02)
    assert model.step_s(5, 5000) > model.step_s(4, 4000)


def test_coefficients_stay_physical_on_adversarial_data() -> None:
    model = ThroughputModel()
    for n, step in [(1, 0.3), (2, 0.2), (4, 0.1), (8, 0.05)]:  # faster with more sessions
        for _ in range(10):
            model.add(sample(n, n * 100, step))
    p = model.params
    assert p.b > 0 and p.a >= 0 and p.c >= 0 and p.d >= 0


def test_forgetting_follows_a_slower_machine() -> None:
    model = ThroughputModel(forget=0.99)
    for _ in range(300):
        for n, step in PROBE:
            model.add(sample(n, n * 900, step))
    for _ in range(300):
        for n, step in PROBE:
            model.add(sample(n, n * 900, 2 * step))
    assert model.step_s(4, 3600) == pytest.approx(2 * 0.094, rel=0.10)


def test_seed_keeps_the_slope_when_live_load_is_constant() -> None:
    truth = StepCost(a=0.002, b=0.030, c=0.0)
    seeded = ThroughputModel(forget=0.95)
    seeded.seed(sample(n, n * 100, truth.step_s(n, n * 100)) for n in (1, 2, 4))
    for _ in range(500):
        seeded.add(sample(4, 400, truth.step_s(4, 400)))
    assert seeded.num_seeded == 3
    assert seeded.step_s(5, 500) == pytest.approx(truth.step_s(5, 500), rel=0.05)
    assert seeded.describe()["source"] == "live"


def test_unusable_samples_are_ignored() -> None:
    model = ThroughputModel()
    bad = [
        sample(1, 100, 0.0),
        sample(1, 100, -1.0),
        sample(1, 100, math.nan),
        sample(1, 100, math.inf),
        sample(0, 0, 0.01),  # no work in the step
        sample(-1, 100, 0.01),
    ]
    assert [model.add(s) for s in bad] == [False] * len(bad)
    assert model.seed(bad) == 0
    assert model.params == DEFAULT_PRIOR


def test_observe_counts_each_step_once_across_overlapping_windows() -> None:
    steps = [sample(1, 100, 0.03 + i * 1e-4) for i in range(6)]
    model = ThroughputModel()
    assert model.observe(load_with(tuple(steps[:3]))) == 3
    assert model.observe(load_with(tuple(steps[1:5]))) == 2  # 1, 2 seen; 3, 4 new
    assert model.observe(load_with(tuple(steps[1:5]))) == 0
    assert model.observe(load_with(())) == 0
    assert model.observe(load_with(tuple(steps[5:]))) == 1  # last seen not in window
    assert model.num_samples == 6


def test_equal_but_distinct_samples_are_both_new() -> None:
    a, b = sample(2, 200, 0.05), sample(2, 200, 0.05)
    model = ThroughputModel()
    model.observe(load_with((a,)))
    assert model.observe(load_with((a, b))) == 1


@pytest.mark.parametrize(("forget", "prior_weight"), [(0.0, 1.0), (1.5, 1.0), (0.99, 0.0)])
def test_bad_arguments_are_refused(forget: float, prior_weight: float) -> None:
    with pytest.raises(ValueError):
        ThroughputModel(forget=forget, prior_weight=prior_weight)


samples = st.builds(
    sample,
    n=st.integers(0, 64),
    ctx=st.integers(0, 200_000),
    step_s=st.floats(1e-5, 10.0),
    prefill=st.integers(0, 512),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(samples, max_size=40), st.lists(samples, max_size=5))
def test_any_fit_is_physical_and_monotone(live: list[StepSample], seed: list[StepSample]) -> None:
    model = ThroughputModel()
    model.seed(seed)
    for s in live:
        model.add(s)
    p = model.params
    assert p.b > 0 and p.a >= 0 and p.c >= 0 and p.d >= 0
    assert all(math.isfinite(v) for v in (p.a, p.b, p.c, p.d))
    for n in range(1, 10):
        assert model.step_s(n + 1, (n + 1) * 1000) >= model.step_s(n, n * 1000)


def test_fit_recovers_the_rows_times_cells_coefficient() -> None:
    # A synthetic machine where idle sessions' cells slow every decoding row.
    truth = StepCost(a=0.008, b=0.006, c=0.0, d=0.001, e=1.2e-7)
    model = ThroughputModel()
    for n in (1, 2, 4, 8, 16, 32):
        for cells in (1_000, 9_000, 33_000):
            for p in (0, 64):
                model.add(StepSample(n, p, n * 1_000, truth.step_s(n, n * 1_000, p, cells),
                                     cells_used=cells))
    fit = model.params
    assert fit.e == pytest.approx(truth.e, rel=0.05)
    assert fit.b == pytest.approx(truth.b, rel=0.05)
    # 32 rows over 33k cells: the term the old model could not see is ~60 % of the step.
    assert model.step_s(32, 32_000, 0, 33_000) == pytest.approx(
        truth.step_s(32, 32_000, 0, 33_000), rel=0.02)


def test_without_cells_the_fit_keeps_the_old_shape() -> None:
    model = ThroughputModel()
    for n, t in PROBE * 20:
        model.add(sample(n, 0, t))
    for n, t in PROBE:
        assert model.step_s(n, 0) == pytest.approx(t, rel=0.15)


def test_shape_is_the_seed_fit_and_ignores_live_steps_at_one_row_count() -> None:
    model = ThroughputModel()
    seed = [StepSample(n, 0, 0, 0.010 + 0.005 * n) for n in (1, 2, 4) for _ in range(4)]
    model.seed(seed)
    shape = model.shape
    assert shape.b == pytest.approx(0.005, rel=0.3)  # the ridge leans on the prior a little
    # A minute of one worker on a slower machine: the live fit cannot split a from b...
    for _ in range(400):
        model.add(StepSample(1, 0, 0, 0.045))
    assert model.shape == shape  # ...the shape stays the seed's
    assert model.params != shape  # the live fit moved; the shape did not
