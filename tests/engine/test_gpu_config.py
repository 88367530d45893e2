"""GPU-ready configuration, checked on the CPU: KV cache types, flash attention, the
training-context check, the KV tier for a given memory size, and mesh serve's flags."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from mesh.cli import compose as engine_flags
from mesh.cli.compose import apply_engine_flags, kv_memory_bytes
from mesh.engine.build import check_context
from mesh.engine.config import GIB, EngineConfig, KVShape, SamplingParams, choose_tier
from mesh.engine.llama import LlamaModel
from mesh.engine.models import write_tiny_model
from mesh.engine.pool import SharedKVPool
from tests.engine.flag_args import parse


@pytest.fixture(scope="module")
def tiny32_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose heads hold 32 elements: one q8_0/q4_0 block each."""
    return write_tiny_model(tmp_path_factory.mktemp("m32") / "tiny32.gguf", n_embd=128)


PREFIX = "The shared project prefix: tools, files and notes. " * 4
GEMMA_270M = KVShape(layers=18, kv_heads=1, head_k=256, head_v=256)


# ------------------------------------------------------------------ the tier (pure)


def test_cell_bytes_follow_ggml_block_sizes() -> None:
    assert GEMMA_270M.cell_bytes("f16") == 18 * 512 * 2
    assert GEMMA_270M.cell_bytes("q8_0") == 18 * 512 * 34 / 32
    assert GEMMA_270M.cell_bytes("q4_0") == 18 * 512 * 18 / 32


def test_tier_keeps_f16_when_the_wanted_sessions_fit() -> None:
    tier = choose_tier(GEMMA_270M, 8 * GIB, prefix_tokens=32768 - 4096, session_budget=2048,
                       want_sessions=16)
    cells = int(8 * GIB // GEMMA_270M.cell_bytes("f16")) - 255
    assert tier.kv_type == "f16"
    assert tier.sessions == min(255, (cells - 28672) // 2048) and tier.sessions >= 16
    assert tier.n_ctx == 28672 + tier.sessions * 2048
    assert tier.n_ctx * tier.cell_bytes <= 8 * GIB
    assert tier.naive_sessions == cells // (28672 + 2048)
    assert tier.naive_sessions < tier.sessions
    assert "f16" in tier.describe() and f"{tier.sessions} session slots" in tier.describe()


def test_tier_quantizes_when_f16_cannot_hold_the_wanted_sessions() -> None:
    # 1 GiB at f16 holds ~58K cells; 28K prefix + 32 x 2048 = 94K cells needs q8_0 or less.
    q8 = choose_tier(GEMMA_270M, GIB, prefix_tokens=28672, session_budget=2048,
                     want_sessions=32)
    assert q8.kv_type == "q8_0" and q8.sessions >= 32
    q4 = choose_tier(GEMMA_270M, GIB, prefix_tokens=28672, session_budget=2048,
                     want_sessions=60)
    assert q4.kv_type == "q4_0"
    assert q4.n_ctx * q4.cell_bytes <= GIB


def test_tier_caps_slots_and_refuses_memory_that_holds_nothing() -> None:
    big = choose_tier(GEMMA_270M, 64 * GIB, prefix_tokens=4096, session_budget=1024,
                      want_sessions=16)
    assert big.sessions == 255 and big.kv_type == "f16"
    with pytest.raises(ValueError, match="raise --kv-memory"):
        choose_tier(GEMMA_270M, GIB // 64, prefix_tokens=28672, session_budget=2048,
                    want_sessions=1)
    odd = KVShape(layers=2, kv_heads=3, head_k=16, head_v=16)  # heads of 16: f16 only
    assert choose_tier(odd, GIB, prefix_tokens=10, session_budget=64,
                       want_sessions=10_000).kv_type == "f16"
    with pytest.raises(ValueError, match="use --kv-type f16"):
        choose_tier(odd, GIB, prefix_tokens=10, session_budget=64, want_sessions=1,
                    types=("q8_0",))


# ------------------------------------------------------------------ config on the tiny model


def test_training_context_is_checked_with_the_fix_named(tmp_path: Path) -> None:
    short = write_tiny_model(tmp_path / "short.gguf", n_ctx_train=4096)
    check_context(32768, 30000, 2048, "m")  # fits
    check_context(0, 10**6, 10**6, "m")  # unknown: not checked
    with pytest.raises(ValueError, match="lower --prefix-tokens or --session-budget"):
        check_context(32768, 131072, 2048, "gemma")

    async def body() -> None:
        pool = SharedKVPool(EngineConfig(model_path=str(short), max_sessions=2,
                                         session_budget=4090, n_threads=1), PREFIX)
        with pytest.raises(ValueError, match="4096-token context"):
            await pool.start()

    asyncio.run(body())


@pytest.mark.parametrize("kw", [{"flash_attn": "sometimes"}, {"kv_type": "q2_k"},
                                {"kv_type": "q8_0", "flash_attn": "off"}])
def test_bad_gpu_config_is_a_clear_error(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"flash|kv_type"):
        EngineConfig(model_path="m.gguf", **kw).validate()


@pytest.mark.parametrize(("kv_type", "flash_attn"),
                         [("f16", "off"), ("f16", "on"), ("q8_0", "on"), ("q4_0", "auto")])
def test_kv_types_and_flash_attention_decode(tiny32_path: Path, kv_type: str,
                                             flash_attn: str) -> None:
    async def body() -> list[int]:
        pool = SharedKVPool(EngineConfig(model_path=str(tiny32_path), max_sessions=2,
                                         session_budget=64, n_threads=1, kv_type=kv_type,
                                         flash_attn=flash_attn), PREFIX)
        await pool.start()
        try:
            s = await pool.attach()
            s.append("hello")
            params = SamplingParams(max_tokens=6, stop_at_eos=False)
            return [p.token async for p in s.generate(params)]
        finally:
            await pool.aclose()

    assert len(asyncio.run(body())) == 6


def test_kv_shape_comes_from_the_gguf(tiny_model_path: Path, tiny32_path: Path) -> None:
    for path, head in ((tiny_model_path, 16), (tiny32_path, 32)):
        m = LlamaModel(path, vocab_only=True)
        try:
            assert m.kv_shape() == (2, 2, head, head, 131072)  # 2 blocks, 2 KV heads
        finally:
            m.close()


def test_quantized_cache_of_a_model_with_small_heads_names_the_fix(
    tiny_model_path: Path,
) -> None:
    async def body() -> None:
        pool = SharedKVPool(EngineConfig(model_path=str(tiny_model_path), max_sessions=2,
                                         session_budget=64, n_threads=1, kv_type="q8_0"),
                            PREFIX)
        with pytest.raises(ValueError, match=r"heads of 16 elements.*--kv-type f16"):
            await pool.start()

    asyncio.run(body())


# ------------------------------------------------------------------ mesh serve's flags


def test_flags_map_to_the_engine_config(tiny_model_path: Path) -> None:
    base = EngineConfig(model_path=str(tiny_model_path))
    cfg = apply_engine_flags(base, parse(), PREFIX)
    assert (cfg.native, cfg.n_gpu_layers, cfg.flash_attn, cfg.kv_type) == (None, -1, "auto",
                                                                           "f16")
    cfg = apply_engine_flags(base, parse("--native", "off", "--gpu-layers", "0",
                                         "--flash-attn", "on", "--kv-type", "q8_0"), PREFIX)
    assert (cfg.native, cfg.n_gpu_layers, cfg.flash_attn, cfg.kv_type) == (False, 0, "on",
                                                                           "q8_0")
    assert apply_engine_flags(base, parse("--native", "on"), PREFIX).native is True


def test_kv_memory_picks_and_prints_a_tier(tiny32_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    base = EngineConfig(model_path=str(tiny32_path), session_budget=256)
    # This model's cell: 2 layers x (64 K + 64 V) elements; f16 = 512 bytes.
    args = parse("--kv-memory", "0.002", "--session-budget", "256", "--max-sessions", "8")
    cfg = apply_engine_flags(base, args, PREFIX)
    line = capsys.readouterr().err.strip()
    assert line.startswith("kv tier: f16") and "session slots" in line
    cells = int(0.002 * GIB // 512) - 255
    prefix = cfg.n_ctx - cfg.max_sessions * 256 if cfg.n_ctx else 0
    assert cfg.max_sessions == (cells - prefix) // 256 >= 8
    # Ask for more than f16 holds in that memory: the tier quantizes.
    more = apply_engine_flags(base, parse("--kv-memory", "0.002", "--session-budget", "256",
                                          "--max-sessions", "20"), PREFIX)
    assert more.kv_type == "q8_0" and more.max_sessions >= 20
    asyncio.run(_starts(more))


async def _starts(cfg: EngineConfig) -> None:
    pool = SharedKVPool(dataclasses_replace(cfg, n_threads=1), PREFIX)
    info = await pool.start()
    try:
        assert info.max_sessions == cfg.max_sessions
    finally:
        await pool.aclose()


def dataclasses_replace(cfg: EngineConfig, **kw: Any) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def test_kv_memory_parsing_names_the_fix(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert kv_memory_bytes("1.5", "m") == int(1.5 * GIB)
    with pytest.raises(ValueError, match="GiB"):
        kv_memory_bytes("lots", "m")
    with pytest.raises(ValueError, match="positive"):
        kv_memory_bytes("0", "m")
    monkeypatch.setattr(engine_flags, "free_gpu_bytes", lambda: None)
    with pytest.raises(ValueError, match="found no GPU"):
        kv_memory_bytes("auto", "m")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 1024)
    monkeypatch.setattr(engine_flags, "free_gpu_bytes", lambda: 10 * GIB)
    assert kv_memory_bytes("auto", str(model)) == 9 * GIB - 1024
