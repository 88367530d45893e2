"""The weights the CPU runs: speed and answers of each ``--weights`` choice, one run.

    .venv/bin/python -m bench.weights            # SmolLM2: as-is (Q4_1), q8_0, q4_0
    .venv/bin/python -m bench.weights --quick    # the tiny model stored as Q4_1

For each choice (:func:`mesh.engine.models.cpu_weights`, the file and buffers the engine
loads), in the same process, alternating the choices over ``--rounds`` rounds (the machine
is shared; the median of the rounds is reported):

* **prefill**: tokens/s decoding a ``--prefix``-token prompt in 512-token batches;
* **decode step**: the median ``llama_decode`` time of one step of N rows (N = 1, 8, 32),
  every row one token after the shared prompt (the pool's shape);
* **answers against as-is** (the file as shipped is the reference): teacher-forced top-1
  agreement (the share of positions of a real text — this repository's README — where the
  choice's most likely next token is the reference's) and, on chat prompts decoded greedily
  in SmolLM2's chat format (ChatML), how many answers are token-identical and the median
  length of the common start.

Writes a table to stdout and ``bench/weights/results/weights.json`` (``--quick``: the temp dir).
Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mesh.engine.llama import Batch, LlamaContext, LlamaModel, quantize_file, system_info
from mesh.engine.models import _FTYPE, cpu_weights, smollm2_path, tiny_model_path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "results" / "weights.json"
CHOICES = ("as-is", "q8_0", "q4_0")
PROMPTS = (
    "Which file defines the Parcel class?", "Write a Python function that adds two numbers.",
    "What is the capital of France?", "List three colors.",
    "Explain what a KV cache is in one sentence.", "Reply with the single word: ok",
    "How many legs does a spider have?", "Summarize: the courier delivers parcels by route.",
    "What does HTTP stand for?", "Give a JSON object with a key name and value mesh.",
)


def _context(model: LlamaModel, n_ctx: int, seqs: int, outputs: int, threads: int) -> LlamaContext:
    return LlamaContext(model, n_ctx=n_ctx, n_seq_max=seqs, n_batch=512,
                        n_outputs_max=outputs, n_threads=threads, swa_full=True)


def speed(model: LlamaModel, prefix: int, rows: tuple[int, ...], steps: int,
          threads: int) -> dict[str, Any]:
    """Prefill tokens/s of a ``prefix``-token prompt, then the median step per row count."""
    top = max(rows)
    ctx = _context(model, prefix + top * steps * len(rows) + 256, top + 1, top + 1, threads)
    batch = Batch(512)
    rng = random.Random(1)
    try:
        toks = [rng.randrange(16, model.n_vocab) for _ in range(prefix)]
        t0 = time.perf_counter()
        for i in range(0, prefix, 512):
            batch.clear()
            chunk = toks[i:i + 512]
            for j, tok in enumerate(chunk):
                batch.add(tok, i + j, 0, j == len(chunk) - 1)
            if ctx.decode(batch) != 0:
                raise RuntimeError("prefill failed")
        prefill = prefix / (time.perf_counter() - t0)
        for r in range(1, top + 1):
            ctx.seq_copy(0, r)
        nxt: dict[int, int] = {}
        step_ms: dict[str, float] = {}
        for n in rows:
            times = []
            for _ in range(steps):
                batch.clear()
                for r in range(1, n + 1):
                    pos = nxt.get(r, prefix)
                    nxt[r] = pos + 1
                    batch.add(rng.randrange(16, model.n_vocab), pos, r, True)
                t1 = time.perf_counter()
                if ctx.decode(batch) != 0:
                    raise RuntimeError("decode step failed")
                times.append((time.perf_counter() - t1) * 1e3)
            step_ms[str(n)] = statistics.median(times[2:] or times)
        return {"prefill_tps": prefill, "step_ms": step_ms}
    finally:
        batch.close()
        ctx.close()


def top1(model: LlamaModel, tokens: list[int], threads: int) -> np.ndarray:
    """The most likely next token at every position of ``tokens`` (one sequence)."""
    ctx = _context(model, len(tokens) + 256, 1, 512, threads)
    batch = Batch(512)
    out: list[int] = []
    try:
        for i in range(0, len(tokens), 512):
            batch.clear()
            chunk = tokens[i:i + 512]
            for j, tok in enumerate(chunk):
                batch.add(tok, i + j, 0, True)
            if ctx.decode(batch) != 0:
                raise RuntimeError("teacher-forced decode failed")
            out.extend(int(np.argmax(ctx.logits_row(j))) for j in range(len(chunk)))
    finally:
        batch.close()
        ctx.close()
    return np.array(out)


def greedy(path: Path, prompts: tuple[str, ...], max_tokens: int, threads: int) -> list[list[int]]:
    """Each prompt answered greedily in SmolLM2's chat format (ChatML), up to an end of
    generation or ``max_tokens``: the answer's token ids."""
    model = LlamaModel(path)
    batch = Batch(512)
    answers = []
    try:
        for p in prompts:
            text = f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n"
            toks = model.tokenize(text, add_bos=model.add_bos)
            ctx = _context(model, len(toks) + max_tokens + 64, 1, 1, threads)
            try:
                batch.clear()
                for j, tok in enumerate(toks):
                    batch.add(tok, j, 0, j == len(toks) - 1)
                if ctx.decode(batch) != 0:
                    raise RuntimeError("prompt decode failed")
                out: list[int] = []
                for k in range(max_tokens):
                    nxt = int(np.argmax(ctx.logits_row(-1 if k == 0 else 0)))
                    if model.is_eog(nxt):
                        break
                    out.append(nxt)
                    batch.clear()
                    batch.add(nxt, len(toks) + k, 0, True)
                    if ctx.decode(batch) != 0:
                        raise RuntimeError("decode failed")
            finally:
                ctx.close()
            answers.append(out)
    finally:
        batch.close()
        model.close()
    return answers


def _common(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny model, seconds")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cache = Path(tempfile.mkdtemp(prefix="mesh-weights-"))
    rows: tuple[int, ...]
    if args.quick:
        src = cache / "tiny-q4_1.gguf"
        quantize_file(tiny_model_path(cache), src, _FTYPE["q4_1"], threads=1)
        prefix, rows, steps, rounds, text_tokens, gen = 256, (1, 4), 5, 1, 256, 8
    else:
        src = smollm2_path()
        prefix, rows, steps, rounds, text_tokens, gen = (args.prefix, (1, 8, 32), 12,
                                                         args.rounds, 1536, 48)
    out = args.out or (Path(tempfile.gettempdir()) / "weights.json" if args.quick else OUT)
    weights = {c: cpu_weights(src, c, on_gpu=False, cache_dir=cache, threads=args.threads)
               for c in CHOICES}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CHOICES}
    for r in range(rounds):
        for c in CHOICES:
            model = LlamaModel(weights[c].path, extra_buffers=weights[c].extra_buffers)
            try:
                runs[c].append(speed(model, prefix, rows, steps, args.threads))
            finally:
                model.close()
            print(f"round {r + 1}/{rounds} {c}: {runs[c][-1]}", flush=True)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ref_model = LlamaModel(weights["as-is"].path)
    tokens = ref_model.tokenize(readme, add_bos=ref_model.add_bos)[:text_tokens]
    ref_top = top1(ref_model, tokens, args.threads)
    ref_model.close()
    prompts = PROMPTS[:3] if args.quick else PROMPTS
    ref_answers = greedy(weights["as-is"].path, prompts, gen, args.threads)
    result: dict[str, Any] = {}
    for c in CHOICES:
        model = LlamaModel(weights[c].path, extra_buffers=weights[c].extra_buffers)
        try:
            agree = float(np.mean(top1(model, tokens, args.threads) == ref_top))
        finally:
            model.close()
        answers = greedy(weights[c].path, prompts, gen, args.threads)
        common = [_common(a, b) for a, b in zip(ref_answers, answers, strict=True)]
        result[c] = {
            "loaded": weights[c].described,
            "file_bytes": weights[c].path.stat().st_size,
            "prefill_tps": statistics.median(x["prefill_tps"] for x in runs[c]),
            "step_ms": {n: statistics.median(x["step_ms"][n] for x in runs[c])
                        for n in runs[c][0]["step_ms"]},
            "rounds": runs[c],
            "top1_agreement": agree,
            "greedy_identical": sum(a == b for a, b in zip(ref_answers, answers, strict=True)),
            "greedy_prompts": len(prompts),
            "greedy_common_tokens_median": statistics.median(common),
        }
    base = result["as-is"]
    print(f"\n{'choice':8} {'loaded':26} {'prefill':>9} " + " ".join(
        f"{'N=' + n:>9}" for n in base["step_ms"]) + f" {'top-1':>7} {'greedy =':>9}")
    for c, row in result.items():
        speedups = " ".join(f"{row['step_ms'][n]:6.1f}ms" + " " * 1 for n in row["step_ms"])
        print(f"{c:8} {row['loaded']:26} {row['prefill_tps']:6.1f}t/s {speedups} "
              f"{row['top1_agreement']:7.1%} {row['greedy_identical']:>4}/{row['greedy_prompts']}")
        row["vs_as_is"] = {"prefill": row["prefill_tps"] / base["prefill_tps"],
                           **{f"step_{n}": base["step_ms"][n] / row["step_ms"][n]
                              for n in row["step_ms"]}}
    doc = {"command": "python -m bench.weights" + (" --quick" if args.quick else ""),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "load_avg": os.getloadavg(), "llama_cpp": system_info()},
           "prefix": prefix, "text_tokens": len(tokens), "max_tokens": gen, "results": result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
