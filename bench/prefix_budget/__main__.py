"""The light template's prefix budget, measured: prefix decode time against answers right.

For each prefix size (``--prefix-tokens``), this starts ``mesh serve`` on this checkout
(the default model unless ``--model``; a fresh data dir; one prefix cache for the run, so
each size's prefix is decoded, and timed, once, and the gate's start-up probe runs once),
asks the "which file defines ..." questions below
with ``mesh send``, checks each answer for the right path, and writes one JSON report::

    .venv/bin/python -m bench.prefix_budget --sizes 2048,4096,5632
    .venv/bin/python -m bench.prefix_budget --sizes 5632 --limit 3

What it reports per size: the prefix's tokens and decode seconds (from the start-up log),
how many files of ``mesh/`` the outline has a line for (from the prefix built the same way),
and right/total with every answer text. The questions name a thing in the words of its
module docstring or its class name; none of them is known to the product.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.servers import free_port, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]

# (question, the path a right answer names)
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("Which file defines the shared KV pool?", "mesh/engine/pool.py"),
    ("Which file defines the class FloorGate?", "mesh/gate/admission.py"),
    ("Which file defines the class AgentWorker?", "mesh/worker/loop.py"),
    ("Which file defines the function build_prefix?", "mesh/template/prefix.py"),
    ("Which file defines the class ChatFormat?", "mesh/template/chat.py"),
    ("Which file defines the function turn_grammar?", "mesh/worker/grammar.py"),
    ("Which file defines the class ProjectTools?", "mesh/worker/tools.py"),
    ("Which file defines the function parse_plan?", "mesh/agent/plans.py"),
)


def _mesh() -> str:
    exe = Path(sys.executable).with_name("mesh")
    return str(exe) if exe.exists() else "mesh"


def _outlined(size: int, model: str | None) -> dict[str, Any]:
    """How much of mesh/ the outline of a ``size``-token light prefix holds."""
    from mesh.engine.llama import LlamaModel
    from mesh.engine.models import resolve_model
    from mesh.template.loader import load_template
    from mesh.template.prefix import build_prefix

    resolved = resolve_model(model)
    vocab = LlamaModel(str(resolved.path), vocab_only=True)
    try:
        prefix = build_prefix(load_template("light"), ROOT,
                              lambda t: len(vocab.tokenize(t, add_bos=False)),
                              target_tokens=size)
    finally:
        vocab.close()
    mesh = [rel for rel in subprocess.run(
        ["git", "ls-files", "mesh"], cwd=ROOT, capture_output=True, text=True,
        check=True).stdout.split() if not rel.startswith("mesh/template/builtin")]
    lined = {e.path for e in prefix.outlined}
    return {"mesh_files": len(mesh), "mesh_files_outlined": sum(r in lined for r in mesh),
            "files_outlined": len(lined), "folded": list(prefix.folded)}


def run_size(size: int, args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [_mesh(), "serve", "--port", str(port), "--prefix-tokens", str(size)]
    if args.model:
        argv += ["--model", args.model]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mesh-budget-") as tmp:
        log = Path(tmp) / "serve.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen([*argv, "--data-dir", str(Path(tmp) / "data"),
                                     "--prefix-cache", str(cache)],
                                    stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                started = wait_healthy(url, proc, limit_s=args.start_timeout_s, log=log,
                                       name="mesh serve")
                for question, path in QUESTIONS[: args.limit or None]:
                    t0 = time.monotonic()
                    done = subprocess.run([_mesh(), "send", url, question],
                                          capture_output=True, text=True,
                                          timeout=args.task_timeout_s, check=False)
                    answer = done.stdout.strip()
                    rows.append({"question": question, "expected": path, "answer": answer,
                                 "right": path in answer.split("\n\nEvidence:")[0],
                                 "s": round(time.monotonic() - t0, 1)})
                    print(f"[{size}] {question} -> {answer!r}", file=sys.stderr)
            finally:
                stop(proc)
        text = log.read_text(errors="replace")
    decoded = re.search(r"prefix: (\d+) tokens, sha256 \w+, decoded in ([0-9.]+)s", text)
    return {
        "prefix_tokens_asked": size,
        "prefix_tokens": int(decoded.group(1)) if decoded else None,
        "prefix_decode_s": float(decoded.group(2)) if decoded else None,
        "healthy_after_s": round(started, 1),
        "right": sum(r["right"] for r in rows),
        "total": len(rows),
        **_outlined(size, args.model),
        "answers": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2048,4096,5632")
    p.add_argument("--model", default=None)
    p.add_argument("--limit", type=int, default=0, help="ask only the first N questions")
    p.add_argument("--out", type=Path,
                   default=Path(__file__).resolve().parent / "results" / "prefix_budget.json")
    p.add_argument("--start-timeout-s", type=float, default=1200.0)
    p.add_argument("--task-timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "command": "python -m bench.prefix_budget " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mesh-budget-cache-") as cache:
        for size in sizes:  # the report is written after each size: a late failure keeps it
            runs.append(run_size(size, args, Path(cache)))
            args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for run in runs:
        print(f"{run['prefix_tokens']} tokens: decoded in {run['prefix_decode_s']} s, "
              f"{run['mesh_files_outlined']}/{run['mesh_files']} mesh/ files outlined, "
              f"{run['right']}/{run['total']} right")
    print(f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
