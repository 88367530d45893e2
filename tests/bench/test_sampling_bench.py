"""``python -m bench.sampling --quick`` on the tiny model's vocabulary, so the benchmark never
rots: argmax and every sampler chain were timed. No time is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench.sampling import __main__ as sampling_bench


def test_the_quick_form_times_every_chain(tmp_path: Path) -> None:
    out = tmp_path / "sampling.json"
    assert sampling_bench.main(["--models", "tiny", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["results"]
    assert row["model"] == "tiny" and row["n_vocab"] > 0
    timed = {k.removesuffix("_ms") for k in row if k.endswith("_ms")}
    assert timed == {"argmax (greedy, no repetition control)", *sampling_bench.VARIANTS}
    assert "--quick" in result["command"]
