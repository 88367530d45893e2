"""Random-weight models of real geometry: the specs match the real models, and llama.cpp
loads a scaled-down twin of each, reports its shapes and decodes it without NaN."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from mesh.engine.llama import Batch, LlamaContext, LlamaModel
from mesh.engine.models import resolve_model
from mesh.sim import geometry as geo

TWINS = [("llama-3.1-8b", 16), ("gemma-3-270m", 8), ("llama-3.2-1b", 8)]


def test_llama_3_1_8b_has_its_published_parameter_count() -> None:
    g = geo.GEOMETRIES["llama-3.1-8b"]
    tensors = geo.plan(g)
    n = sum(t.n_elements for t in tensors if t.kind != "rope_freqs")
    assert n == 8_030_261_248  # Meta's count for Llama 3.1 8B
    assert [t.shape for t in tensors if t.kind == "rope_freqs"] == [(64,)]
    assert g.kv_shape().cell_bytes("f16") == 128 * 1024  # 128 KiB of KV per token


def test_gemma_3_270m_matches_the_gguf_mesh_ships() -> None:
    g = geo.GEOMETRIES["gemma-3-270m"]
    # llama.cpp reads the real file (GGUFReader takes ~30 s over its 262K-token arrays)
    real = LlamaModel(resolve_model("gemma").path)
    try:

        def kv(key: str) -> str | None:
            return real.meta(f"gemma3.{key}")

        assert [kv(k) for k in ("block_count", "embedding_length", "feed_forward_length",
                                "attention.head_count", "attention.head_count_kv",
                                "attention.key_length", "attention.value_length",
                                "context_length", "attention.sliding_window")] == [
            str(n) for n in (g.n_layer, g.n_embd, g.n_ff, g.n_head, g.n_head_kv, g.head_dim,
                             g.head_dim, g.n_ctx_train, g.sliding_window)]
        assert float(kv("rope.freq_base") or 0) == pytest.approx(g.rope_theta)
        assert float(kv("attention.layer_norm_rms_epsilon") or 0) == pytest.approx(g.rms_eps)
        assert kv("attention.sliding_window_pattern") is None  # llama.cpp's default, as ours
        assert real.n_vocab == g.n_vocab
        assert real.n_swa == g.sliding_window
        # every tensor's elements, counted by llama.cpp: same tensors, same shapes
        assert real.n_params == sum(t.n_elements for t in geo.plan(g))
    finally:
        real.close()


@pytest.mark.parametrize("name,k", TWINS)
def test_a_twin_keeps_head_size_and_gqa_ratio(name: str, k: int) -> None:
    g = geo.GEOMETRIES[name]
    t = g.scaled_down(k)
    assert t.head_dim == g.head_dim
    assert t.n_head // t.n_head_kv == g.n_head // g.n_head_kv
    assert t.n_layer < g.n_layer and t.n_embd < g.n_embd and t.n_vocab < g.n_vocab
    assert t.n_embd % 32 == 0 and t.n_ff % 32 == 0


@pytest.mark.parametrize("qtype", sorted(geo.QTYPES))
@pytest.mark.parametrize("name,k", TWINS)
def test_llama_cpp_loads_a_twin_with_its_shapes_and_decodes(
        tmp_path: Path, name: str, k: int, qtype: str) -> None:
    g = geo.GEOMETRIES[name].scaled_down(k)
    path = geo.write_geometry_model(tmp_path / "m.gguf", g, qtype=qtype)
    model = LlamaModel(path)
    try:
        arch = model.meta("general.architecture")
        assert arch == g.arch
        assert model.kv_shape() == (g.n_layer, g.n_head_kv, g.head_dim, g.head_dim,
                                    g.n_ctx_train)
        assert model.meta(f"{arch}.embedding_length") == str(g.n_embd)
        assert model.meta(f"{arch}.attention.head_count") == str(g.n_head)
        assert model.n_vocab == g.n_vocab
        assert model.n_ctx_train == g.n_ctx_train
        assert model.n_swa == g.sliding_window
        # llama.cpp's own count over the tensors it loaded (each checked against hparams)
        assert model.n_params == sum(t.n_elements for t in geo.plan(g))
        ctx = LlamaContext(model, n_ctx=256, n_seq_max=1, n_batch=64, n_outputs_max=1,
                           n_threads=2, swa_full=False)
        batch = Batch(64)
        try:
            tokens = model.tokenize("the agent reads the file and runs the test",
                                    add_bos=True)
            batch.clear()
            for i, tok in enumerate(tokens):
                batch.add(tok, i, 0, i == len(tokens) - 1)
            assert ctx.decode(batch) == 0
            row = ctx.logits_row(len(tokens) - 1)
            for pos in range(len(tokens), len(tokens) + 4):
                assert np.isfinite(row).all() and 0.1 < float(row.std()) < 100
                batch.clear()
                batch.add(int(np.argmax(row)), pos, 0, True)
                assert ctx.decode(batch) == 0
                row = ctx.logits_row(0)
        finally:
            batch.close()
            ctx.close()
    finally:
        model.close()


@pytest.mark.parametrize("qtype", sorted(geo.QTYPES))
def test_weights_are_finite_with_the_planned_scale_and_norms_are_one(
        tmp_path: Path, qtype: str) -> None:
    g = geo.GEOMETRIES["llama-3.1-8b"].scaled_down(16)
    path = geo.write_geometry_model(tmp_path / "m.gguf", g, qtype=qtype)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name in ("blk.0.ffn_down.weight", "blk.1.attn_q.weight", "output.weight"):
        t = tensors[name]
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(values).all()
        want = 1 / math.sqrt(int(t.shape[0]))  # shape[0]: the row length (fan-in)
        assert float(values.std()) == pytest.approx(want, rel=0.15)
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.1.ffn_norm.weight"):
        assert (np.asarray(tensors[name].data) == 1.0).all()


def test_the_same_arguments_give_the_same_bytes(tmp_path: Path) -> None:
    g = geo.GEOMETRIES["gemma-3-270m"].scaled_down(8)

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    a = geo.write_geometry_model(tmp_path / "a.gguf", g, seed=3)
    b = geo.write_geometry_model(tmp_path / "b.gguf", g, seed=3)
    c = geo.write_geometry_model(tmp_path / "c.gguf", g, seed=4)
    assert digest(a) == digest(b) != digest(c)


def test_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="use one of"):
        geo.write_geometry_model(tmp_path / "m.gguf", "llama-9b")
    with pytest.raises(ValueError, match="use one of"):
        geo.write_geometry_model(tmp_path / "m.gguf", "gemma-3-270m", qtype="q3_k")
    odd = dataclasses.replace(geo.GEOMETRIES["gemma-3-270m"], n_embd=650)
    with pytest.raises(ValueError, match="multiples of 32"):
        geo.write_geometry_model(tmp_path / "m.gguf", odd)


def test_the_cli_writes_a_twin_with_another_trained_context(tmp_path: Path) -> None:
    out = tmp_path / "twin.gguf"
    assert geo.main(["llama-3.1-8b", str(out), "--scale-down", "16", "--type", "q8_0",
                     "--n-ctx-train", "262144"]) == 0
    fields = gguf.GGUFReader(str(out)).fields
    assert fields["llama.context_length"].contents() == 262144
    assert fields["llama.block_count"].contents() == 2
    with pytest.raises(SystemExit):
        geo.main(["llama-9b", str(out)])
