"""End-to-end exactness check of the shared-prefix attention patch against the wheel's llama.cpp.

Runs the same workload twice, each in its own subprocess (one llama.cpp per process):
once with the wheel's libraries and once with a patched library directory (the wheel's
libraries with the patched ``libggml-cpu.so*``, as ``build_patched_ggml.sh`` assembles it,
selected with ``LLAMA_CPP_LIB_PATH``). Each run, per model:

1. **Through mesh's pool** (``SharedKVPool``, ``flash_attn="on"``, the Python step): a
   shared prefix of ``--prefix`` tokens (the repo's docs, or random ids with
   ``--prompts random``), ``--sessions`` sessions attached at once, each with its own
   prompt, all generating ``--tokens`` greedy tokens concurrently (``stop_at_eos=False``).
   The two runs' token streams are compared per session.
2. **Logits, teacher-forced** (the adapter, the pool's layout: prefix in sequence 0, copied
   to each session's sequence, private prompts, then decode steps of one token per session):
   both runs feed the *wheel run's* pool tokens, so every step's logits are comparable even
   after a greedy divergence. Reported: the largest absolute logit difference and how often
   the argmax agrees.

The patched run also reads ``ggml_cpu_shared_prefix_attn_hits()`` to show the shared path
actually ran. Exit status 0 when it did, and the teacher-forced argmax agrees on at least
``--min-argmax-agree`` of the rows.

    .venv/bin/python native/patches/check_shared_prefix.py --patched-lib /work/llama-sp/mesh-lib
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PREFILL_CHUNK = 256


def wheel_lib_dir() -> Path:
    """llama-cpp-python's own library directory, found without loading it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise SystemExit("llama_cpp is not installed in this interpreter; "
                         "run with .venv/bin/python")
    return Path(spec.origin).parent / "lib"


QUESTIONS = [
    "Summarize the paragraph above in one sentence.",
    "What is the main idea of this text? Answer briefly.",
    "List three terms defined above.",
    "Explain the first section to a new engineer.",
    "Which component owns the sessions? Answer:",
    "Write a short title for this document.",
    "What would you test first, and why?",
    "Describe one risk the text mentions.",
]


def workload(model: Any, sessions: int, prefix: int, seed: int,
             kind: str) -> tuple[list[int], list[list[int]]]:
    """The shared prefix and each session's private prompt (the same in both runs).

    ``text``: the repository's docs as the prefix (BOS first, cut to ``prefix`` tokens) and a
    different question per session, the pool's real use. ``random``: random token ids (flat,
    near-tied greedy choices: a harsher test of token agreement)."""
    rng = random.Random(seed)
    if kind == "text":
        docs = sorted((ROOT / "docs").glob("*.md"))
        text = "\n\n".join(p.read_text(errors="replace") for p in docs)
        pre = model.tokenize(text, add_bos=True)[:prefix]
        if len(pre) < prefix:
            raise SystemExit(f"the docs give {len(pre)} tokens, fewer than --prefix {prefix}")
        prompts = [model.tokenize(f"\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}\n"
                                  "Answer:", add_bos=False) for i in range(sessions)]
        return pre, prompts
    hi = min(model.n_vocab, 32000)
    pre = [rng.randrange(16, hi) for _ in range(prefix)]
    prompts = [[rng.randrange(16, hi) for _ in range(8 + 5 * i)] for i in range(sessions)]
    return pre, prompts


# ----------------------------------------------------------------------------- child side


def _hits() -> int | None:
    """The patched kernel's counter in the ggml-cpu this process loaded (None: unpatched)."""
    import llama_cpp.llama_cpp as ll

    lib_dir = Path(ll._lib._name).parent
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for path in sorted(lib_dir.glob("libggml-cpu.so*")):
        try:
            lib = ctypes.CDLL(str(path), mode=mode)
        except OSError:
            continue
        try:
            fn = lib.ggml_cpu_shared_prefix_attn_hits
        except AttributeError:
            return None
        fn.restype = ctypes.c_int64
        return int(fn())
    return None


def _loaded_libs() -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split()[-1] for line in f
                       if "libllama" in line or "libggml" in line})


async def _pool_run(path: Path, pre: list[int], prompts: list[list[int]], tokens: int,
                    threads: int, patched: bool, fa: str) -> list[list[int]]:
    import dataclasses

    from mesh.engine.config import EngineConfig, SamplingParams
    from mesh.engine.pool import SharedKVPool

    extra: dict[str, Any] = {}
    if "prefix_attention" in {f.name for f in dataclasses.fields(EngineConfig)}:
        shared = patched and fa == "on" and os.environ.get("GGML_CPU_SHARED_PREFIX_ATTN") != "0"
        extra["prefix_attention"] = "shared" if shared else "off"
    cfg = EngineConfig(model_path=str(path), max_sessions=len(prompts),
                       session_budget=max(len(p) for p in prompts) + tokens + 64,
                       n_threads=threads, flash_attn=fa, native=False, **extra)
    pool = SharedKVPool(cfg, pre)
    await pool.start()
    try:
        sessions = [await pool.attach() for _ in prompts]
        for s, prompt in zip(sessions, prompts, strict=True):
            s.append_tokens(prompt)
        params = SamplingParams(max_tokens=tokens, temperature=0.0, stop_at_eos=False)

        async def collect(s: Any) -> list[int]:
            return [p.token async for p in s.generate(params) if p.token >= 0]

        return list(await asyncio.gather(*(collect(s) for s in sessions)))
    finally:
        await pool.aclose()


def _forced_logits(path: Path, pre: list[int], prompts: list[list[int]],
                   forced: list[list[int]], threads: int, fa: str) -> np.ndarray:
    """[sessions, steps, n_vocab]: step 0 after the prompts, step t after forced token t-1."""
    from mesh.engine.llama import Batch, LlamaContext, LlamaModel

    model = LlamaModel(path)
    n_s, steps = len(prompts), min(len(f) for f in forced)
    n_ctx = len(pre) + sum(len(p) for p in prompts) + n_s * (steps + 2) + 512
    ctx = LlamaContext(model, n_ctx=n_ctx, n_seq_max=n_s + 1, n_batch=PREFILL_CHUNK,
                       n_outputs_max=n_s + 1, n_threads=threads, swa_full=True,
                       flash_attn=fa)
    batch = Batch(PREFILL_CHUNK)
    out = np.zeros((n_s, steps, model.n_vocab), dtype=np.float32)
    try:
        for i in range(0, len(pre), PREFILL_CHUNK):
            batch.clear()
            for j, tok in enumerate(pre[i:i + PREFILL_CHUNK]):
                batch.add(tok, i + j, 0, False)
            assert ctx.decode(batch) == 0
        for r in range(n_s):
            ctx.seq_copy(0, r + 1)
        # private prompts, one session per call (a call's outputs are its last token's)
        for r, prompt in enumerate(prompts):
            batch.clear()
            for j, tok in enumerate(prompt):
                batch.add(tok, len(pre) + j, r + 1, j == len(prompt) - 1)
            assert ctx.decode(batch) == 0
            out[r, 0] = ctx.logits_row(len(prompt) - 1)
        for t in range(1, steps):
            batch.clear()
            for r, prompt in enumerate(prompts):
                batch.add(forced[r][t - 1], len(pre) + len(prompt) + t - 1, r + 1, True)
            assert ctx.decode(batch) == 0
            for r in range(n_s):
                out[r, t] = ctx.logits_row(r)
    finally:
        batch.close()
        ctx.close()
        model.close()
    return out


def child(a: argparse.Namespace) -> int:
    from mesh.engine.llama import LlamaModel
    from mesh.engine.models import resolve_model, tiny_model_path

    path = tiny_model_path() if a.model == "tiny" else resolve_model(a.model).path
    m = LlamaModel(Path(path))
    try:
        pre, prompts = workload(m, a.sessions, a.prefix, a.seed, a.prompts)
    finally:
        m.close()
    t0 = time.perf_counter()
    streams = asyncio.run(_pool_run(Path(path), pre, prompts, a.tokens, a.threads, a.patched,
                                    a.fa))
    pool_s = time.perf_counter() - t0
    hits_pool = _hits()
    forced = json.loads(Path(a.forced).read_text())["streams"] if a.forced else streams
    logits = _forced_logits(Path(path), pre, prompts, forced, a.threads, a.fa)
    out = Path(a.out)
    np.save(out.with_suffix(".npy"), logits)
    out.write_text(json.dumps({"streams": streams, "hits_after_pool": hits_pool,
                               "hits_after_forced": _hits(), "pool_s": round(pool_s, 1),
                               "libs": _loaded_libs(), "model": str(path)}))
    return 0


# ---------------------------------------------------------------------------- parent side


def _run_child(a: argparse.Namespace, model: str, lib: Path, patched: bool, out: Path,
               forced: Path | None, fa: str = "on", disable: bool = False) -> dict[str, Any]:
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib), PYTHONPATH=str(ROOT))
    env.pop("GGML_CPU_SHARED_PREFIX_ATTN", None)
    if disable:
        env["GGML_CPU_SHARED_PREFIX_ATTN"] = "0"
    cmd = [sys.executable, __file__, "--child", "--model", model, "--out", str(out),
           "--sessions", str(a.sessions), "--prefix", str(a.prefix), "--tokens", str(a.tokens),
           "--threads", str(a.threads), "--seed", str(a.seed), "--fa", fa,
           "--prompts", a.prompts]
    if patched:
        cmd.append("--patched")
    if forced is not None:
        cmd += ["--forced", str(forced)]
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def compare(model: str, wheel: dict[str, Any], patched: dict[str, Any],
            lw: np.ndarray, lp: np.ndarray) -> dict[str, Any]:
    agree, prefix_agree, total = 0, [], 0
    for sw, sp in zip(wheel["streams"], patched["streams"], strict=True):
        n = min(len(sw), len(sp))
        total += n
        agree += sum(x == y for x, y in zip(sw[:n], sp[:n], strict=True))
        first = next((i for i in range(n) if sw[i] != sp[i]), n)
        prefix_agree.append(first)
    diff = np.abs(lw - lp)
    argmax_agree = float(np.mean(lw.argmax(-1) == lp.argmax(-1)))
    return {
        "model": model,
        "tokens_per_session": [len(s) for s in patched["streams"]],
        "pool_token_agreement": agree / max(total, 1),
        "pool_identical_leading_tokens": prefix_agree,
        "forced_rows": int(lw.shape[0] * lw.shape[1]),
        "forced_max_abs_logit_diff": float(diff.max()),
        "forced_mean_abs_logit_diff": float(diff.mean()),
        "forced_argmax_agreement": argmax_agree,
        "patched_hits": patched["hits_after_forced"],
        "wheel_hits": wheel["hits_after_forced"],
        "patched_libs": patched["libs"],
        "wheel_libs": wheel["libs"],
        "pool_s": {"wheel": wheel["pool_s"], "patched": patched["pool_s"]},
    }


def _controls(a: argparse.Namespace, model: str, wheel_lib: Path, tmp: Path, w_out: Path,
              lw: np.ndarray) -> dict[str, Any]:
    """Teacher-forced logit differences of two reference variants against the wheel (FA on)."""
    wheel = json.loads(w_out.read_text())
    out: dict[str, Any] = {}
    variants = [("patched_path_off", a.patched_lib, True, "on", True),
                ("wheel_fa_off", wheel_lib, False, "off", False)]
    for name, lib, patched, fa, disable in variants:
        o = tmp / f"{model}-{name}.json"
        res = _run_child(a, model, lib, patched, o, w_out, fa=fa, disable=disable)
        lv = np.load(o.with_suffix(".npy"))
        d = np.abs(lw - lv)
        out[name] = {"forced_max_abs_logit_diff": float(d.max()),
                     "forced_mean_abs_logit_diff": float(d.mean()),
                     "forced_argmax_agreement": float(np.mean(lw.argmax(-1) == lv.argmax(-1))),
                     "pool_token_agreement":
                         compare(model, wheel, res, lw, lv)["pool_token_agreement"],
                     "hits": res["hits_after_forced"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--patched-lib", type=Path, default=Path("/work/llama-sp/mesh-lib"))
    ap.add_argument("--wheel-lib", type=Path, default=None,
                    help="the unpatched reference libraries (default: the venv's llama_cpp/lib, "
                    "which must not carry the patch)")
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1200, help="shared prefix tokens")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per session")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", choices=("text", "random"), default="text",
                    help="text: the repo's docs as prefix, a question per session; "
                    "random: random token ids")
    ap.add_argument("--min-argmax-agree", type=float, default=0.97,
                    help="pass mark for the teacher-forced argmax agreement (llama.cpp's own "
                    "FA on and FA off agree on ~98.8%% of SmolLM2's rows: see --controls)")
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    ap.add_argument("--controls", action="store_true",
                    help="also compare, against the wheel: the patched library with the path "
                    "off (GGML_CPU_SHARED_PREFIX_ATTN=0: must be bit-equal), and the wheel with "
                    "flash attention off (llama.cpp's own path-to-path difference, for scale)")
    # child mode (internal)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--forced", help=argparse.SUPPRESS)
    ap.add_argument("--patched", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fa", default="on", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a)
    if not (a.patched_lib / "libggml-cpu.so.0").is_file():
        raise SystemExit(f"{a.patched_lib} has no libggml-cpu.so.0; "
                         "assemble it with native/patches/build_patched_ggml.sh")
    wheel_lib = a.wheel_lib or wheel_lib_dir()
    reports, ok = [], True
    with tempfile.TemporaryDirectory(prefix="mesh-sp-check-") as tmp:
        for model in a.models.split(","):
            w_out, p_out = Path(tmp) / f"{model}-wheel.json", Path(tmp) / f"{model}-patched.json"
            wheel = _run_child(a, model, wheel_lib, False, w_out, None)
            if wheel["hits_after_forced"] is not None:
                raise SystemExit(
                    f"{wheel_lib} already carries the patch (install_patch.sh puts it into the "
                    "venv), so there is no unpatched reference; pass --wheel-lib DIR with the "
                    "wheel's own libraries, e.g. unzip llama_cpp/lib from pip's cached "
                    "llama_cpp_python-0.3.36 wheel (~/.cache/pip/wheels)")
            patched = _run_child(a, model, a.patched_lib, True, p_out, w_out)
            rep = compare(model, wheel, patched, np.load(w_out.with_suffix(".npy")),
                          np.load(p_out.with_suffix(".npy")))
            if a.controls:
                rep["controls"] = _controls(a, model, wheel_lib, Path(tmp), w_out,
                                            np.load(w_out.with_suffix(".npy")))
            reports.append(rep)
            print(json.dumps(rep, indent=1), flush=True)
            if not rep["patched_hits"] or rep["forced_argmax_agreement"] < a.min_argmax_agree:
                ok = False
    if a.json:
        a.json.write_text(json.dumps(reports, indent=1) + "\n")
    print("OK" if ok else "FAILED: the shared path did not run, or the argmax disagreed too often")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
