"""``python -m bench.cluster --quick`` on the two-node local cluster: it runs, and what it
reports is what a reader checks (every agent completed, even with a pool killed; the
routing overhead measured). No wall-clock time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ray.cluster_utils import Cluster

from tests.reliability.serve_proc import serve_env

ROOT = Path(__file__).resolve().parents[2]


def test_the_cluster_bench_quick(ray_cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.cluster", "--quick", "--ray", ray_cluster.address,
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=serve_env(tmp_path / "cache"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    local, two, killed, alone = doc["runs"]
    assert local["overhead_p50_ms"] is None
    for run in (local, two, killed):
        assert run["agents_completed"] == doc["agents"] and run["agents_failed"] == 0
        assert run["turns"] == doc["agents"] * doc["turns"]
    assert alone["agents_completed"] == 1 and alone["turns"] == 4 * doc["turns"]
    assert two["overhead_p50_ms"] > 0 and two["sessions_moved"] == 0
    assert killed["killed_after_turns"] is not None and killed["sessions_moved"] >= 1
    assert "| two Ray pools, 1 thread each |" in done.stdout


def test_the_quick_form_never_writes_a_result() -> None:
    from bench.cluster import __main__ as cluster_bench

    assert cluster_bench.DEFAULT_OUT.parent == ROOT / "bench" / "cluster" / "results"
    assert cluster_bench.QUICK_OUT.is_relative_to(tempfile.gettempdir())
