"""The first answer on a fresh data dir: `bash scripts/run.sh`, then the README's question.

    .venv/bin/python -m bench.first_answer            # README's question, this checkout
    .venv/bin/python -m bench.first_answer --cold-weights   # also without the converted
                                                            # weights in the model cache

Starts ``bash scripts/run.sh --data-dir FRESH --port P`` (the README's first command; its
install step is a no-op on an installed checkout), times from the process start to the
agent card (``/.well-known/agent-card.json``), then sends the question with ``mesh send``
and times the answer; records the answer text beside the times and the start-up log lines
that explain them (the prefix's size and decode time, the weights loaded). ``--cold-weights``
points ``XDG_CACHE_HOME`` at an empty folder, so the run also converts the default model's
weights (``--weights auto``) and writes the tiny caches, as the first run after an install
does. Writes ``bench/first_answer/results/first_answer.json``. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "results" / "first_answer.json"
QUESTION = "Which file defines the shared KV pool?"
GOAL_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(question: str, cold_weights: bool, timeout_s: float) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(prefix="mesh-first-"))
    port = _free_port()
    env = dict(os.environ)
    if cold_weights:
        env["XDG_CACHE_HOME"] = str(data / "cache")
    log = data / "serve.log"
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "scripts/run.sh", "--data-dir", str(data / "d"),
                                 "--port", str(port)], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        card_s = None
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"mesh exited {proc.returncode}: {log.read_text()[-800:]}")
            try:
                with urllib.request.urlopen(url + "/.well-known/agent-card.json", timeout=2):
                    card_s = time.monotonic() - t0
                    break
            except OSError:
                time.sleep(0.1)
        if card_s is None:
            raise RuntimeError(f"no agent card within {timeout_s:.0f} s")
        sent = subprocess.run([str(ROOT / ".venv" / "bin" / "mesh"), "send", url, question],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
        answer_s = time.monotonic() - t0
        lines = [ln for ln in log.read_text(errors="replace").splitlines()
                 if ln.startswith(("prefix:", "weights:", "template:", "model:"))
                 and not re.match(r"\s*prefix: \d+/\d+ tokens decoded", ln)]
        return {"cold_weights": cold_weights, "agent_card_up_s": round(card_s, 2),
                "first_answer_s": round(answer_s, 2), "answer_after_send_s":
                round(answer_s - card_s, 2), "exit": sent.returncode,
                "answer": sent.stdout.strip()[-1500:], "serve_log": lines}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--cold-weights", action="store_true",
                   help="also a run with an empty model cache (converts the weights)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    runs = [one_run(args.question, False, args.timeout)]
    if args.cold_weights:
        runs.append(one_run(args.question, True, args.timeout))
    for r in runs:
        print(f"{'cold' if r['cold_weights'] else 'warm'} model cache: card {r['agent_card_up_s']}"
              f" s, first answer {r['first_answer_s']} s (goal {GOAL_S:g} s)\n"
              f"  answer: {r['answer'][:300]}\n  " + "\n  ".join(r["serve_log"]))
    doc = {"what": "first answer after `bash scripts/run.sh` on a fresh data dir, default model",
           "command": "python -m bench.first_answer" + (" --cold-weights" if args.cold_weights
                                                        else ""),
           "question": args.question, "goal_s": GOAL_S, "timed_from": "the run.sh start",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "load_avg": os.getloadavg()},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
