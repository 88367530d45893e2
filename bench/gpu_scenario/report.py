"""The GPU scenario's JSON (written row by row) and the markdown table made from it.

    python -m bench.gpu_scenario.report bench/gpu_scenario/results/gpu/gpu_scenario.json

Every row is a flat dict with ``section`` (``build``, ``capacity``, ``ttft``, ``decode``),
``system`` (``mesh``, ``mesh naive``, ``llama-server``) and ``P`` (prefix tokens). The
file is rewritten atomically after each row, so a run killed by its time budget keeps
every row that finished.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["Report", "table"]


class Report:
    """``meta`` plus ``rows``, on disk after every :meth:`add` (and its markdown table)."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"meta": meta, "rows": []}
        self.flush()

    def add(self, row: dict[str, Any]) -> None:
        self.doc["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        self.flush()

    def flush(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.path, json.dumps(self.doc, indent=1) + "\n")
        _atomic_write(self.path.with_suffix(".md"), table(self.doc))


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes it 0600
    os.replace(tmp, path)


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _rows(doc: dict[str, Any], section: str) -> list[dict[str, Any]]:
    return [r for r in doc["rows"] if r.get("section") == section]


def table(doc: dict[str, Any]) -> str:
    """The markdown report: setup, capacity, new-agent TTFT, tool-loop decode."""
    m = doc["meta"]
    out = [f"# GPU scenario: {m.get('geometry', '?')} ({m.get('weights', '?')} weights), "
           f"{m.get('kv_type', '?')} KV, budget {_fmt(m.get('kv_budget'))} cells",
           "", f"- device: {m.get('device', '?')}", f"- model: `{m.get('model', '?')}`",
           f"- started {m.get('started', '?')}; dry run: {_fmt(m.get('dry_run'))}",
           f"- llama-server: `{m.get('llama_server_args') or 'not run'}`", ""]
    if m.get("notes"):
        out += [f"- {n}" for n in m["notes"]] + [""]
    build = _rows(doc, "build")
    if build:
        out += ["## Building the shared prefix", "",
                "| system | P | prefix prefill s | prefill tok/s | start s (load + prefill) |",
                "|---|---|---|---|---|"]
        out += [f"| {r['system']} | {_fmt(r['P'])} | {_fmt(r.get('prefill_s'))} | "
                f"{_fmt(r.get('prefill_tps'), 0)} | {_fmt(r.get('start_s'))} |" for r in build]
        out.append("")
    cap = _rows(doc, "capacity")
    if cap:
        out += ["## Agents that fit", "",
                "| system | P | S per agent | KV cells | agents | how |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['system']} | {_fmt(r['P'])} | {_fmt(r['S'])} | {_fmt(r['kv_cells'])} | "
                f"**{_fmt(r['agents'])}** | {r.get('how', '')} |" for r in cap]
        out.append("")
    ttft = _rows(doc, "ttft")
    if ttft:
        out += ["## Time to first token of a new agent", "",
                "| system | P | case | TTFT s (median) | runs | prompt tokens processed |",
                "|---|---|---|---|---|---|"]
        out += [f"| {r['system']} | {_fmt(r['P'])} | {r['case']} | {_fmt(r.get('ttft_s'), 3)} | "
                f"{_fmt(r.get('runs'))} | {_fmt(r.get('prompt_n'))} |" for r in ttft]
        out.append("")
    dec = _rows(doc, "decode")
    if dec:
        out += ["## Agents in tool loops (turns of: tool result in, G tokens out)", "",
                "| system | P | N | private S | turns x G | per-agent tok/s | decode tok/s "
                "per agent | aggregate tok/s | wall s | prompt tok processed (turns / "
                "warm-up) | note |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['system']} | {_fmt(r['P'])} | {_fmt(r['N'])} | {_fmt(r.get('S'))} | "
                f"{_fmt(r.get('turns'))} x {_fmt(r.get('G'))} | {_fmt(r.get('agent_tps'))} | "
                f"{_fmt(r.get('decode_tps'))} | {_fmt(r.get('aggregate_tps'))} | "
                f"{_fmt(r.get('wall_s'))} | {_fmt(r.get('prompt_n'))} / "
                f"{_fmt(r.get('warmup_prompt_n'))} | {r.get('note', '')} |" for r in dec]
        out.append("")
    out += goals(doc)
    errors = [r for r in doc["rows"] if r.get("error")]
    if errors:
        out += ["## Rows that did not finish", ""]
        out += [f"- {r.get('section')} {r.get('system')} P={r.get('P')}: {r['error']}"
                for r in errors]
        out.append("")
    return "\n".join(out)


def _one(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()) and not r.get("error"):
            return r
    return None


def goals(doc: dict[str, Any]) -> list[str]:
    """The issue's goals, per prefix: capacity >= 1.75x, new-agent TTFT >= 50x better
    than a cold llama-server slot, per-agent tokens/s not below llama-server's at equal N."""
    rows = doc["rows"]
    out: list[str] = []
    for P in sorted({r["P"] for r in rows if "P" in r}):
        cap = {r["system"]: r["agents"] for r in rows
               if r.get("section") == "capacity" and r["P"] == P and "agents" in r}
        mesh_t = _one(rows, section="ttft", system="mesh", P=P,
                      case="new agent, prefix decoded")
        cold = _one(rows, section="ttft", system="llama-server", P=P,
                    case="cold slot (prefix not decoded)")
        line = [f"- P = {P:,}:"]
        if "mesh" in cap:
            base = cap.get("llama-server", cap.get("mesh naive"))
            ratio = f" = {cap['mesh'] / base:.2f}x (goal 1.75x)" if base else ""
            line.append(f"agents that fit {cap['mesh']} vs {base}{ratio};")
        if mesh_t and cold and mesh_t.get("ttft_s"):
            line.append(f"new-agent TTFT {cold['ttft_s']:.3f} s (cold llama-server slot) / "
                        f"{mesh_t['ttft_s']:.4f} s (mesh) = "
                        f"{cold['ttft_s'] / mesh_t['ttft_s']:.0f}x (goal 50x);")
        pairs = []
        for r in rows:
            if r.get("section") == "decode" and r.get("system") == "mesh" and r["P"] == P:
                other = _one(rows, section="decode", system="llama-server", P=P, N=r["N"],
                             S=r.get("S"))
                if other and r.get("agent_tps") and other.get("agent_tps"):
                    pairs.append(f"N={r['N']} {r['agent_tps'] / other['agent_tps']:.2f}x")
        if pairs:
            line.append("per-agent tok/s mesh / llama-server: " + ", ".join(pairs))
        out.append(" ".join(line))
    return ["## Against the goals", "", *out, ""] if out else []


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.gpu_scenario.report RESULTS.json", file=sys.stderr)
        return 2
    print(table(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
