"""The start-up probe, the full micro-benchmark and the seed cache, over FakeEngine."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.engine.interface import StepSample
from mesh.gate.model import (
    QUICK_PRIVATE_TOKENS,
    QUICK_SIZES,
    QUICK_TOKENS,
    SeedError,
    ThroughputModel,
    load_seed,
    micro_benchmark,
    quick_probe,
    read_seed,
    save_seed,
    seed_model,
    seed_path,
)
from mesh.sim.fake import FakeEngine

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


# --------------------------------------------------------------------------- quick start


async def test_seed_model_runs_a_short_probe_not_the_full_benchmark(tmp_path: Path) -> None:
    # The start-up probe stays small (issue 25 item 4: first answer within 20 s): a few
    # sizes up to 4 sessions, a little private text; the fit takes the rest from the prior
    # and from live steps. The full benchmark (up to 16 sessions × 512 private tokens) took
    # ~90 s on SmolLM2 at start-up.
    engine = FakeEngine(max_sessions=16)
    model = ThroughputModel()
    assert await seed_model(model, engine, tmp_path) == "benchmark"
    sizes = {s.num_decode for s in load_seed(seed_path(tmp_path, engine.info)) or ()}
    assert sizes == set(QUICK_SIZES) and max(sizes) <= 4
    assert QUICK_TOKENS <= 8 and max(QUICK_PRIVATE_TOKENS) <= 128
    assert engine.prefill_tokens <= 2_000, "the probe prefills a few hundred tokens at most"
    assert model.num_seeded == len(QUICK_SIZES) * len(QUICK_PRIVATE_TOKENS)
    full = ThroughputModel()
    await seed_model(full, FakeEngine(max_sessions=16), None, full=True)
    assert full.num_seeded == 10  # 1, 2, 4, 8, 16 sessions × with and without private text


async def test_quick_probe_detaches_everything() -> None:
    engine = FakeEngine(max_sessions=2)
    samples = await quick_probe(engine)
    fit = [1, 2] * len(QUICK_PRIVATE_TOKENS)  # 4 sessions do not fit
    assert [s.num_decode for s in samples] == fit
    assert not engine.sessions


# --------------------------------------------------------------------------- corrupt seed


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("{broken", "not valid"),
        ('{"format": 3, "samples": []}', "no samples"),
        ('{"format": 1, "samples": []}', "format 1"),
        ('{"format": 3, "samples": [{"num_decode": 1}]}', "not a seed file"),
        ("[1, 2]", "not a seed file"),
    ],
    ids=["json", "empty", "old-format", "missing-key", "not-an-object"],
)
async def test_a_corrupt_seed_is_reported_as_such_and_rebuilt(
    tmp_path: Path, body: str, why: str
) -> None:
    engine = FakeEngine()
    path = seed_path(tmp_path, engine.info)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    announced: list[str] = []
    corrupt: list[tuple[Path, str]] = []
    source = await seed_model(ThroughputModel(), engine, tmp_path,
                              announce=lambda: announced.append("first start"),
                              on_corrupt=lambda p, reason: corrupt.append((p, reason)))
    assert source == "benchmark"
    assert announced == [], "a corrupt seed is not a first start"
    assert len(corrupt) == 1 and corrupt[0][0] == path and why in corrupt[0][1], corrupt
    assert load_seed(path), "the seed was rebuilt"
    with pytest.raises(SeedError):
        bad = tmp_path / "bad.json"
        bad.write_text(body)
        read_seed(bad)


async def test_a_missing_seed_is_a_first_start(tmp_path: Path) -> None:
    announced: list[str] = []
    corrupt: list[tuple[Path, str]] = []
    await seed_model(ThroughputModel(), FakeEngine(), tmp_path,
                     announce=lambda: announced.append("first start"),
                     on_corrupt=lambda p, reason: corrupt.append((p, reason)))
    assert announced == ["first start"] and corrupt == []
    assert read_seed(tmp_path / "missing.json") is None
