"""Record what the default model answers to the README's example question: a transcript.

Starts ``mesh serve`` as the README's quick start does (in this checkout, so the project
is the checkout itself; the default model unless ``--model``), sends the README's question
with ``mesh send --stream`` (and, with ``--follow-up``, a second message in the same
context), and writes everything the commands print, with their wall times, to one text
file (``bench/demo_transcript/results/default.txt`` by default). Re-run it whenever the agent's
behaviour changes, so the README's transcript stays true::

    .venv/bin/python -m bench.demo_transcript
    .venv/bin/python -m bench.demo_transcript --project templates/sample \\
        --question "Which file defines the Parcel class?" \\
        --out bench/demo_transcript/results/sample.txt

The server gets its own data dir (a fresh task store) and shares the prefix snapshot and
the gate's seed through ``--prefix-cache`` (default ``.mesh/prefix-cache``, what
``bash scripts/run.sh`` uses), so a second run on an unchanged checkout starts in seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common.servers import free_port, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "Which file defines the shared KV pool?"  # the README's example


def _mesh() -> str:
    """The ``mesh`` command of this interpreter's environment."""
    exe = Path(sys.executable).with_name("mesh")
    return str(exe) if exe.exists() else "mesh"


def _send(url: str, text: str, context: str | None, timeout_s: float) -> tuple[str, float]:
    """Run ``mesh send URL TEXT --stream`` (in ``context``); its output and wall time."""
    cmd = [_mesh(), "send", url, text, "--stream"] + (["--context", context] if context else [])
    t0 = time.monotonic()
    # One stream, unbuffered: the text and the status lines in the order a terminal shows.
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout_s, check=False,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    took = time.monotonic() - t0
    shown = "$ mesh send " + url + (f" --context {context}" if context else "") + f' "{text}"'
    out = f"{shown} --stream\n{done.stdout}(exit {done.returncode}, {took:.1f} s)\n"
    return out, took


def record(args: argparse.Namespace) -> str:
    """Start the server, ask, ask again, stop the server; the transcript."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Paths relative to the checkout (the server runs there), so the transcript shows them.
    serve = ["serve", "--port", str(port), "--prefix-cache", str(args.prefix_cache)]
    if args.project:
        serve[1:1] = ["--project", args.project]
    if args.model:
        serve += ["--model", args.model]
    second = ""
    with tempfile.TemporaryDirectory(prefix="mesh-demo-") as data:
        log = Path(data) / "serve.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen([_mesh(), *serve, "--data-dir", str(Path(data) / "data")],
                                    stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                started = wait_healthy(url, proc, limit_s=args.start_timeout_s, log=log,
                                       name="mesh serve")
                first, _ = _send(url, args.question, None, args.task_timeout_s)
                match = re.search(r"\(context ([0-9a-f-]+)\)", first)
                if match and args.follow_up:
                    second, _ = _send(url, args.follow_up, match.group(1), args.task_timeout_s)
            finally:
                stop(proc)
        lines = log.read_text(errors="replace").splitlines()
    # The server's start-up lines, up to the dashboard's address (uvicorn's log follows).
    end = next((i for i, ln in enumerate(lines) if ln.startswith("dashboard:")), len(lines) - 1)
    head = (f"$ mesh {' '.join(serve)}   # bench/demo_transcript/; "
            f"healthy after {started:.1f} s\n")
    return head + "\n".join(lines[:end + 1]) + "\n\n" + first + ("\n" + second if second else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="as mesh serve --model (default: its default)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/demo_transcript/results/default.txt")
    p.add_argument("--prefix-cache", type=Path, default=Path(".mesh/prefix-cache"),
                   help="shared prefix snapshot and gate seed (relative: to the checkout)")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--task-timeout-s", type=float, default=600.0)
    p.add_argument("--project", default=None,
                   help="as mesh serve --project (default: the checkout itself)")
    p.add_argument("--question", default=QUESTION, help="default: the README's example")
    p.add_argument("--follow-up", default=None,
                   help="a second message, sent in the first one's context")
    args = p.parse_args(argv)
    text = record(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(text)
    print(f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
