"""bench/weights/'s quick form end to end on the tiny model stored as Q4_1: every
``--weights`` choice loads, is timed, and is compared with the file as shipped."""

from __future__ import annotations

import json
from pathlib import Path

from bench.weights.__main__ import CHOICES, main


def test_quick_form_writes_every_choice(tmp_path: Path) -> None:
    out = tmp_path / "weights.json"
    main(["--quick", "--out", str(out), "--threads", "1"])
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert set(rows) == set(CHOICES)
    assert rows["as-is"]["loaded"] == "as-is (Q4_1)"
    assert rows["q8_0"]["loaded"] == "q8_0 from Q4_1"
    assert rows["as-is"]["top1_agreement"] == 1.0  # the reference against itself
    assert rows["as-is"]["greedy_identical"] == rows["as-is"]["greedy_prompts"]
    for row in rows.values():
        assert row["prefill_tps"] > 0 and set(row["step_ms"]) == {"1", "4"}
        assert 0.0 <= row["top1_agreement"] <= 1.0
    # Q8_0 holds every Q4_1 weight within half a Q8_0 step: closer to the reference than
    # a second 4-bit rounding (q4_0) is, on the same text.
    assert rows["q8_0"]["top1_agreement"] >= rows["q4_0"]["top1_agreement"]
