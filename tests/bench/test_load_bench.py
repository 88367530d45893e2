"""``python -m bench.load --quick``: A2A clients against ``mesh serve`` on the fake engine and
on the tiny model (child processes), so the benchmark never rots. What a reader checks holds:
nothing lost, no 5xx, every 429 named its Retry-After. No time is asserted (nor the RSS
growth, which is the full run's measurement)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.load import __main__ as load_bench


def test_the_quick_form_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    load_bench.main(["--quick", "--out", str(out)])  # its exit status includes the RSS check
    result = json.loads(out.read_text())
    sizes = load_bench.QUICK
    for run, tasks in (("fake", sizes.fake_tasks), ("tiny", sizes.tiny_tasks)):
        r = result[run]
        assert r["tasks_submitted"] == r["reached_terminal"] == tasks, (run, r["client_errors"])
        assert r["lost"] == 0 and r["num_5xx"] == 0, run
        assert r["num_429_without_retry_after"] == 0, run
    assert set(result["tiny"]["mix"]) == {"send", "stream", "cancel"}
    verdict = result["verdict"]
    assert verdict["zero_lost"] and verdict["zero_5xx"] and verdict["every_429_has_retry_after"]
