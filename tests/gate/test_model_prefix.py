"""The step model's prefix term (issue 32, item 3): per row (``c``, ``e``: today's engine)
or once per step (``f``: K/V read once, a shared-prefix kernel), learned from steps."""

from __future__ import annotations

import pytest

from mesh.engine.interface import StepSample
from mesh.gate.decode_gate import prefill_budget
from mesh.gate.model import DEFAULT_PRIOR, StepCost, ThroughputModel

ROWS = (1, 2, 4, 8, 16)
CELLS = (1_000, 4_000, 8_000, 16_000)


def fed(truth: StepCost, rows: tuple[int, ...] = ROWS,
        cells: tuple[int, ...] = CELLS) -> ThroughputModel:
    """A model fed decode steps of ``truth``: every row's context is the prefix (``cells``),
    so ``c`` (per context token) and ``e`` (per row per cell) are the same feature here: the
    per-row prefix cost is ``c + e``."""
    model = ThroughputModel()
    for _ in range(20):
        for n in rows:
            for c in cells:
                model.add(StepSample(n, 0, n * c, truth.step_s(n, n * c, 0, c), cells_used=c))
    return model


def test_the_per_step_cells_term_is_priced_once_whatever_the_rows() -> None:
    cost = StepCost(a=0.01, b=0.002, c=0.0, f=2e-6)
    assert cost.step_s(8, 0, 0, 4_000) - cost.step_s(8, 0, 0, 0) == pytest.approx(8e-3)
    assert cost.step_s(1, 0, 0, 4_000) - cost.step_s(1, 0, 0, 0) == pytest.approx(8e-3)
    assert cost.as_dict()["f_s"] == 2e-6
    assert DEFAULT_PRIOR.f == 0.0  # nothing assumed until steps show it
    assert ThroughputModel().describe()["f_s"] == 0.0


def test_fit_learns_a_prefix_read_once_per_step() -> None:
    # A shared-prefix engine: 3 ms per 1K prefix cells a step, nothing more per row.
    truth = StepCost(a=0.005, b=0.004, c=0.0, d=0.0, e=0.0, f=3e-6)
    model = fed(truth)
    fit = model.params
    assert fit.f == pytest.approx(truth.f, rel=0.05)
    assert (fit.c + fit.e) * 16 * 16_000 < 0.05 * truth.step_s(16, 0, 0, 16_000)  # per row
    # 32 rows over 32K cells, beyond every step it saw: priced once, not 32 times.
    assert model.step_s(32, 32 * 32_000, 0, 32_000) == pytest.approx(
        truth.step_s(32, 32 * 32_000, 0, 32_000), rel=0.05)


def test_fit_keeps_today_per_row_prefix_term() -> None:
    # Today's engine: every row pays the prefix (FA on this CPU), nothing once per step.
    truth = StepCost(a=0.008, b=0.006, c=0.0, d=0.0, e=1e-7, f=0.0)
    fit = fed(truth).params
    assert fit.c + fit.e == pytest.approx(truth.e, rel=0.05)
    assert fit.f * 16_000 < 0.02 * truth.step_s(1, 0, 0, 16_000)


def test_fit_splits_a_path_that_pays_both() -> None:
    # llama.cpp's non-flash path: K/V read once per step, the FLOPs per row.
    truth = StepCost(a=0.006, b=0.005, c=0.0, d=0.0, e=5e-8, f=1.5e-6)
    model = fed(truth)
    fit = model.params
    assert fit.c + fit.e == pytest.approx(truth.e, rel=0.1)
    assert fit.f == pytest.approx(truth.f, rel=0.1)
    assert model.step_s(32, 32 * 32_000, 0, 32_000) == pytest.approx(
        truth.step_s(32, 32 * 32_000, 0, 32_000), rel=0.05)


def test_a_constant_number_of_cells_leaves_the_step_cost_in_the_intercept() -> None:
    # A pool at one prefix, no private text: cells never vary, so ``f`` is collinear with
    # ``a``; the prior says zero and the data cannot say otherwise.
    truth = StepCost(a=0.04, b=0.01, c=0.0)  # 4x the prior's intercept
    model = fed(truth, rows=(1, 2, 4, 8), cells=(4_000,))
    fit = model.params
    assert fit.f * 4_000 < 0.2 * (truth.a - DEFAULT_PRIOR.a)
    for n in (1, 2, 4, 8):
        assert model.step_s(n, n * 4_000, 0, 4_000) == pytest.approx(
            truth.step_s(n, n * 4_000, 0, 4_000), rel=0.03)


def test_the_prefill_budget_counts_the_per_step_cells() -> None:
    without = StepCost(a=0.01, b=0.01, c=0.0, d=0.001)
    with_f = StepCost(a=0.01, b=0.01, c=0.0, d=0.001, f=2e-6)  # +20 ms at 10K cells
    floor = 10.0  # 100 ms a step
    assert prefill_budget(without, floor, 2, 10_000) == 70
    assert prefill_budget(with_f, floor, 2, 10_000) == 50
