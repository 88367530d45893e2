"""Sampling under a grammar: draw-then-check vs the grammar at the head of the chain.

One llama.cpp context, one sequence; the same prompt is decoded once per variant, then
``--tokens`` tokens are generated one step at a time with each sampler:

- ``none``           the chain without a grammar (the floor);
- ``grammar-first``  the grammar masks every candidate, every token (llama.cpp's plain chain);
- ``draw-check``     mesh's sampler: draw, let the grammar check that one token, redraw under
                     the full mask only when it is rejected.

Times are per token, sampling only (the decode of each step is timed apart): the median
token, and the mean (which carries the redraws); the ratio is of means, within one run.
The grammar is the worker's tool-call grammar for the light template's tools
(``mesh.worker.grammar``), so the text is what a worker writes; ``--grammar plan`` takes
the coordinator's plan grammar instead (``mesh.agent.plans``, the default
``mesh serve`` settings) and a planning prompt.

    .venv/bin/python -m bench.grammar                 # Gemma 3 270M (262K vocabulary)
    .venv/bin/python -m bench.grammar --model tiny
    .venv/bin/python -m bench.grammar --grammar plan --tokens 96 --out /tmp/plan.json
    .venv/bin/python -m bench.grammar --model tiny --quick   # 8 tokens, once: seconds

Writes ``bench/grammar/results/grammar.json`` (or ``--out``; with ``--quick``, a temporary path:
``QUICK_OUT``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mesh.engine.llama import Batch, LlamaContext, LlamaModel
from mesh.engine.models import resolve_model
from mesh.engine.sampling import Sampler

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "grammar.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "grammar.json"
QUICK: dict[str, Any] = {"tokens": 8, "repeats": 1, "threads": 1, "out": QUICK_OUT}
TOOL_PROMPT = ("You answer questions about a Python project with its tools.\n"
          "Question: which file defines the class Parcel?\n")


def tool_grammar() -> str:
    from mesh.template.loader import load_template
    from mesh.worker.grammar import turn_grammar

    template = load_template("light")
    return turn_grammar(template.manifest.tool_calls, ("list_files", "read_file", "grep"),
                        max_tokens=64)


def plan_grammar() -> str:
    from mesh.agent.plans import plan_schema, schema_to_gbnf
    from mesh.agent.task import AgentConfig

    cfg = AgentConfig()
    return schema_to_gbnf(plan_schema(cfg.max_subtasks, ("list_files", "read_file", "grep"),
                                      cfg.actions, cfg.text_max))


PLAN_PROMPT = ("You are the coordinator. Plan how to answer the user's request.\n"
               "User request:\nWhich function in routes.py calls what in parcels.py?\n\nPlan:\n")


def run(model: LlamaModel, prompt: str, grammar: str | None, first: bool, tokens: int,
        seed: int, temperature: float, threads: int) -> dict[str, Any]:
    ctx = LlamaContext(model, n_ctx=1024, n_seq_max=1, n_batch=512, n_outputs_max=1,
                       n_threads=threads, swa_full=True)
    batch = Batch(512)
    sampler = Sampler(model, temperature=temperature, top_k=40, top_p=0.95, seed=seed,
                      grammar=grammar, grammar_first=first)
    try:
        ids = model.tokenize(prompt, add_bos=True)
        for i, t in enumerate(ids):
            batch.add(t, i, 0, i == len(ids) - 1)
        if ctx.decode(batch) != 0:
            raise RuntimeError("prompt decode failed")
        pos, out, sample_s, decode_s = len(ids), [], [], []
        for _ in range(tokens):
            t0 = time.perf_counter()
            tok = sampler.sample(ctx, batch.n_tokens - 1)
            sample_s.append(time.perf_counter() - t0)
            if model.is_eog(tok):
                break
            out.append(tok)
            batch.clear()
            batch.add(tok, pos, 0, True)
            pos += 1
            t0 = time.perf_counter()
            if ctx.decode(batch) != 0:
                raise RuntimeError("decode failed")
            decode_s.append(time.perf_counter() - t0)
        text = b"".join(model.token_bytes(t) for t in out).decode("utf-8", "replace")
        return {"tokens": len(out), "sample_ms": 1e3 * statistics.median(sample_s),
                "sample_ms_mean": 1e3 * statistics.fmean(sample_s),
                "decode_ms": 1e3 * statistics.median(decode_s) if decode_s else 0.0,
                "redraws": sampler.num_redraws, "full_redraws": sampler.num_full_redraws,
                "text": text}
    finally:
        sampler.close()
        batch.close()
        ctx.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma", help="GGUF path, or smollm2, gemma, tiny "
                   "(default: gemma, the largest vocabulary)")
    p.add_argument("--grammar", choices=("tool", "plan"), default="tool",
                   help="the worker's tool-call grammar (default) or the coordinator's plan")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT})")
    p.add_argument("--quick", action="store_true",
                   help="a few tokens, once: the suite's run, not a measurement")
    args = p.parse_args(argv)
    if args.quick:  # the quick sizes become the defaults; flags given still win
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    resolved = resolve_model(args.model)
    model = LlamaModel(resolved.path)
    try:
        return _bench(args, argv, resolved.name, model)
    finally:
        model.close()


def _bench(args: argparse.Namespace, argv: list[str] | None, name: str,
           model: LlamaModel) -> int:
    if args.grammar == "plan":
        grammar, prompt = plan_grammar(), PLAN_PROMPT
    else:
        grammar, prompt = tool_grammar(), TOOL_PROMPT
    variants = {"none": (None, False), "grammar-first": (grammar, True),
                "draw-check": (grammar, False)}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    for rep in range(args.repeats):
        for kind, (g, first) in variants.items():
            rows[kind].append(run(model, prompt, g, first, args.tokens, rep,
                                  args.temperature, args.threads))
            print(f"  repeat {rep + 1}/{args.repeats} {kind}: "
                  f"{rows[kind][-1]['sample_ms']:.2f} ms/token", file=sys.stderr)
    summary = {}
    for kind, rs in rows.items():
        summary[kind] = {
            "sample_ms": statistics.median(r["sample_ms"] for r in rs),
            "sample_ms_mean": statistics.fmean(r["sample_ms_mean"] for r in rs),
            "decode_ms": statistics.median(r["decode_ms"] for r in rs),
            "tokens": sum(r["tokens"] for r in rs),
            "redraws": sum(r["redraws"] for r in rs),
            "full_redraws": sum(r["full_redraws"] for r in rs),
        }
    base = summary["grammar-first"]["sample_ms_mean"]
    print(f"\nmodel {name} (vocabulary {model.n_vocab:,}), {args.tokens} tokens x "
          f"{args.repeats}, temperature {args.temperature}")
    print(f"{'sampler':<15}{'sample ms p50':>15}{'sample ms mean':>16}{'decode ms p50':>15}"
          f"{'redraws (full)':>17}{'mean vs grammar-first':>23}")
    for kind, s in summary.items():
        redraws = f"{s['redraws']}/{s['tokens']} ({s['full_redraws']})"
        print(f"{kind:<15}{s['sample_ms']:>15.2f}{s['sample_ms_mean']:>16.2f}"
              f"{s['decode_ms']:>15.2f}{redraws:>17}{base / s['sample_ms_mean']:>22.1f}x")
    doc = {"command": "python -m bench.grammar " + " ".join(argv or sys.argv[1:]),
           "model": name, "n_vocab": model.n_vocab, "grammar_kind": args.grammar,
           "tokens": args.tokens,
           "repeats": args.repeats, "temperature": args.temperature, "summary": summary,
           "runs": rows, "grammar": grammar}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
