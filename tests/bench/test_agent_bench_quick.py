"""``python -m bench.agent --quick``: two questions to ``mesh serve --model tiny`` (spawned by
the bench), so the benchmark never rots: every question came back as a finished task with a
checked verdict (the answer held its facts or they are listed as missing). The tiny model's
weights are random, so nothing is asserted about accuracy, nor any time. Run as a child
process, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.agent import __main__ as agent_bench

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_form_checks_every_question(tmp_path: Path) -> None:
    out = tmp_path / "agent.json"
    done = subprocess.run([sys.executable, "-m", "bench.agent", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    (run,) = report["results"]
    assert (run["model"], run["template"], run["plan"]) == ("tiny", "light", "never")
    assert run["tasks"] == agent_bench.QUICK["limit"]
    (tasks,) = report["tasks"].values()
    assert len(tasks) == agent_bench.QUICK["limit"]
    for task in tasks:
        assert task["state"] == "completed", task
        assert isinstance(task["ok"], bool)
        facts = task["expected"].split(" + ")
        # the verdict was checked: either right, or the facts it lacks are named
        assert task["ok"] == (task["missing"] == []) and set(task["missing"]) <= set(facts)


def test_quick_writes_to_a_temporary_path_unless_told() -> None:
    assert agent_bench.DEFAULT_OUT == ROOT / "bench" / "agent" / "results" / "agent.json"
    assert agent_bench.QUICK_OUT.parent.name == "mesh-bench"
