"""``python -m bench.pool --quick`` on the tiny model, so the benchmark never rots: every
section runs, and the capacity section's cell accounting (the pool's count, llama.cpp's
ranges and the prefix plus the *resident* sessions' suffixes; sessions past the cache's
sequence ids attach parked) holds, as the bench itself asserts."""

from __future__ import annotations

import json
from pathlib import Path

from bench.pool import __main__ as pool_bench


def test_the_quick_form_runs_every_section(tmp_path: Path) -> None:
    out = tmp_path / "pool.json"
    assert pool_bench.main(["--model", "tiny", "--quick", "--threads", "1", "--out",
                            str(out)]) == 0
    result = json.loads(out.read_text())
    cap = result["capacity"]
    assert cap["cells_used"] == cap["P"] + cap["pooled_measured"] * cap["S"]
    assert cap["pooled_attached"] >= cap["pooled_measured"] > 0
    names = {t["name"] for t in result["targets"]}
    assert {"capacity.pooled", "decode.speedup@8", "warm_start.ratio"} <= names
