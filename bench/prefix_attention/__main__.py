"""Where the step goes: one decode step's time against the shared prefix (issue 32, item 1).

    .venv/bin/python -m bench.prefix_attention            # full run (an hour or more)
    .venv/bin/python -m bench.prefix_attention --quick    # a smoke in seconds

Set up as mesh's pool does (one unified KV cache, through the adapter
:mod:`mesh.engine.llama`): the prefix is decoded once in sequence 0 and shared with
``seq_cp`` to every row's sequence; each row then holds a short private suffix of ``S``
tokens; then one token per row is decoded per step and the median step is taken. The grid:
prefix ``P`` (SmolLM2: 1K, 2K, 4K, 8K; a synthetic SmolLM2-shaped model with a 32K trained
context, random weights, for 8K, 16K, 32K — 8K bridges the two), decoding rows ``R`` (1, 4, 8,
16, 32), flash attention on and off, f16 and q8_0 KV (a quantized V cache needs flash
attention: q8_0 without it is recorded ``n/a``).

Reported (JSON and a table):

* per point: step ms, ms per row, cells in use, masked cells per row — the other rows'
  suffix cells each row's attention reads and masks out (one unified cache: llama.cpp
  attends over the whole used range);
* per (model, KV, FA, R): the prefix term, a least-squares line of step ms over P: its slope
  in ms per 1K prefix tokens, the same per row (µs per row per 1K), and its share of each
  point's step; per (model, KV, FA) that slope as a line over R: the part paid once per
  step (K/V read once) and the part each row pays — the gate model's ``f`` and ``c + e``;
* the masked-cell cost: at the smallest P each R is also run with a longer suffix; the step
  grows by the rows' own new cells (priced at the prefix slope) plus masked ones, so the
  cost of a masked cell relative to a prefix cell is measured (1.0: no skipping);
* per (model, KV, P, R) the best path (FA on or off, whichever is faster) and what a
  shared-prefix ("cascade") kernel could gain over it: ``masked`` removes the masked-cell
  work only; ``ideal`` also runs the rows × prefix attention at the FLOP rate the weights'
  matrix products reach in the same step (a bound: K/V read once, nothing re-read).

Results go to ``bench/prefix_attention/results/prefix_attention.json`` (``--quick``:
``prefix_attention_quick.json`` in a temporary folder, ``QUICK_OUT``, never over a result;
or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mesh.engine.interface import ModelError
from mesh.engine.llama import Batch, LlamaContext, LlamaModel
from mesh.engine.models import resolve_model
from mesh.sim.geometry import Geometry, write_geometry_model

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "prefix_attention.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "prefix_attention_quick.json"
QUICK: dict[str, Any] = {"model": "tiny", "prefixes": "128,256,512", "long_prefixes": "512,1024",
                         "rows": "1,4,8", "suffix": 16, "probe_suffix": 48, "steps": 3}

# SmolLM2-135M's geometry (30 layers, 9 heads, 3 KV heads of 64) with a 32K trained context:
# the real GGUF declares 8,192, so longer prefixes need this random-weight twin.
SMOLLM2_LONG = Geometry("smollm2-135m-long", "llama", n_layer=30, n_embd=576, n_head=9,
                        n_head_kv=3, head_dim=64, n_ff=1536, n_vocab=49152,
                        n_ctx_train=32768, rope_theta=100000.0, rms_eps=1e-5,
                        tied_output=True)
PREFILL_CHUNK = 512


# ---------------------------------------------------------------------------- the math
# Pure functions of the measured points (tested without a model).


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares ``y = intercept + slope·x``: (intercept, slope, r²). One distinct x:
    slope 0 and the mean; r² is 1.0 when the ys do not vary."""
    n = len(xs)
    if n == 0 or n != len(ys):
        raise ValueError(f"fit_line needs as many ys as xs, at least one ({n}, {len(ys)})")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0, 1.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return intercept, slope, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


def masked_cells_per_row(rows: int, suffix: int) -> int:
    """Cells one row's attention reads and masks: every other row's private suffix."""
    return max(rows - 1, 0) * suffix


def attention_flops(rows: int, cells: int, n_layer: int, n_head: int, head_dim: int) -> float:
    """FLOPs of ``rows`` queries attending over ``cells`` cells in every layer: q·k and
    p·v, two multiply-adds per head element each (softmax not counted)."""
    return 4.0 * rows * cells * n_layer * n_head * head_dim


def masked_cell_ratio(step_short_ms: float, step_long_ms: float, rows: int, extra: int,
                      slope_ms_per_1k: float) -> float | None:
    """Cost of a masked cell relative to a prefix cell, from one R run with suffix S and
    S + ``extra``: the step grew by ``rows × extra`` own cells (each read by one row) and
    ``rows·(rows-1)·extra`` masked row-cells; a prefix cell (read by all rows) costs
    ``slope/1000`` ms, so one row-cell ``slope/(1000·rows)``. None when unmeasurable."""
    if rows < 2 or extra <= 0 or slope_ms_per_1k <= 0:
        return None
    per_row_cell = slope_ms_per_1k / 1000.0 / rows
    own = per_row_cell * rows * extra
    masked = (step_long_ms - step_short_ms - own) / (rows * (rows - 1) * extra)
    return masked / per_row_cell


def analyse(points: Sequence[dict[str, Any]], suffix: int) -> dict[str, Any]:
    """Fits, masked-cell ratios and the best path with a shared-prefix estimate, from the
    measured ``points`` (see :func:`measure`); ``suffix`` is the base suffix S (points with
    another suffix are the masked-cell probes)."""
    ok = [p for p in points if p.get("step_ms") is not None]
    groups: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for p in ok:
        if p["suffix"] == suffix:
            groups.setdefault((p["model"], p["kv"], p["fa"], p["rows"]), []).append(p)
    fits: list[dict[str, Any]] = []
    slopes: dict[tuple[str, str, str, int], float] = {}
    for (model, kv, fa, rows), pts in sorted(groups.items()):
        pts.sort(key=lambda p: p["prefix"])
        b0, b1, r2 = fit_line([p["prefix"] / 1000 for p in pts], [p["step_ms"] for p in pts])
        slopes[(model, kv, fa, rows)] = b1
        for p in pts:  # a noisy fit (negative slope, step below the line) is clamped
            t = p["step_ms"]
            p["prefix_ms"] = min(max(b1 * p["prefix"] / 1000, 0.0), t)
            p["prefix_share"] = p["prefix_ms"] / t
            p["masked_ms"] = min(max(b1 * p["masked_cells_per_row"] / 1000, 0.0),
                                 t - p["prefix_ms"])
        fits.append({"model": model, "kv": kv, "fa": fa, "rows": rows,
                     "intercept_ms": b0, "ms_per_1k_prefix": b1,
                     "us_per_row_per_1k": 1000 * b1 / rows, "r2": r2,
                     "prefixes": [p["prefix"] for p in pts]})
    probes = []
    for p in ok:
        if p["suffix"] == suffix:
            continue
        key = (p["model"], p["kv"], p["fa"], p["rows"])
        base = [q for q in groups.get(key, []) if q["prefix"] == p["prefix"]]
        if not base or key not in slopes:
            continue
        ratio = masked_cell_ratio(base[0]["step_ms"], p["step_ms"], p["rows"],
                                  p["suffix"] - suffix, slopes[key])
        probes.append({"model": p["model"], "kv": p["kv"], "fa": p["fa"], "rows": p["rows"],
                       "prefix": p["prefix"], "suffix": suffix, "long_suffix": p["suffix"],
                       "masked_cell_ratio": ratio})
    r2s = {(f["model"], f["kv"], f["fa"], f["rows"]): f["r2"] for f in fits}
    return {"fits": fits, "split": _split(fits), "masked_probes": probes,
            "best": _best_paths(groups, r2s)}


def _split(fits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prefix slope over rows, ``ms_per_1k(R) = per_step + per_row·R``: the part paid
    once per step (K/V read once: the gate model's ``f``) and the part every row pays
    (``c + e``), in ms per 1K prefix cells."""
    by: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for f in fits:
        by.setdefault((f["model"], f["kv"], f["fa"]), []).append(f)
    out = []
    for (model, kv, fa), fs in sorted(by.items()):
        per_step, per_row, r2 = fit_line([f["rows"] for f in fs],
                                         [f["ms_per_1k_prefix"] for f in fs])
        out.append({"model": model, "kv": kv, "fa": fa, "per_step_ms_per_1k": per_step,
                    "per_row_ms_per_1k": per_row, "r2": r2,
                    "gate_f_s": per_step / 1e6, "gate_e_s": per_row / 1e6})
    return out


def _best_paths(groups: dict[tuple[str, str, str, int], list[dict[str, Any]]],
                r2s: dict[tuple[str, str, str, int], float]) -> list[dict[str, Any]]:
    """Per (model, KV, P, R): the faster FA mode and a shared-prefix kernel's possible gain
    over it (``fit_ok``: the prefix line explains at least 90 % of the variance)."""
    by_point: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for pts in groups.values():
        for p in pts:
            by_point.setdefault((p["model"], p["kv"], p["prefix"], p["rows"]), []).append(p)
    out = []
    for (model, kv, prefix, rows), pts in sorted(by_point.items()):
        best = min(pts, key=lambda p: p["step_ms"])
        t = best["step_ms"]
        after_masked = max(t - best["masked_ms"], 1e-9)
        attention = best["prefix_ms"] + best["masked_ms"]
        # Never claim less than removing the masked work alone.
        ideal = min(max(t - attention + best["flops_floor_ms"], 1e-9), after_masked)
        out.append({"model": model, "kv": kv, "prefix": prefix, "rows": rows,
                    "best_fa": best["fa"], "step_ms": t,
                    "fa_on_vs_off": _ratio(pts, "on", "off"),
                    "prefix_share": best["prefix_share"], "masked_ms": best["masked_ms"],
                    "flops_floor_ms": best["flops_floor_ms"],
                    "gain_masked": t / after_masked, "gain_ideal": t / ideal,
                    "fit_ok": r2s[(model, kv, best["fa"], rows)] >= 0.9})
    return out


def _ratio(pts: list[dict[str, Any]], a: str, b: str) -> float | None:
    x = [p["step_ms"] for p in pts if p["fa"] == a]
    y = [p["step_ms"] for p in pts if p["fa"] == b]
    return x[0] / y[0] if x and y else None


# ---------------------------------------------------------------------------- measuring


@dataclasses.dataclass(frozen=True)
class Grid:
    prefixes: tuple[int, ...]
    rows: tuple[int, ...]
    suffix: int
    probe_suffix: int  # 0: no masked-cell probe
    fa: tuple[str, ...]
    kv: tuple[str, ...]
    steps: int
    threads: int


def _decode(ctx: LlamaContext, batch: Batch, what: str) -> float:
    t0 = time.perf_counter()
    rc = ctx.decode(batch)
    dt = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc} during {what}; a bigger n_ctx?")
    return dt


def _prefill(ctx: LlamaContext, batch: Batch, rows: list[tuple[int, int, list[int]]]) -> None:
    """Decode (seq, first pos, tokens) for each entry, in chunks; one output per chunk."""
    flat = [(tok, pos + i, seq) for seq, pos, toks in rows for i, tok in enumerate(toks)]
    for i in range(0, len(flat), batch.capacity):
        chunk = flat[i:i + batch.capacity]
        batch.clear()
        for j, (tok, pos, seq) in enumerate(chunk):
            batch.add(tok, pos, seq, j == len(chunk) - 1)
        _decode(ctx, batch, "prefill")


def _geometry(model: LlamaModel) -> tuple[int, int, int]:
    layers, _, head_k, _, _ = model.kv_shape()
    arch = model.meta("general.architecture") or ""
    heads = int(model.meta(f"{arch}.attention.head_count") or 1)
    return layers, heads, head_k


def measure(path: Path, label: str, grid: Grid, seed: int = 0) -> list[dict[str, Any]]:
    """Every point of ``grid`` on the model at ``path``: see the module docstring."""
    model = LlamaModel(path)
    try:
        return _measure(model, label, grid, seed)
    finally:
        model.close()


def _measure(model: LlamaModel, label: str, grid: Grid, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    p_max, r_max = max(grid.prefixes), max(grid.rows)
    s_max = max(grid.suffix, grid.probe_suffix)
    prefix = [rng.randrange(16, model.n_vocab) for _ in range(p_max)]
    suffixes = [[rng.randrange(16, model.n_vocab) for _ in range(s_max)] for _ in range(r_max)]
    step_tok = [rng.randrange(16, model.n_vocab) for _ in range(r_max)]
    n_ctx = p_max + r_max * (s_max + grid.steps + 2) + 256
    layers, heads, head_dim = _geometry(model)
    points: list[dict[str, Any]] = []
    for kv in grid.kv:
        for fa in grid.fa:
            try:
                ctx = LlamaContext(model, n_ctx=n_ctx, n_seq_max=r_max + 1,
                                   n_batch=PREFILL_CHUNK, n_outputs_max=r_max + 1,  # >= n_seq_max
                                   n_threads=grid.threads, swa_full=True, flash_attn=fa,
                                   kv_type=kv)
            except ModelError as exc:  # q8_0 V without flash attention
                print(f"... {label} kv={kv} fa={fa}: n/a ({exc})", file=sys.stderr)
                points += [_na(label, kv, fa, p, r, grid.suffix, str(exc))
                           for p in grid.prefixes for r in grid.rows]
                continue
            batch = Batch(max(PREFILL_CHUNK, r_max))
            try:
                # Prefilled once per context: llama.cpp stores V transposed without flash
                # attention, so a saved sequence does not restore across FA modes.
                t0 = time.perf_counter()
                _prefill(ctx, batch, [(0, 0, prefix)])
                print(f"... {label} kv={kv} fa={fa}: prefix {p_max} prefilled in "
                      f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
                for p in sorted(grid.prefixes, reverse=True):
                    ctx.seq_remove(0, p, -1)  # the shorter prefix is the longer one's head
                    for r in grid.rows:
                        lens = [grid.suffix] + ([grid.probe_suffix] if grid.probe_suffix
                                                and p == min(grid.prefixes) and r > 1 else [])
                        for s in lens:
                            ms = _one_point(ctx, batch, p, r, s, suffixes, step_tok,
                                            grid.steps)
                            rate_rows = r  # weights' FLOP rate: 2·params per row this step
                            points.append({
                                "model": label, "kv": kv, "fa": fa, "prefix": p, "rows": r,
                                "suffix": s, "step_ms": statistics.median(ms),
                                "steps_ms": [round(x, 3) for x in ms],
                                "ms_per_row": statistics.median(ms) / r,
                                "cells_used": p + r * s,
                                "masked_cells_per_row": masked_cells_per_row(r, s),
                                "attention_gflop": attention_flops(
                                    r, p, layers, heads, head_dim) / 1e9,
                                "weights_gflop": 2.0 * model.n_params * rate_rows / 1e9,
                            })
                            print(json.dumps(points[-1]), file=sys.stderr, flush=True)
            finally:
                batch.close()
                ctx.close()
    _flops_floor(points)
    return points


def _one_point(ctx: LlamaContext, batch: Batch, prefix: int, rows: int, suffix: int,
               suffixes: list[list[int]], step_tok: list[int], steps: int) -> list[float]:
    """Rows 1..``rows`` share the prefix, prefill their suffix, then ``steps`` timed decode
    steps of one token each (after one warm-up step); the rows are dropped afterwards."""
    for r in range(1, rows + 1):
        ctx.seq_copy(0, r)
    _prefill(ctx, batch, [(r + 1, prefix, suffixes[r][:suffix]) for r in range(rows)])
    times = []
    for t in range(steps + 1):
        batch.clear()
        for r in range(rows):
            batch.add(step_tok[r], prefix + suffix + t, r + 1, True)
        dt = _decode(ctx, batch, "a decode step")
        if t:
            times.append(dt * 1000)
    for r in range(1, rows + 1):
        ctx.seq_remove(r)
    return times


def _flops_floor(points: list[dict[str, Any]]) -> None:
    """Each point's attention at the FLOP rate the weights reached in the same model, KV
    and FA at the same rows and the smallest prefix (an under-estimate of the rate, so
    the floor is generous)."""
    ref: dict[tuple[str, str, str, int], float] = {}
    for p in sorted(points, key=lambda p: (-p["prefix"], -p["suffix"])):  # smallest last
        if p["step_ms"] is not None:
            ref[(p["model"], p["kv"], p["fa"], p["rows"])] = (
                p["weights_gflop"] / (p["step_ms"] / 1000))
    for p in points:
        rate = ref.get((p["model"], p["kv"], p["fa"], p["rows"]))
        if p["step_ms"] is not None and rate:
            p["gflops_weights"] = rate
            p["flops_floor_ms"] = 1000 * p["attention_gflop"] / rate


def _na(label: str, kv: str, fa: str, prefix: int, rows: int, suffix: int,
        why: str) -> dict[str, Any]:
    return {"model": label, "kv": kv, "fa": fa, "prefix": prefix, "rows": rows,
            "suffix": suffix, "step_ms": None, "na": why}


# ---------------------------------------------------------------------------- reporting


def table(points: Sequence[dict[str, Any]], result: dict[str, Any], suffix: int) -> str:
    head = (f"{'model':<22} {'kv':<5} {'fa':<3} {'P':>6} {'R':>3} {'step ms':>9} "
            f"{'ms/row':>8} {'prefix %':>8} {'masked ms':>9}")
    lines = [head, "-" * len(head)]
    for p in sorted(points, key=lambda p: (p["model"], p["kv"], p["fa"], p["rows"],
                                           p["prefix"])):
        if p["suffix"] != suffix:
            continue
        if p["step_ms"] is None:
            lines.append(f"{p['model']:<22} {p['kv']:<5} {p['fa']:<3} {p['prefix']:>6} "
                         f"{p['rows']:>3} {'n/a':>9}")
            continue
        lines.append(f"{p['model']:<22} {p['kv']:<5} {p['fa']:<3} {p['prefix']:>6} "
                     f"{p['rows']:>3} {p['step_ms']:>9.2f} {p['ms_per_row']:>8.2f} "
                     f"{100 * p.get('prefix_share', 0):>7.0f}% {p.get('masked_ms', 0):>9.2f}")
    lines += ["", "prefix term (least squares over P): ms per 1K prefix, µs per row per 1K"]
    for f in result["fits"]:
        lines.append(f"  {f['model']:<22} {f['kv']:<5} fa={f['fa']:<3} R={f['rows']:>2}: "
                     f"{f['ms_per_1k_prefix']:8.3f} ms/1K  {f['us_per_row_per_1k']:8.1f} "
                     f"µs/row/1K  (+{f['intercept_ms']:.1f} ms, r² {f['r2']:.3f})")
    lines += ["", "prefix slope over rows: once per step + per row (ms per 1K prefix cells)"]
    for sp in result["split"]:
        lines.append(f"  {sp['model']:<22} {sp['kv']:<5} fa={sp['fa']:<3}: "
                     f"{sp['per_step_ms_per_1k']:8.3f} + {sp['per_row_ms_per_1k']:8.3f}·R "
                     f"(r² {sp['r2']:.3f})")
    lines += ["", "masked-cell cost relative to a prefix cell (longer suffix, smallest P)"]
    for m in result["masked_probes"]:
        ratio = "n/a" if m["masked_cell_ratio"] is None else f"{m['masked_cell_ratio']:.2f}"
        lines.append(f"  {m['model']:<22} {m['kv']:<5} fa={m['fa']:<3} R={m['rows']:>2} "
                     f"S {m['suffix']}->{m['long_suffix']}: {ratio}")
    lines += ["", "best path and a shared-prefix kernel's possible gain over it"]
    for b in result["best"]:
        on_off = "-" if b["fa_on_vs_off"] is None else f"{b['fa_on_vs_off']:.2f}"
        lines.append(f"  {b['model']:<22} {b['kv']:<5} P={b['prefix']:>6} R={b['rows']:>2}: "
                     f"fa {b['best_fa']:<3} {b['step_ms']:8.2f} ms (on/off {on_off}), "
                     f"prefix {100 * b['prefix_share']:.0f}%, gain masked "
                     f"{b['gain_masked']:.2f}x, ideal {b['gain_ideal']:.2f}x"
                     + ("" if b["fit_ok"] else "  (noisy fit)"))
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="tiny, smollm2, gemma or a GGUF path")
    ap.add_argument("--prefixes", default="1024,2048,4096,8192")
    ap.add_argument("--long-prefixes", default="8192,16384,32768",
                    help="prefixes for the synthetic 32K SmolLM2 twin ('' skips it)")
    ap.add_argument("--rows", default="1,4,8,16,32")
    ap.add_argument("--suffix", type=int, default=64, help="private tokens per row S")
    ap.add_argument("--probe-suffix", type=int, default=256,
                    help="longer suffix run at the smallest P (masked-cell cost; 0: none)")
    ap.add_argument("--fa", default="on,off")
    ap.add_argument("--kv", default="f16,q8_0")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per point (median)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/mesh-prefix-bench"),
                    help="where the synthetic model is written")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="the tiny model and a 1/8 twin of "
                    "the long geometry, small P and R, 2 steps: seconds")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--label", default="", help="a name for this run, kept in the JSON's meta "
                    "(e.g. which llama.cpp library LLAMA_CPP_LIB_PATH selected)")
    a = ap.parse_args(argv)
    long_geometry = SMOLLM2_LONG
    if a.quick:  # the quick sizes become the defaults; flags given still win
        ap.set_defaults(**QUICK)
        a = ap.parse_args(argv)
        long_geometry = dataclasses.replace(SMOLLM2_LONG.scaled_down(8), n_ctx_train=4096)
    out = a.out or (QUICK_OUT if a.quick else DEFAULT_OUT)
    base = Grid(_ints(a.prefixes), _ints(a.rows), a.suffix, a.probe_suffix,
                tuple(a.fa.split(",")), tuple(a.kv.split(",")), a.steps, a.threads)
    resolved = resolve_model(a.model)
    legs = [(resolved.path, resolved.name, base)]
    if _ints(a.long_prefixes):
        a.work_dir.mkdir(parents=True, exist_ok=True)
        long_path = a.work_dir / f"{long_geometry.name.replace('/', '-')}.gguf"
        if not long_path.is_file():
            write_geometry_model(long_path, long_geometry, qtype="q4_0", seed=a.seed)
        legs.append((long_path, long_geometry.name,
                     dataclasses.replace(base, prefixes=_ints(a.long_prefixes))))
    t0 = time.monotonic()
    points: list[dict[str, Any]] = []
    for path, label, grid in legs:
        points += measure(Path(path), label, grid, a.seed)
    result = analyse(points, a.suffix)
    doc = {"meta": {"when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "machine": platform.machine(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "threads": a.threads,
                    "argv": sys.argv[1:] if argv is None else argv,
                    "label": a.label, "llama_cpp_lib_path": os.environ.get("LLAMA_CPP_LIB_PATH"),
                    "suffix": a.suffix, "probe_suffix": a.probe_suffix, "steps": a.steps,
                    "wall_s": round(time.monotonic() - t0, 1)},
           "points": points, **result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(points, result, a.suffix))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
