"""What repetition control costs per sampled token, through the llama.cpp adapter.

A greedy turn without repetition control is argmax over the logits row
(:class:`~mesh.engine.sampling.GreedySampler`; the native step does it in C). A penalized
turn samples its llama.cpp chain instead: every logit copied into a candidate array, then
top-k 40 -> penalties/DRY -> greedy (:class:`~mesh.engine.sampling.Sampler`), the native step
included. This times both on random rows of each vocabulary size (SmolLM2: 49,152; Gemma 3:
262,144), with a history of generated tokens for the penalties to look through::

    python -m bench.sampling                       # SmolLM2 and Gemma 3, 300 rows
    python -m bench.sampling --models tiny --quick # 20 rows: seconds

The numbers are per row on one thread; the native step samples rows on its own threads
for large vocabularies. Writes ``bench/sampling/results/sampling_repetition.json`` (or ``--out``;
with ``--quick``, a temporary path: ``QUICK_OUT``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mesh.engine.config import SamplingParams
from mesh.engine.llama import LlamaModel
from mesh.engine.models import resolve_model
from mesh.engine.sampling import Sampler, make_sampler
from mesh.worker.text import prose_params

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "sampling_repetition.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "sampling_repetition.json"
QUICK: dict[str, Any] = {"reps": 20, "history": 16, "out": QUICK_OUT}
VARIANTS: dict[str, SamplingParams] = {
    "chain, greedy (no repetition control)": SamplingParams(),
    "chain, top-k 40 -> DRY -> greedy (mesh's prose)": prose_params(SamplingParams()),
    "chain, top-k 40 -> penalties 1.1 -> greedy": SamplingParams(repeat_penalty=1.1),
}


def _time(fn: Any, rows: list[np.ndarray], reps: int) -> float:
    start = time.perf_counter()
    for i in range(reps):
        fn(rows[i % len(rows)])
    return (time.perf_counter() - start) / reps


def measure(model: LlamaModel, reps: int, history: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    rows = [rng.normal(0, 3, model.n_vocab).astype(np.float32) for _ in range(8)]
    out: dict[str, Any] = {"n_vocab": model.n_vocab,
                           "argmax (greedy, no repetition control)_ms":
                           round(_time(np.argmax, rows, reps) * 1e3, 4)}
    for name, params in VARIANTS.items():
        smpl = Sampler(model, temperature=0.0, top_k=0, top_p=1.0, seed=0, rep=params) \
            if params.repetition else make_sampler(temperature=0.0, top_k=0, top_p=1.0,
                                                   seed=0, model=model, grammar=None)
        if not isinstance(smpl, Sampler):  # a plain greedy chain, for the copy's cost
            smpl = Sampler(model, temperature=0.0, top_k=0, top_p=1.0, seed=0)
        for i in range(history):  # tokens already generated (the penalties' history)
            smpl.draw_row(rows[i % len(rows)])
        out[f"{name}_ms"] = round(_time(smpl.draw_row, rows, reps) * 1e3, 4)
        smpl.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,gemma")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--history", type=int, default=128)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT})")
    p.add_argument("--quick", action="store_true",
                   help="a few rows: the suite's run, not a measurement")
    args = p.parse_args(argv)
    if args.quick:  # the quick sizes become the defaults; flags given still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    results = []
    for spec in args.models.split(","):
        model = LlamaModel(resolve_model(spec).path, vocab_only=True)
        try:
            results.append({"model": spec, **measure(model, args.reps, args.history)})
        finally:
            model.close()
        print(json.dumps(results[-1], indent=2))
    given = sys.argv[1:] if argv is None else argv
    report = {"command": "python -m bench.sampling " + " ".join(given),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "load": os.getloadavg()},
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
