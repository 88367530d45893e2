"""``--engine openai:URL`` on llama-cpp-python's server: what prefix reuse buys a turn.

Starts ``python -m llama_cpp.server`` (``--interrupt_requests False``, one context) on the
model, builds an :class:`~mesh.backends.OpenAIEngine` on it with a prefix of about P tokens
(a new one each repetition, so the first turn is cold), and times four turns, each asking
for G tokens (greedy): ``cold`` (session A's first turn: the server has never seen the
prefix), ``new session`` (B's first turn: the prefix is what the server's context already
holds), ``switch back`` (A's second turn after B's: prefix reused, A's history prefilled
again), ``same session`` (A's third turn right after its second: everything reused).
Reported per kind: time to the first streamed token and the whole turn, medians.

    python -m bench.backend --model tiny --prefix-tokens 2000 --reps 5
    python -m bench.backend --quick     # P = 200, 4 tokens, 1 rep, 1 thread: seconds

(Gemma 3 270M crashed llama-cpp-python's server on this machine, a general protection
fault in libggml-cpu right after it repacked the Q4_K weights for AMX: its ``Llama`` class
always uses those extra buffers, which mesh's own pool turns off.)

Prints a table and writes ``bench/backend/results/backend_llama_cpp_server.json`` (or ``--out``;
with ``--quick``, a temporary path: ``QUICK_OUT``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from mesh.backends.openai import BackendConfig, OpenAIEngine
from mesh.engine.config import SamplingParams
from mesh.engine.interface import Session
from mesh.engine.llama import LlamaModel
from mesh.engine.models import resolve_model

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "backend_llama_cpp_server.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "backend_llama_cpp_server.json"
QUICK: dict[str, Any] = {"prefix_tokens": 200, "gen": 4, "reps": 1, "threads": 1,
                         "out": QUICK_OUT}
KINDS = ("cold", "new session", "switch back", "same session")
LINE = "courier/parcel.py:{n}: def route(parcel, depot): return depot.next_hop(parcel.zone)\n"


@contextlib.contextmanager
def llama_cpp_server(model: Path, n_ctx: int, threads: int) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = Path(tempfile.mkdtemp(prefix="backend-bench-")) / "llama-cpp-server.log"
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host",
            "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads",
            str(threads), "--interrupt_requests", "False", "--verbose", "False"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"llama_cpp.server did not start; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def timed_turn(session: Session, text: str, params: SamplingParams) -> tuple[float, float]:
    session.append(text)
    t0 = time.perf_counter()
    first: float | None = None
    async for _ in session.generate(params):
        if first is None:
            first = time.perf_counter() - t0
    return (first if first is not None else float("nan")), time.perf_counter() - t0


async def one_rep(url: str, vocab: LlamaModel, rep: int, prefix_tokens: int,
                  params: SamplingParams) -> dict[str, tuple[float, float]]:
    lines, prefix = 0, f"system: repetition {rep} of the backend bench.\n"
    while len(vocab.tokenize(prefix, add_bos=True)) < prefix_tokens:
        prefix += LINE.format(n=lines)
        lines += 1
    eng = OpenAIEngine(BackendConfig(url=url, max_sessions=2, session_budget=1024,
                                     warm_prefix=False, poll_metrics=False), prefix,
                       tokenize=lambda t: vocab.tokenize(t, add_bos=False))
    await eng.start()
    try:
        a, b = await eng.attach(), await eng.attach()
        out = {"cold": await timed_turn(a, "\nuser: list the files\nassistant:", params),
               "new session": await timed_turn(b, "\nuser: read main.py\nassistant:", params),
               "switch back": await timed_turn(a, "\nuser: and then?\nassistant:", params),
               "same session": await timed_turn(a, "\nuser: go on\nassistant:", params)}
    finally:
        await eng.aclose()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, gemma or a GGUF path")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--gen", type=int, default=16, help="tokens per turn")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"default: {DEFAULT_OUT} (with --quick: {QUICK_OUT})")
    ap.add_argument("--quick", action="store_true",
                    help="a small prefix, one repetition: the suite's run, not a measurement")
    args = ap.parse_args(argv)
    if args.quick:  # the quick sizes become the defaults; flags given still win
        ap.set_defaults(**QUICK)
        args = ap.parse_args(argv)
    model = resolve_model(args.model).path
    vocab = LlamaModel(str(model), vocab_only=True)
    params = SamplingParams(max_tokens=args.gen, temperature=0.0)
    runs: list[dict[str, tuple[float, float]]] = []
    try:
        with llama_cpp_server(model, args.prefix_tokens + 2048, args.threads) as url:
            for rep in range(args.reps):
                runs.append(asyncio.run(one_rep(url, vocab, rep, args.prefix_tokens, params)))
    finally:
        vocab.close()
    rows: dict[str, dict[str, float]] = {}
    print(f"llama_cpp.server, {model.name}, prefix ~{args.prefix_tokens} tokens, "
          f"{args.gen} tokens a turn, {args.reps} reps (medians)")
    print(f"{'turn':<14} {'first token ms':>15} {'turn ms':>9}")
    for kind in KINDS:
        ttft = statistics.median(r[kind][0] for r in runs) * 1000
        total = statistics.median(r[kind][1] for r in runs) * 1000
        rows[kind] = {"first_token_ms": round(ttft, 1), "turn_ms": round(total, 1)}
        print(f"{kind:<14} {ttft:>15.1f} {total:>9.1f}")
    report: dict[str, Any] = {
        "server": "llama_cpp.server --interrupt_requests False", "model": model.name,
        "prefix_tokens": args.prefix_tokens, "gen_tokens": args.gen, "reps": args.reps,
        "threads": args.threads, "machine": platform.machine(), "turns": rows,
        "command": "python -m bench.backend " + " ".join(argv or sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
