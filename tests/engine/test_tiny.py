"""The tiny random-weight GGUF: deterministic bytes, and real llama.cpp loads and decodes it."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
import pytest

from mesh.engine import models as tiny
from mesh.engine.llama import Batch, LlamaContext, LlamaModel

N_CTX = 256


@contextlib.contextmanager
def open_model(path: Path) -> Iterator[LlamaModel]:
    model = LlamaModel(path)
    try:
        yield model
    finally:
        model.close()


@contextlib.contextmanager
def open_context(model: LlamaModel) -> Iterator[tuple[LlamaContext, Batch]]:
    ctx = LlamaContext(
        model,
        n_ctx=N_CTX,
        n_seq_max=1,
        n_batch=N_CTX,
        n_outputs_max=N_CTX,
        n_threads=1,
        swa_full=False,
    )
    batch = Batch(N_CTX)
    try:
        yield ctx, batch
    finally:
        batch.close()
        ctx.close()


def decode(
    ctx: LlamaContext, batch: Batch, tokens: list[int], start: int, *, all_logits: bool
) -> list[npt.NDArray[np.float32]]:
    """Decode ``tokens`` at positions from ``start``; copies of the logits rows asked for."""
    batch.clear()
    rows = [
        batch.add(tok, start + i, 0, all_logits or i == len(tokens) - 1)
        for i, tok in enumerate(tokens)
    ]
    assert ctx.decode(batch) == 0
    wanted = rows if all_logits else rows[-1:]
    return [ctx.logits_row(i).copy() for i in wanted]


def detokenize(model: LlamaModel, tokens: list[int]) -> str:
    return b"".join(model.token_bytes(t) for t in tokens).decode()


def longest_run(tokens: list[int]) -> int:
    best = run = 1
    for a, b in itertools.pairwise(tokens):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best


@pytest.fixture(params=["llama", "gemma3"])
def model_path(request: pytest.FixtureRequest) -> Path:
    name = "tiny_model_path" if request.param == "llama" else "tiny_gemma3_path"
    path: Path = request.getfixturevalue(name)
    return path


def test_same_seed_gives_same_bytes(tiny_model_path: Path, tmp_path: Path) -> None:
    again = tiny.write_tiny_model(tmp_path / "again.gguf", seed=0)
    assert again.read_bytes() == tiny_model_path.read_bytes()


def test_other_seed_gives_other_weights(tiny_model_path: Path, tmp_path: Path) -> None:
    other = tiny.write_tiny_model(tmp_path / "other.gguf", seed=1)
    assert other.stat().st_size == tiny_model_path.stat().st_size
    assert other.read_bytes() != tiny_model_path.read_bytes()


def test_gemma3_metadata_and_tensors(tiny_gemma3_path: Path) -> None:
    reader = gguf.GGUFReader(tiny_gemma3_path)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "gemma3"
    assert "gemma3.attention.sliding_window" in reader.fields
    assert "gemma3.attention.sliding_window_pattern" in reader.fields
    names = {t.name for t in reader.tensors}
    for suffix in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"):
        assert f"blk.0.{suffix}.weight" in names
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)


def test_unknown_variant_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model variant"):
        tiny.write_tiny_model(tmp_path / "x.gguf", variant="mistral")  # type: ignore[arg-type]


def test_loads_and_decodes(model_path: Path) -> None:
    with open_model(model_path) as model, open_context(model) as (ctx, batch):
        tokens = model.tokenize("The worker sends a request to the model.", add_bos=True)
        logits = np.stack(decode(ctx, batch, tokens, 0, all_logits=True))
    assert logits.shape == (len(tokens), model.n_vocab)
    assert np.isfinite(logits).all()
    assert logits.std(axis=1).min() > 0.5  # every row spread out, not flat
    assert len({int(row.argmax()) for row in logits}) > 1


def test_greedy_generation_wanders(model_path: Path) -> None:
    with open_model(model_path) as model, open_context(model) as (ctx, batch):
        prompt = model.tokenize("Hello there, model.", add_bos=True)
        (row,) = decode(ctx, batch, prompt, 0, all_logits=False)
        out: list[int] = []
        while True:
            out.append(int(row.argmax()))
            if len(out) == 64:
                break
            (row,) = decode(ctx, batch, out[-1:], len(prompt) + len(out) - 1, all_logits=False)
    assert len(out) == 64
    assert longest_run(out) < 8
    assert len(set(out[32:])) > 8


def test_english_tokenizes_to_about_a_token_per_word(tiny_model_path: Path) -> None:
    text = "the worker will read the file and write the result for each step of the task"
    with open_model(tiny_model_path) as model:
        tokens = model.tokenize(text, add_bos=False)
        assert detokenize(model, tokens).strip() == text
    assert len(tokens) <= 1.3 * len(text.split())


def test_bytes_outside_the_vocabulary_round_trip(tiny_model_path: Path) -> None:
    text = "naïve → 東京\n\ttabs"
    with open_model(tiny_model_path) as model:
        tokens = model.tokenize(text, add_bos=False)
        assert detokenize(model, tokens).strip() == text


def test_gemma3_has_a_sliding_window(tiny_gemma3_path: Path) -> None:
    with open_model(tiny_gemma3_path) as model:
        assert model.n_swa == tiny.SLIDING_WINDOW


def test_tiny_model_path_writes_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = tiny.tiny_model_path(tmp_path, variant="gemma3")
    assert first.parent == tmp_path
    assert f"v{tiny.TINY_FORMAT_VERSION}" in first.name and "gemma3" in first.name

    def must_not_write(*args: object, **kwargs: object) -> Path:
        raise AssertionError("the cached tiny model was written again")

    monkeypatch.setattr(tiny, "write_tiny_model", must_not_write)
    assert tiny.tiny_model_path(tmp_path, variant="gemma3") == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp files left


def test_tiny_model_path_default_dir_follows_xdg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tiny.tiny_model_path()
    assert path.parent == tmp_path / "mesh" / "models"
    assert path.read_bytes()[:4] == b"GGUF"


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path: Path, **kwargs: object) -> Path:
        Path(path).write_bytes(b"GGUF partial")
        raise OSError("disk full")

    monkeypatch.setattr(tiny, "write_tiny_model", broken)
    with pytest.raises(OSError, match="disk full"):
        tiny.tiny_model_path(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_padded_vocabulary_tokenizes_as_the_base_one(tiny_model_path: Path,
                                                       tmp_path: Path) -> None:
    # tiny:262k pads the vocabulary to a real model's size; here 5,000 to stay quick.
    padded = tiny.write_tiny_model(tmp_path / "padded.gguf", n_vocab=5000)
    text = "the worker will read the file"
    with open_model(tiny_model_path) as base, open_model(padded) as big:
        assert big.n_vocab == 5000 and base.n_vocab < 5000
        assert big.tokenize(text, add_bos=False) == base.tokenize(text, add_bos=False)
    with pytest.raises(ValueError, match="n_vocab must be at least"):
        tiny.write_tiny_model(tmp_path / "small.gguf", n_vocab=10)


def test_tiny_262k_resolves_to_a_gemma_sized_vocabulary(tmp_path: Path) -> None:
    from mesh.engine.models import resolve_model

    model = resolve_model("tiny:262k", cache_dir=tmp_path)
    assert model.name == "mesh-tiny-llama-262144-hd64" and "262144" in model.path.name
    with open_model(model.path) as m:
        assert m.n_vocab == 262144
    hd64 = resolve_model("tiny:hd64", cache_dir=tmp_path)
    reader = gguf.GGUFReader(hd64.path)
    fields = {f.name: f.parts[-1][0] for f in reader.fields.values()
              if f.name.endswith((".embedding_length", ".attention.head_count"))}
    assert fields == {"llama.embedding_length": 128, "llama.attention.head_count": 2}
    with pytest.raises(ValueError, match="unknown tiny model shape"):
        tiny.tiny_model_path(tmp_path, shape="hd7")
