"""Per-phase figures of a run: neighbour off, neighbour on, and overall. Pure.

A run with a neighbour is cut into spans: "on" from each recorded start of the load to its
stop (:attr:`~mesh.sim.types.SimRun.neighbour_phases`), "off" in between, both clipped to
``[0, wall]``. Every observation is attributed to the phase it happened in:

* a ``/capacity`` sample by its time; a package by its *end* (its delivery time counts in
  the phase it was delivered in); a turn's start latency by the turn's start;
* client windows and tokens by the arrival of the text chunk that carried them.

**Client windows.** The coordinator streams each worker's text in chunks (coalesced every
``text_flush_s``, 50 ms); the harness stamps each chunk on arrival and counts its
characters. A turn generates a known number of tokens (a scenario step's
``tokens_per_step``) and a chunk is flushed on a token's arrival, so every chunk holds at
least one token; the turn's remaining tokens are shared among its chunks by characters.
When every token arrives in its own chunk (rates under ~20 tok/s at the 50 ms flush,
so near any floor below that) the count is exact; above, it is an estimate (the characters
of 8 tokens vary by a standard deviation of 36 %: SmolLM2's tokenizer on the README), but
there the window is far above such a floor. A window is the run of consecutive chunks of
one turn after the first that brings at least ``min_tokens`` tokens over at least
``min_span_s`` (so the stamps' jitter stays small against it); its tokens/s is those
tokens over the time from the chunk before it to its last chunk (the gap to a turn's first
chunk is the wait and the tool result's prefill, not a stall, and is left out — as
``bench/gate_bench.py`` does per token). Planned runs (turns of unknown length) have no
windows.

**Turn-start latency.** The decode gate's own wait where an event carries it
(``wait_s`` in the turn's event metadata, source ``gate``); otherwise, as the client sees
it, from the turn's ``turn_started`` event to its first text chunk (source ``client``: the
gate's wait plus the prefill of the tool result plus the first token, so an upper bound of
the wait). The mean number of waiting turns over the ``/capacity`` samples
(``turns.waiting``, from the decode gate) is reported beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mesh.sim.measure import cap_num as _cap_num
from mesh.sim.measure import floor_of, percentile, workers
from mesh.sim.types import PhaseRecord, SimRun, TaskTimeline

__all__ = [
    "PHASES",
    "PHASE_COLUMNS",
    "Span",
    "Window",
    "chunk_tokens",
    "client_windows",
    "figures_table",
    "phase_of",
    "phase_summary",
    "phase_table",
    "spans",
    "spans_from",
    "turn_starts",
]

PHASES = ("all", "off", "on")
MIN_WINDOW_TOKENS = 8
# A window also spans at least this long: chunk stamps carry the harness's own scheduling
# jitter (a few ms, more on a busy machine), which would make a 10 ms window's rate noise.
MIN_WINDOW_S = 0.25
_ENDS = ("completed", "failed", "rejected", "canceled", "input_required", "error")


@dataclass(frozen=True)
class Span:
    state: str  # "on" | "off"
    start: float
    end: float


@dataclass(frozen=True)
class Window:
    t: float  # the window's start (arrival of the chunk before it)
    tps: float


def spans(run: SimRun) -> list[Span]:
    """The run's on/off spans covering ``[0, wall]``; empty for a run with no neighbour."""
    if not run.config.neighbour.enabled:
        return []
    return spans_from(run.neighbour_phases, run.wall_s) or [Span("off", 0.0, run.wall_s)]


def spans_from(records: Sequence[PhaseRecord], wall_s: float) -> list[Span]:
    """On/off spans covering ``[0, wall]`` from the recorded "on" spans (empty for none)."""
    if not records:
        return []
    wall = max(wall_s, max(r.end for r in records))
    out: list[Span] = []
    t = 0.0
    for rec in sorted(records, key=lambda r: r.start):
        start, end = max(rec.start, t), min(max(rec.end, rec.start), wall)
        if start > t:
            out.append(Span("off", t, start))
        if end > start:
            out.append(Span("on", start, end))
        t = max(t, end)
    if wall > t:
        out.append(Span("off", t, wall))
    return out


def phase_of(phase_spans: Sequence[Span], t: float) -> str:
    """``on`` or ``off`` at ``t`` (``off`` outside every on span)."""
    return "on" if any(s.state == "on" and s.start <= t < s.end for s in phase_spans) else "off"


def _turn_groups(task: TaskTimeline) -> list[tuple[int, float, list[tuple[float, int]]]]:
    """``(turn, turn_started t, [(chunk t, chars)])`` per turn, in order; chunks outside a
    turn (planned coordinator sessions) form turn 0."""
    groups: list[tuple[int, float, list[tuple[float, int]]]] = []
    current: tuple[int, float, list[tuple[float, int]]] | None = None
    loose: list[tuple[float, int]] = []
    for e in task.events:
        if e.kind == "turn_started":
            current = (e.turn, e.t, [])
            groups.append(current)
        elif e.kind == "text" and e.chars > 0:
            (current[2] if current is not None else loose).append((e.t, e.chars))
        elif e.kind in ("tool_call", *_ENDS):
            current = None
    return ([(0, 0.0, loose)] if loose else []) + groups


def _estimate(chars: Sequence[int], tokens: float) -> list[float]:
    """Tokens per chunk of a turn (or task) of ``tokens`` tokens streamed in chunks of
    ``chars`` characters: every chunk holds at least one token (a chunk is flushed on a
    token's arrival), the rest are shared by characters. Exact when each token came in its
    own chunk (``tokens == len(chars)``: rates under ~1/``text_flush_s``)."""
    total = sum(chars)
    extra = tokens - len(chars)
    if extra < 0 or not total:  # fewer tokens than chunks: a short turn; by characters
        return [tokens * c / total for c in chars] if total else [0.0] * len(chars)
    return [1.0 + extra * c / total for c in chars]


def chunk_tokens(run: SimRun) -> list[tuple[float, float]]:
    """``(arrival t, estimated tokens)`` of every text chunk of the run (see the module
    docstring): per turn at ``tokens_per_step`` when the scenario is not planned, else per
    task at the tokens its answer reports."""
    planned = bool(run.scenario.get("plan", False))
    out: list[tuple[float, float]] = []
    for task in run.tasks:
        groups = _turn_groups(task)
        if planned or any(turn == 0 for turn, _, _ in groups):
            chunks = [c for _, _, cs in groups for c in cs]
            estimates = _estimate([c for _, c in chunks], task.num_generated)
            out += [(t, n) for (t, _), n in zip(chunks, estimates, strict=True)]
            continue
        for _, _, cs in groups:
            estimates = _estimate([c for _, c in cs], run.tokens_per_step)
            out += [(t, n) for (t, _), n in zip(cs, estimates, strict=True)]
    return out


def client_windows(run: SimRun, min_tokens: float = MIN_WINDOW_TOKENS,
                   min_span_s: float = MIN_WINDOW_S) -> list[Window]:
    """Every client window of the run (see the module docstring); none when planned."""
    if run.scenario.get("plan", False):
        return []
    out: list[Window] = []
    for task in run.tasks:
        # A pause of the decode gate is waiting, not decoding: no window spans one.
        pauses = [e.t for e in task.events if e.kind == "paused"]
        for turn, _, cs in _turn_groups(task):
            if turn == 0 or len(cs) < 2:
                continue
            estimates = _estimate([c for _, c in cs], run.tokens_per_step)
            a, tokens = 0, 0.0
            for b in range(1, len(cs)):
                if any(cs[b - 1][0] < p <= cs[b][0] for p in pauses):
                    a, tokens = b, 0.0
                    continue
                tokens += estimates[b]
                span = cs[b][0] - cs[a][0]
                if tokens >= min_tokens and span >= min_span_s:
                    out.append(Window(cs[a][0], tokens / span))
                    a, tokens = b, 0.0
    return out


def turn_starts(run: SimRun) -> tuple[list[tuple[float, float]], str]:
    """``([(turn start t, latency s)], source)``: the gate's ``wait_s`` where the events
    carry it (source ``gate``), else turn start → first text chunk (source ``client``; not
    for planned runs, whose subtasks' chunks interleave in one stream)."""
    gate: dict[tuple[int, str, int], tuple[float, float]] = {}
    client: list[tuple[float, float]] = []
    planned = bool(run.scenario.get("plan", False))
    for task in run.tasks:
        started: dict[tuple[str, int], float] = {}
        for e in task.events:
            key = (e.subtask, e.turn)
            if e.kind == "turn_started":
                started[key] = e.t
            if e.wait_s is not None and key in started:
                gate[(task.package, *key)] = (started[key], e.wait_s)
        if not planned:
            client += [(t0, cs[0][0] - t0) for turn, t0, cs in _turn_groups(task)
                       if turn and cs]
    return (sorted(gate.values()), "gate") if gate else (client, "client")


def _share(values: Sequence[float], below: float | None) -> float | None:
    if not values or below is None:
        return None
    return round(sum(v < below for v in values) / len(values), 4)


def _r(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def phase_summary(run: SimRun, min_tokens: float = MIN_WINDOW_TOKENS) -> dict[str, Any]:
    """``{"spans": [...], "turn_start_source": ..., "all"|"off"|"on": figures}`` (``off``
    and ``on`` only for a run with a neighbour). Figures: see :data:`PHASE_COLUMNS`."""
    cut = spans(run)
    floor = floor_of(run)
    windows = client_windows(run, min_tokens)
    starts, source = turn_starts(run)
    tokens = chunk_tokens(run)
    out: dict[str, Any] = {
        "spans": [{"state": s.state, "start": s.start, "end": s.end} for s in cut],
        "turn_start_source": source,
        "min_window_tokens": min_tokens,
        "min_window_s": MIN_WINDOW_S,
    }
    for phase in PHASES if cut else ("all",):

        def inside(t: float, phase: str = phase) -> bool:
            return phase == "all" or phase_of(cut, t) == phase

        time_s = run.wall_s if phase == "all" else sum(
            s.end - s.start for s in cut if s.state == phase)
        delivery = [d for t in run.tasks
                    if (d := t.delivery_s) is not None and t.done_t is not None
                    and inside(t.done_t)]
        tps = [w.tps for w in windows if inside(w.t)]
        lat = [s for t, s in starts if inside(t)]
        samples = [s for s in run.samples if inside(s.t)]
        counts = [workers(s) for s in samples]
        running = [v for s in samples if (v := _cap_num(s.capacity, "turns", "running"))
                   is not None]
        waiting = [v for s in samples if (v := _cap_num(s.capacity, "turns", "waiting"))
                   is not None]
        slowest = [v for s in samples
                   if (_cap_num(s.capacity, "sessions", "decoding") or 0)
                   + (_cap_num(s.capacity, "sessions", "prefilling") or 0)
                   and (v := _cap_num(s.capacity, "measured_tps", "min")) is not None]
        generated = sum(n for t, n in tokens if inside(t))
        out[phase] = {
            "time_s": round(time_s, 3),
            "delivered": len(delivery),
            "p50_delivery_s": _r(percentile(delivery, 50)),
            "p95_delivery_s": _r(percentile(delivery, 95)),
            "turn_start_p50_s": _r(percentile(lat, 50)),
            "turn_start_p95_s": _r(percentile(lat, 95)),
            "turns": len(lat),
            "windows": len(tps),
            "windows_under_floor": _share(tps, floor),
            "windows_under_half_floor": _share(tps, None if floor is None else floor / 2),
            "samples_under_floor": _share(slowest, floor),
            "agg_tps": round(generated / time_s, 3) if time_s > 0 else None,
            "mean_workers": _r(sum(counts) / len(counts), 3) if counts else None,
            "max_workers": max(counts, default=None),
            "mean_running": _r(sum(running) / len(running), 3) if running else None,
            "mean_waiting": _r(sum(waiting) / len(waiting), 3) if waiting else None,
        }
    return out


# (key, column heading, kind) of the per-phase table; kind: share, s, num, int.
PHASE_COLUMNS = (
    ("time_s", "time (s)", "num"),
    ("delivered", "delivered", "int"),
    ("p50_delivery_s", "p50 delivery (s)", "num"),
    ("p95_delivery_s", "p95 delivery (s)", "num"),
    ("turn_start_p50_s", "turn start p50 (s)", "s"),
    ("turn_start_p95_s", "turn start p95 (s)", "s"),
    ("windows_under_floor", "windows < floor", "share"),
    ("windows_under_half_floor", "windows < floor/2", "share"),
    ("samples_under_floor", "samples < floor", "share"),
    ("agg_tps", "agg tok/s", "num"),
    ("mean_workers", "workers mean", "num"),
    ("max_workers", "workers max", "int"),
    ("mean_running", "running turns", "num"),
    ("mean_waiting", "waiting turns", "num"),
)


def _fmt(kind: str, value: Any) -> str:
    if value is None:
        return "–"
    if kind == "share":
        return f"{100 * float(value):.1f} %"
    if kind == "s":
        return f"{float(value):.3f}"
    if kind == "int":
        return str(int(value))
    return f"{float(value):.2f}"


def figures_table(rows: Sequence[tuple[str, Mapping[str, Any] | None]],
                  first: str = "run") -> str:
    """A Markdown table: one row per ``(label, figures)`` (one phase's figures of
    :func:`phase_summary`), one column per :data:`PHASE_COLUMNS` entry (None: dashes)."""
    head = f"| {first} | " + " | ".join(h for _, h, _ in PHASE_COLUMNS) + " |"
    rule = "|---|" + "---:|" * len(PHASE_COLUMNS)
    lines = [head, rule]
    for label, figures in rows:
        lines.append(f"| {label} | " + " | ".join(
            _fmt(kind, (figures or {}).get(key)) for key, _, kind in PHASE_COLUMNS) + " |")
    return "\n".join(lines)


def phase_table(rows: Sequence[tuple[str, Mapping[str, Any]]], phase: str) -> str:
    """The table of one ``phase`` over runs: ``rows`` are ``(label, phase_summary)``."""
    return figures_table([(label, summary.get(phase)) for label, summary in rows])
