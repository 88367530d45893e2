"""A mistyped built-in model name is refused with the names it is close to (issue 41
item 7.4): ``--model smolm2`` is not a file, it is ``smollm2`` misspelt."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mesh.engine.interface import ModelError
from mesh.engine.models import BUILTIN_NAMES, resolve_model
from tests.reliability.serve_proc import free_port, serve_argv, serve_env, small_project

FIX = "pass --model PATH or set MESH_MODEL"


@pytest.mark.parametrize(("typo", "meant"),
                         [("smolm2", "smollm2"), ("SmolLM", "smollm2"), ("gema", "gemma"),
                          ("tyny", "tiny"), ("tiny:hd6", "tiny:hd64")])
def test_a_typo_of_a_builtin_name_suggests_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             typo: str, meant: str) -> None:
    monkeypatch.chdir(tmp_path)  # no file of that name here
    with pytest.raises(ModelError) as err:
        resolve_model(typo, env={}, cache_dir=tmp_path)
    message = str(err.value)
    assert message.startswith(f"model file not found at {tmp_path / typo} (from --model)")
    assert f"did you mean --model {meant}?" in message, message
    assert f"(built-in names: {', '.join(BUILTIN_NAMES)})" in message, message
    assert message.endswith(FIX), message


def test_a_typo_from_the_environment_names_the_variable(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match=r"\(from MESH_MODEL\); did you mean MESH_MODEL=gemma\?"):
        resolve_model(None, env={"MESH_MODEL": "gemmma"}, cache_dir=tmp_path)


def test_a_word_close_to_nothing_lists_the_names(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError) as err:
        resolve_model("mistral", env={}, cache_dir=tmp_path)
    assert "did you mean" not in str(err.value)
    assert "not a built-in name (smollm2, gemma, tiny)" in str(err.value)


@pytest.mark.parametrize("spec", ["models/smolm2", "smolm2.gguf", "~/smolm2"])
def test_a_path_gets_no_name_suggestion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        spec: str) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelError) as err:
        resolve_model(spec, env={}, cache_dir=tmp_path)
    assert "built-in" not in str(err.value) and "did you mean" not in str(err.value)
    assert str(err.value).startswith("model file not found at ")


def test_mesh_serve_with_a_typo_is_one_line_naming_the_name(tmp_path: Path) -> None:
    argv = serve_argv(tmp_path / "data", small_project(tmp_path / "project"), free_port())
    argv[argv.index("tiny")] = "smolm2"
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path,
                          env=serve_env(tmp_path / "cache"), timeout=120, check=False)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2, lines
    (line,) = lines
    assert line.startswith(f"mesh serve: model file not found at {tmp_path / 'smolm2'}"), line
    assert "did you mean --model smollm2?" in line and line.endswith(FIX), line
