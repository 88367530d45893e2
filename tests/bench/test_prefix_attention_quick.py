"""``python -m bench.prefix_attention --quick`` through its ``main``, on the tiny model with the
long-context twin left out (``--long-prefixes ''``: writing and prefilling the twin takes
half a minute on two cores), so the whole path — the grid, the fits, the analysis and the
JSON — never rots. tests/bench/test_prefix_attention_bench.py checks the grid's points and the
fits' arithmetic. No time is asserted."""

from __future__ import annotations

import json
from pathlib import Path

from bench.prefix_attention import __main__ as prefix_attention_bench


def test_the_quick_form_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "prefix_attention.json"
    assert prefix_attention_bench.main(
        ["--quick", "--long-prefixes", "", "--kv", "f16", "--threads", "1",
         "--work-dir", str(tmp_path / "work"), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {"meta", "points", "fits", "split", "masked_probes", "best"} <= set(result)
    quick = prefix_attention_bench.QUICK
    prefixes = {int(p) for p in quick["prefixes"].split(",")}
    rows = {int(r) for r in quick["rows"].split(",")}
    grid = {(p["fa"], p["prefix"], p["rows"]) for p in result["points"]
            if p["suffix"] == quick["suffix"]}
    assert grid == {(fa, p, r) for fa in ("on", "off") for p in prefixes for r in rows}
    assert all(p["cells_used"] == p["prefix"] + p["rows"] * p["suffix"]
               for p in result["points"])
    assert len(result["best"]) == len(prefixes) * len(rows)
