"""The model's name on the OpenAI API (issue 29 part 1 b): the GGUF's ``general.name``,
read from the header's first keys only."""

from __future__ import annotations

from pathlib import Path

from mesh.api.openai_api import gguf_name, model_names
from mesh.sim.fake import FakeEngine


def test_gguf_name_of_the_tiny_model_and_of_non_ggufs(tiny_model_path: Path,
                                                      tmp_path: Path) -> None:
    assert gguf_name(tiny_model_path) == "mesh-tiny-llama (random weights)"
    other = tmp_path / "notes.txt"
    other.write_text("not a model")
    assert gguf_name(other) is None
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_model_path.read_bytes()[:40])  # a header cut short
    assert gguf_name(cut) is None
    assert gguf_name(tmp_path / "missing.gguf") is None


def test_an_engine_without_a_local_file_keeps_its_own_name() -> None:
    info = FakeEngine().info
    assert model_names(info) == (info.model_name, info.model_path)
