"""The weights the engine loads (``--weights``): which files ``auto`` converts, the cache,
and that a converted file runs through the real pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import ModelError
from mesh.engine.llama import quantize_file
from mesh.engine.models import _FTYPE, cpu_weights, file_type
from mesh.engine.pool import SharedKVPool


@pytest.fixture(scope="module")
def q4_1_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model stored as Q4_1 (SmolLM2's type: no repacked CPU kernel)."""
    out = tmp_path_factory.mktemp("q41") / "tiny-q4_1.gguf"
    quantize_file(tiny_model_path, out, _FTYPE["q4_1"], threads=1)
    return out


def test_auto_converts_q4_1_to_q8_0_once(q4_1_model: Path, tmp_path: Path) -> None:
    assert file_type(q4_1_model) == _FTYPE["q4_1"]
    first = cpu_weights(q4_1_model, "auto", on_gpu=False, cache_dir=tmp_path)
    assert first.path != q4_1_model and first.path.parent == tmp_path / "weights"
    assert file_type(first.path) == _FTYPE["q8_0"]
    assert first.described == "q8_0 from Q4_1" and not first.extra_buffers
    stamp = first.path.stat().st_mtime_ns
    again = cpu_weights(q4_1_model, "auto", on_gpu=False, cache_dir=tmp_path)
    assert again == first and again.path.stat().st_mtime_ns == stamp  # cached, not rewritten
    assert not list((tmp_path / "weights").glob("*.tmp*"))  # no temp file left behind


def test_auto_leaves_other_types_and_gpus_alone(tiny_model_path: Path, q4_1_model: Path,
                                                tmp_path: Path) -> None:
    as_is = cpu_weights(tiny_model_path, "auto", on_gpu=False, cache_dir=tmp_path)
    assert as_is.path == tiny_model_path and as_is.described == "as-is (F32)"
    on_gpu = cpu_weights(q4_1_model, "auto", on_gpu=True, cache_dir=tmp_path)
    assert on_gpu.path == q4_1_model and on_gpu.described == "as-is (Q4_1)"
    kept = cpu_weights(q4_1_model, "as-is", on_gpu=False, cache_dir=tmp_path)
    assert kept.path == q4_1_model
    assert not (tmp_path / "weights").exists()


def test_q4_0_asks_for_repacked_buffers(q4_1_model: Path, tmp_path: Path) -> None:
    w = cpu_weights(q4_1_model, "q4_0", on_gpu=False, cache_dir=tmp_path)
    assert file_type(w.path) == _FTYPE["q4_0"]
    assert w.described.startswith("q4_0 from Q4_1")


def test_bad_choice_and_bad_file_name_the_fix(q4_1_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--weights must be one of auto"):
        cpu_weights(q4_1_model, "q5", on_gpu=False, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="weights must be auto"):
        EngineConfig(model_path=str(q4_1_model), weights="fast").validate()
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelError):
        cpu_weights(junk, "q8_0", on_gpu=False, cache_dir=tmp_path)


def test_a_converted_pool_decodes_and_says_what_it_loaded(
        q4_1_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the conversion's cache
    cfg = EngineConfig(model_path=str(q4_1_model), max_sessions=2, session_budget=64,
                       n_threads=1)

    async def run() -> tuple[str, list[int]]:
        pool = SharedKVPool(cfg, "a shared prefix for two sessions")
        info = await pool.start()
        try:
            session = await pool.attach()
            session.append("hello")
            pieces = [p async for p in session.generate(
                SamplingParams(max_tokens=4, temperature=0.0))]
            await session.detach()
            return info.weights, [p.token for p in pieces if p.token >= 0]
        finally:
            await pool.aclose()

    described, pieces = asyncio.run(run())
    assert described == "q8_0 from Q4_1"
    assert len(pieces) == 4
    assert list((tmp_path / "mesh" / "models" / "weights").glob("*.q8_0.gguf"))
