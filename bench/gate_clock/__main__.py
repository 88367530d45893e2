"""The floor gate on the user's clock: p50 delivery and wall against legacy, per seed.

Runs ``mesh simulate --compare policy=...`` once per (scenario, seed) into
``bench/gate_clock/results/<scenario>-s<seed>/`` (skipped where that folder already has a
``compare.json``, so an interrupted run resumes), then reads every comparison and prints,
per scenario and policy, the median and the spread (min–max) over the seeds of: wall,
p50 delivery, each as a ratio to legacy *in the same run*, client windows under the floor
(per neighbour phase where a neighbour ran), mean running turns and aggregate tokens/s.
Writes ``bench/gate_clock/results/summary.json`` (or ``--out``) and ``summary.md``.

    python -m bench.gate_clock                       # light quiet, seeds 1-3, and more
    python -m bench.gate_clock --summarize-only      # just the table from what is there
    python -m bench.gate_clock --quick --root /tmp/gc  # 6 packages, one seed (test form)

Every run is on the real engine (SmolLM2 unless ``--model``); run it alone on the machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path("bench/gate_clock/results")
POLICIES = ("floor", "floor-auto", "legacy", "static:8")
# The floor of the comparison: the sweet spot `mesh sweep` named for the light scenario on
# this machine (bench/gate_clock/results/sweep/sweep.json; --floor-tps overrides). A floor
# above the knee pays in wall time by construction: the comparison runs at the knee.
FLOOR = 2.0
# name -> the mesh simulate arguments of that scenario (the floor and seed are added per run)
SCENARIOS: dict[str, tuple[str, ...]] = {
    "light-quiet": ("--template", "light", "--packages", "24", "--steps", "2",
                    "--tokens-per-step", "32"),
    "light-neighbour-cpu": ("--template", "light", "--packages", "24", "--steps", "2",
                            "--tokens-per-step", "32",
                            "--neighbour", "cpu", "--neighbour-schedule", "random:5-15"),
    # the heavy template's 8K-token prefix and 300-token tool results, as in docs/gate.md
    "heavy-quiet": ("--template", "heavy", "--packages", "8", "--steps", "2",
                    "--tokens-per-step", "32"),
}
QUICK = ("--template", "light", "--packages", "6", "--steps", "1", "--tokens-per-step", "16")
METRICS = ("wall_s", "p50_delivery_s", "windows_under_floor", "agg_tps")


def run_one(root: Path, name: str, args: Sequence[str], seed: int, model: str,
            policies: Sequence[str], floor: float) -> Path:
    """One comparison (every policy, one seed) unless its folder already has one."""
    out = root / f"{name}-s{seed}"
    if (out / "compare.json").exists():
        return out
    cmd = [sys.executable, "-m", "mesh", "simulate", "--model", model, *args,
           "--floor-tps", f"{floor:g}", "--seed", str(seed),
           f"--serve-arg=--prefix-cache={Path(tempfile.gettempdir()) / 'mesh-gate-clock-pc'}",
           "--compare", "policy=" + ",".join(policies), "--no-progress", "--out", str(out)]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    return out


def _phase_windows(run: dict[str, Any]) -> dict[str, float | None]:
    phases = run.get("phases", {})
    out: dict[str, float | None] = {}
    for state in ("off", "on"):
        row = phases.get(state)
        out[state] = row.get("windows_under_floor") if isinstance(row, dict) else None
    return out


def _package_tokens(folder: Path, report: str) -> list[int]:
    """Tokens generated per delivered package, from one policy's report (``.json`` as
    written, or ``.json.gz`` as committed)."""
    path = folder / report
    gz = path.with_name(path.name + ".gz")
    if path.exists():
        doc = json.loads(path.read_text(encoding="utf-8"))
    elif gz.exists():
        doc = json.loads(gzip.decompress(gz.read_bytes()))
    else:
        return []
    return [t["num_generated"] for t in doc.get("tasks", []) if t.get("state") == "completed"]


def order_bound(tokens: Sequence[int], rate: float) -> float | None:
    """The earliest p50 delivery any order of these packages reaches at ``rate`` aggregate
    tokens/s, all submitted at once: the i-th delivery comes no sooner than the i smallest
    packages' tokens over the rate (shortest first is the best order)."""
    if not tokens or rate <= 0:
        return None
    done, cum = [], 0
    for n in sorted(tokens):
        cum += n
        done.append(cum / rate)
    return statistics.median(done)


def read(folder: Path) -> dict[str, dict[str, Any]]:
    """Per policy label: the run's summary figures, its ratios to legacy in the same run,
    its windows under the floor per neighbour phase, and the order bound: the p50 delivery
    no order reaches at the best aggregate rate of any policy in this run."""
    doc = json.loads((folder / "compare.json").read_text(encoding="utf-8"))
    runs = {r["label"].split("=", 1)[1]: r for r in doc["runs"]}
    legacy = runs.get("legacy", {}).get("summary", {})
    best_rate = max((r["summary"].get("agg_tps") or 0.0) for r in runs.values())
    out: dict[str, dict[str, Any]] = {}
    for policy, r in runs.items():
        s = r["summary"]
        row: dict[str, Any] = {m: s.get(m) for m in METRICS}
        row["mean_running"] = r.get("phases", {}).get("all", {}).get("mean_running")
        for m in ("wall_s", "p50_delivery_s"):
            base = legacy.get(m)
            row[f"{m}_vs_legacy"] = (s[m] / base) if base and s.get(m) is not None else None
        row["windows_by_phase"] = _phase_windows(r)
        bound = order_bound(_package_tokens(folder, r.get("report", "")), best_rate)
        row["p50_bound_s"] = bound
        row["p50_bound_vs_legacy"] = (bound / legacy["p50_delivery_s"]
                                      if bound and legacy.get("p50_delivery_s") else None)
        out[policy] = row
    return out


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def summarize(root: Path) -> dict[str, Any]:
    """Median and spread over the seeds, per scenario and policy."""
    table: dict[str, dict[str, Any]] = {}
    for folder in sorted(p for p in root.iterdir() if (p / "compare.json").exists()):
        name = folder.name.rsplit("-s", 1)[0]
        for policy, row in read(folder).items():
            cell = table.setdefault(name, {}).setdefault(policy, {"runs": []})
            cell["runs"].append({"folder": folder.name, **row})
    for policies in table.values():
        for cell in policies.values():
            runs = cell["runs"]
            for key in ("wall_s", "p50_delivery_s", "wall_s_vs_legacy",
                        "p50_delivery_s_vs_legacy", "windows_under_floor", "agg_tps",
                        "mean_running", "p50_bound_vs_legacy"):
                cell[key] = _spread([r[key] for r in runs if r.get(key) is not None])
            for state in ("off", "on"):
                cell[f"windows_{state}"] = _spread(
                    [r["windows_by_phase"][state] for r in runs
                     if r["windows_by_phase"].get(state) is not None])
    return table


def _fmt(cell: dict[str, float] | None, pct: bool = False, digits: int = 2) -> str:
    if cell is None:
        return "–"
    def f(v: float) -> str:
        return f"{100 * v:.1f} %" if pct else f"{v:.{digits}f}"

    if cell["n"] == 1:
        return f(cell["median"])
    return f"{f(cell['median'])} ({f(cell['min'])}–{f(cell['max'])})"


def markdown(table: dict[str, Any]) -> str:
    lines = ["# The floor gate on the user's clock", "",
             "Median over seeds (min–max); ratios are to `legacy` in the same run. "
             "Order bound: the p50 delivery no order of the run's packages reaches at the "
             "best aggregate tokens/s of any policy in that run (shortest first), over "
             "legacy's p50.", ""]
    for name, policies in table.items():
        lines += [f"## {name}", "",
                  "| policy | seeds | wall / legacy | p50 delivery / legacy | wall s | "
                  "p50 s | windows < floor | off / on phase | running turns | agg tok/s | "
                  "order bound / legacy |",
                  "|---|---:|---|---|---|---|---|---|---|---|---|"]
        for policy, c in policies.items():
            phase = (f"{_fmt(c['windows_off'], True)} / {_fmt(c['windows_on'], True)}"
                     if c["windows_on"] else "–")
            lines.append(
                f"| {policy} | {len(c['runs'])} | {_fmt(c['wall_s_vs_legacy'])} | "
                f"{_fmt(c['p50_delivery_s_vs_legacy'])} | {_fmt(c['wall_s'], digits=1)} | "
                f"{_fmt(c['p50_delivery_s'], digits=1)} | "
                f"{_fmt(c['windows_under_floor'], True)} | {phase} | "
                f"{_fmt(c['mean_running'])} | {_fmt(c['agg_tps'], digits=1)} | "
                f"{_fmt(c['p50_bound_vs_legacy'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=ROOT)
    p.add_argument("--scenarios", default="light-quiet,light-neighbour-cpu")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--model", default="smollm2")
    p.add_argument("--floor-tps", type=float, default=FLOOR,
                   help=f"the floor of every run (default {FLOOR:g}: the sweep's sweet spot)")
    p.add_argument("--summarize-only", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="one small light scenario, one seed (what the test suite runs)")
    p.add_argument("--out", type=Path, default=None, help="summary JSON (default: ROOT)")
    args = p.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    policies = args.policies.split(",")
    if not args.summarize_only:
        if args.quick:
            run_one(args.root, "quick", QUICK, 1, args.model, policies, args.floor_tps)
        else:
            for name in args.scenarios.split(","):
                for seed in (int(s) for s in args.seeds.split(",")):
                    run_one(args.root, name, SCENARIOS[name], seed, args.model, policies,
                            args.floor_tps)
    table = summarize(args.root)
    md = markdown(table)
    print(md)
    out = args.out or args.root / "summary.json"
    out.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(md + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
