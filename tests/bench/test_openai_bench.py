"""``python -m bench.openai --quick``: the multi-turn agent workload through mesh's OpenAI API
(``mesh serve --model tiny`` spawned by the bench), so the benchmark never rots: both waves
ran every turn with no error, and the prompt-token accounting is there. This covers mesh's
side only: the llama-server and vLLM rows need their servers, which the suite does not build
(tests/api/test_openai_bench_args.py checks how they are sized and started). Run as a child
process, as a user runs it: the bench installs a SIGTERM handler. No time is asserted."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from bench.openai import __main__ as openai_bench

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_form_runs_both_waves_on_mesh(tmp_path: Path) -> None:
    out = tmp_path / "openai.json"
    mesh = f"--model tiny --policy none --threads 1 --data-dir {shlex.quote(str(tmp_path))}"
    done = subprocess.run(
        [sys.executable, "-m", "bench.openai", "--quick", "--spawn-mesh", mesh,
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    quick = openai_bench.QUICK
    assert result["workload"]["agents"] == quick["agents"]
    (target,) = result["targets"]
    assert target["name"] == "mesh" and target["kv_cells"] > 0
    assert len(target["waves"]) == 2  # cold, then warm
    for wave in target["waves"]:
        assert wave["errors"] == 0
        assert wave["turns"] == quick["agents"][0] * quick["turns"]
        assert 0 < wave["prompt_tokens_processed"] <= wave["prompt_tokens"]


def test_quick_names_mesh_on_the_tiny_model_unless_a_system_is_given() -> None:
    assert openai_bench.parse(["--quick"]).spawn_mesh == openai_bench.QUICK_MESH
    a = openai_bench.parse(["--quick", "--mesh", "http://127.0.0.1:9"])
    assert a.spawn_mesh is None and a.agents == [2] and a.out == openai_bench.QUICK_OUT
    assert openai_bench.parse(["--quick", "--agents", "3"]).agents == [3]  # flags still win
