"""The start-up micro-benchmark and its cache, over FakeEngine."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.engine.fake import FakeEngine
from mesh.engine.types import StepSample
from mesh.gate.calibrate import load_seed, micro_benchmark, save_seed, seed_model, seed_path
from mesh.gate.model import ThroughputModel

pytestmark = pytest.mark.anyio


async def test_micro_benchmark_detaches_and_skips_what_cannot_attach() -> None:
    engine = FakeEngine(max_sessions=2, prefix_tokens=50)
    samples = await micro_benchmark(engine, sizes=(1, 2, 4), num_tokens=3)
    # FakeEngine reports no steps: one synthesized sample per size that fit, first with
    # no private text, then with private text held (more cells in use).
    assert [s.num_decode for s in samples] == [1, 2, 1, 2]
    assert samples[2].cells_used > samples[0].cells_used
    assert samples[3].cells_used > samples[1].cells_used
    assert all(s.step_s >= 0 for s in samples)
    assert not engine.sessions


async def test_seed_model_caches_per_model(tmp_path: Path) -> None:
    engine = FakeEngine()
    first = ThroughputModel()
    assert await seed_model(first, engine, tmp_path) == "benchmark"
    assert seed_path(tmp_path, engine.info).is_file()
    second = ThroughputModel()
    assert await seed_model(second, engine, tmp_path) == "cache"
    assert second.num_seeded == first.num_seeded


def test_seed_round_trip_and_bad_cache(tmp_path: Path) -> None:
    path = tmp_path / "seed.json"
    samples = (StepSample(1, 0, 900, 0.031), StepSample(4, 12, 3600, 0.094))
    save_seed(path, samples)
    assert load_seed(path) == samples
    path.write_text("{broken")
    assert load_seed(path) is None
    assert load_seed(tmp_path / "missing.json") is None
