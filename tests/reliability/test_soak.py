"""The soak's quick form: ``python -m bench.soak --minutes 3 --seed 1`` against a real
``mesh serve`` on the default model (SmolLM2), one SIGKILL and restart in the middle, a
quiet period in the middle and one at the end; every goal it reports must pass.

4-6 minutes on 2 cores (the server's first start decodes the prefix; the last tasks of a
segment run into its quiet period). What each goal checks: bench/soak/ and docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 1200  # the 3-minute schedule, its quiet periods, the tasks' tails, two starts


@pytest.mark.slow
def test_soak_quick_form_meets_every_goal(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # its own process group: past the limit the soak and the server it spawned both stop
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.soak", "--minutes", "3", "--seed", "1", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"the soak ran past {LIMIT_S} s:\n{stdout[-6000:]}\n{stderr[-3000:]}")
    report = f"exit {proc.returncode}\n{stdout[-6000:]}\n{stderr[-3000:]}"
    assert out.exists(), report
    result = json.loads(out.read_text())
    goals = result["goals"]
    failed = {name: g for name, g in goals.items() if g["pass"] is False}
    assert not failed, f"{json.dumps(failed, indent=1)}\n{report}"
    # the figures the goals stand on, named
    assert result["tasks"]["lost"] == 0, report
    assert result["requests"]["num_5xx"] == 0, report
    assert result["requests"]["unanswered"] == 0, report
    quiet = result["quiet_periods"]
    assert len(quiet) >= 2 and all(q["restored"] for q in quiet), report
    assert all(q["sessions"] == 0 and q["cells_used"] == q["prefix_cells"] for q in quiet)
    assert len(result["servers"]) == 2, "the kill -9 and restart did not happen"
    for server in result["servers"]:
        assert server["rss_growth_pct"] is not None, report  # measured after warm-up
        assert server["rss_growth_pct"] <= 10.0, report
        assert server["fds_max"] - server["fds_base"] <= 24, report
    assert goals["restart_running_tasks_failed"]["pass"] is True, report
    assert goals["restart_finished_tasks_readable"]["pass"] is True, report
    assert proc.returncode == 0, report
