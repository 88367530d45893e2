"""The pure decision: tables of cases per policy, and hypothesis properties."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mesh.engine.interface import PoolLoad, SessionLoad, SessionState
from mesh.gate.config import GateConfig
from mesh.gate.decide import GateInput, Verdict, WorkerRule, count_quantile, decide
from mesh.gate.model import StepCost, ThroughputModel
from tests.gate.rules import config_and_rule

# Without context cost a step takes 10 ms + 20 ms per decoding session:
# 1 → 33.3 tok/s, 2 → 20, 3 → 14.3, 4 → 11.1, 5 → 9.1.
LINEAR = StepCost(a=0.010, b=0.020, c=0.0, d=0.0)
S = SessionState


def model_of(cost: StepCost = LINEAR) -> ThroughputModel:
    return ThroughputModel(prior=cost)  # no samples: the fit is the prior exactly


def session(
    i: int,
    state: SessionState = S.DECODING,
    ctx: int = 1000,
    tps: float | None = None,
    duty: float | None = None,
    age: float = 10.0,
) -> SessionLoad:
    return SessionLoad(
        id=f"s{i}",
        state=state,
        private_cells=ctx - 900,
        context_len=ctx,
        decode_tps=tps,
        duty_cycle=duty,
        age_s=age,
        num_generated=0,
    )


def pool(sessions: list[SessionLoad], max_sessions: int = 8, free: int | None = None) -> PoolLoad:
    private = sum(s.private_cells for s in sessions)
    return PoolLoad(
        taken_at=0.0,
        sessions=tuple(sessions),
        step_ms=None,
        agg_tps=0.0,
        cells_used=900 + private,
        cells_total=900 + max_sessions * 2048,
        prefix_cells=900,
        naive_cells=private + 900 * len(sessions),
        free_seq_ids=max_sessions - len(sessions) if free is None else free,
        max_sessions=max_sessions,
        session_budget=2048,
    )


def decoding(n: int, **kw: Any) -> list[SessionLoad]:
    return [session(i, **kw) for i in range(n)]


def gate_input(sessions: list[SessionLoad], **kw: Any) -> GateInput:
    max_sessions = kw.pop("max_sessions", 8)
    free = kw.pop("free", None)
    kw.setdefault("num_tickets", len(sessions))
    return GateInput(load=pool(sessions, max_sessions, free), **kw)


def run(inp: GateInput, policy: str = "projection", cost: StepCost = LINEAR, **cfg: Any) -> Any:
    cfg.setdefault("floor_tps", 10.0)
    cfg.setdefault("new_worker_cells", 100)
    config, rule = config_and_rule(policy, **cfg)
    return decide(inp, config, model_of(cost), 42.0, rule)


# ---------------------------------------------------------------- tables

FLOOR_CASES = [
    # (name, input, config overrides, verdict, headroom)
    ("empty pool", gate_input([]), {}, Verdict.ADMIT, 4),
    ("three decoding", gate_input(decoding(3)), {}, Verdict.ADMIT, 1),
    ("four decoding", gate_input(decoding(4)), {}, Verdict.WAIT, 0),
    # Six workers at duty 0.2: in 90 % of steps at most 2 others decode alongside one.
    ("idle gaps are capacity", gate_input(decoding(6, duty=0.2)), {}, Verdict.ADMIT, 1),
    (
        "idle estimate off",
        gate_input(decoding(6, duty=0.2)),
        {"use_idle_estimate": False},
        Verdict.WAIT,
        0,
    ),
    # Four at duty 0.5: three others collide in 12.5 % of steps, more than 10 %.
    ("idle gaps that collide", gate_input(decoding(4, duty=0.5)), {}, Verdict.WAIT, 0),
    (
        "idle gaps at the median",
        gate_input(decoding(4, duty=0.5)),
        {"idle_quantile": 0.5},
        Verdict.ADMIT,
        2,
    ),
    ("start-up burst: 3 granted", gate_input([], num_tickets=3), {}, Verdict.ADMIT, 1),
    ("start-up burst: 4 granted", gate_input([], num_tickets=4), {}, Verdict.WAIT, 0),
    ("fits, but others queue", gate_input([], queue_ahead=2), {}, Verdict.WAIT, 4),
    ("full queue", gate_input(decoding(4), queue_ahead=3), {"max_queue": 3}, Verdict.REFUSE, 0),
    ("no queue at all", gate_input(decoding(4)), {"max_queue": 0}, Verdict.REFUSE, 0),
    ("worker cap", gate_input(decoding(2)), {"max_workers": 2, "floor_tps": 1}, Verdict.WAIT, 0),
    ("no sequence id", gate_input(decoding(1), free=0), {}, Verdict.WAIT, 0),
    ("engine refuses", gate_input([], attach_block="KV full"), {}, Verdict.WAIT, 0),
    ("low floor, slot bound", gate_input(decoding(6)), {"floor_tps": 1}, Verdict.ADMIT, 2),
]


@pytest.mark.parametrize(
    ("inp", "cfg", "verdict", "headroom"),
    [c[1:] for c in FLOOR_CASES],
    ids=[c[0] for c in FLOOR_CASES],
)
def test_floor_policy(inp: GateInput, cfg: dict[str, Any], verdict: Verdict, headroom: int) -> None:
    d = run(inp, **cfg)
    assert d.verdict is verdict, d.reasons
    assert d.headroom == headroom
    assert d.reasons  # every decision says why
    assert (d.retry_after_s == 0.0) == (verdict is Verdict.ADMIT)
    assert d.decided_at == 42.0


OTHER_POLICIES = [
    ("legacy: slowest below floor", "legacy", [12.0, 9.0], Verdict.WAIT),
    ("legacy: all above floor", "legacy", [12.0, 11.0, 11.0, 11.0, 11.0, 11.0], Verdict.ADMIT),
    ("legacy: nothing measured", "legacy", [None] * 6, Verdict.ADMIT),
    ("static:2 with one", "static:2", [None], Verdict.ADMIT),
    ("static:2 with two", "static:2", [None, None], Verdict.WAIT),
    ("none with seven", "none", [None] * 7, Verdict.ADMIT),
    ("none with eight (slots)", "none", [None] * 8, Verdict.WAIT),
]


@pytest.mark.parametrize(
    ("policy", "tps", "verdict"),
    [c[1:] for c in OTHER_POLICIES],
    ids=[c[0] for c in OTHER_POLICIES],
)
def test_other_policies(policy: str, tps: list[float | None], verdict: Verdict) -> None:
    inp = gate_input([session(i, tps=t) for i, t in enumerate(tps)])
    d = run(inp, policy=policy)
    assert d.verdict is verdict, d.reasons
    # The projection is reported whatever the policy.
    assert d.projection.tps_next == pytest.approx(1 / (0.010 + 0.020 * (len(tps) + 1)))


def test_legacy_oversubscribes_where_floor_waits() -> None:
    inp = gate_input([session(i, tps=11.0) for i in range(6)])
    assert run(inp, policy="legacy").admitted
    assert not run(inp, policy="projection").admitted


@pytest.mark.parametrize(
    ("hold", "workers", "ahead", "max_queue", "expected"),
    [
        (10.0, 4, 0, 8, 2.5),  # one of 4 tickets frees every 2.5 s
        (10.0, 4, 3, 8, 10.0),  # four releases ahead of us
        (10.0, 4, 3, 3, 2.5),  # refused: one release opens a queue slot
        (None, 4, 1, 8, 4.0),  # nothing released yet: default 2 s per slot
        (1e6, 4, 0, 8, 300.0),  # capped at max_retry_s
    ],
)
def test_retry_after(
    hold: float | None, workers: int, ahead: int, max_queue: int, expected: float
) -> None:
    inp = gate_input(decoding(workers), queue_ahead=ahead, mean_hold_s=hold)
    d = run(inp, max_queue=max_queue)
    assert not d.admitted
    assert d.retry_after_s == pytest.approx(expected)


def test_the_longest_contexts_are_the_slowest_workers() -> None:
    # Six workers at duty 0.2: two others decode alongside one (the 90 % quantile), taken
    # to be those with the longest contexts.
    cost = StepCost(a=0.010, b=0.020, c=1e-5)
    ctxs = (1000, 5000, 2000, 1500, 900, 950)
    inp = gate_input([session(i, ctx=c, duty=0.2) for i, c in enumerate(ctxs)])
    proj = run(inp, cost=cost).projection
    assert proj.num_alongside == 2
    by_id = dict(proj.per_worker_next)
    # self + 2 others + the new worker; contexts 5000 + 2000 + 1500, new one 900 + 100
    slowest = 1 / (0.010 + 0.020 * 4 + 1e-5 * (8500 + 1000))
    assert by_id["s1"] == pytest.approx(slowest)
    assert proj.tps_next == pytest.approx(slowest)
    assert by_id["s4"] == pytest.approx(1 / (0.010 + 0.020 * 4 + 1e-5 * (900 + 8500)))


def test_count_quantile() -> None:
    assert count_quantile([], 0.9) == 0
    assert count_quantile([1.0] * 3, 0.9) == 3
    assert count_quantile([0.0] * 3, 0.9) == 0
    assert count_quantile([0.5] * 3, 0.875) == 2  # P(at most 2) = 7/8
    assert count_quantile([0.5] * 3, 0.9) == 3
    assert count_quantile([0.2] * 5, 0.9) == 2  # P(at most 2) = 0.942


def test_all_busy_workers_share_one_step_time() -> None:
    cost = StepCost(a=0.010, b=0.020, c=1e-5)
    inp = gate_input([session(0, ctx=1000), session(1, ctx=5000), session(2, ctx=2000)])
    proj = run(inp, cost=cost).projection
    tps = {round(w.tps, 9) for w in proj.per_worker_next}
    assert tps == {round(1 / (0.010 + 0.080 + 1e-5 * (8000 + 1000)), 9)}


def test_projection_reports_idle_estimate_only_when_used() -> None:
    assert run(gate_input(decoding(2, duty=0.4))).projection.idle_estimate
    assert not run(gate_input(decoding(2))).projection.idle_estimate
    assert not run(
        gate_input(decoding(2, duty=0.4)), use_idle_estimate=False
    ).projection.idle_estimate


# ---------------------------------------------------------------- properties

costs = st.builds(
    StepCost,
    a=st.floats(0.0, 0.05),
    b=st.floats(1e-4, 0.05),
    c=st.floats(0.0, 1e-5),
)
sessions = st.lists(
    st.builds(
        session,
        i=st.just(0),
        state=st.sampled_from(list(SessionState)),
        ctx=st.integers(900, 6000),
        tps=st.one_of(st.none(), st.floats(0.1, 100.0)),
        duty=st.one_of(st.none(), st.floats(0.0, 1.0)),
    ),
    max_size=10,
).map(lambda ss: [dataclasses.replace(s, id=f"s{i}") for i, s in enumerate(ss)])
floors = st.floats(0.5, 60.0)


def config_of(floor: float, policy: str = "projection",
              **kw: Any) -> tuple[GateConfig, WorkerRule | None]:
    return config_and_rule(policy, floor_tps=floor, max_queue=4, **kw)


def inp_of(ss: list[SessionLoad], extra_tickets: int = 0, max_sessions: int = 12) -> GateInput:
    load = pool(ss, max_sessions=max_sessions, free=max_sessions - len(ss))
    return GateInput(load=load, num_tickets=len(ss) + extra_tickets)


@settings(max_examples=200, deadline=None)
@given(sessions, costs, floors, st.integers(0, 3))
def test_never_admits_below_the_floor(
    ss: list[SessionLoad], cost: StepCost, floor: float, extra: int
) -> None:
    inp = inp_of(ss, extra)
    config, rule = config_of(floor)
    d = decide(inp, config, model_of(cost), 0.0, rule)
    if d.admitted and inp.num_workers == 0:
        # The one exception: nobody runs, so one worker starts whatever the projection.
        assert d.headroom == 1 or d.projection.tps_next >= floor
    elif d.admitted:
        assert d.projection.tps_next >= floor
        assert all(w.tps >= floor for w in d.projection.per_worker_next)
    else:
        assert d.retry_after_s > 0


@settings(max_examples=200, deadline=None)
@given(sessions, costs, floors, st.data())
def test_an_idle_worker_frees_capacity(
    ss: list[SessionLoad], cost: StepCost, floor: float, data: st.DataObject
) -> None:
    assume(ss)
    i = data.draw(st.integers(0, len(ss) - 1))
    old = ss[i].duty_cycle if ss[i].duty_cycle is not None else 1.0
    idler = data.draw(st.floats(0.0, old))
    quieter = [*ss[:i], dataclasses.replace(ss[i], duty_cycle=idler), *ss[i + 1 :]]
    (config, rule), model = config_of(floor), model_of(cost)
    before = decide(inp_of(ss), config, model, 0.0, rule)
    after = decide(inp_of(quieter), config, model, 0.0, rule)
    assert after.headroom >= before.headroom
    assert after.projection.tps_next >= before.projection.tps_next * (1 - 1e-12)
    assert after.admitted or not before.admitted


@settings(max_examples=200, deadline=None)
@given(sessions, costs, floors, sessions, st.integers(0, 2))
def test_more_load_never_increases_headroom(
    ss: list[SessionLoad], cost: StepCost, floor: float, more: list[SessionLoad], tickets: int
) -> None:
    grown = ss + [dataclasses.replace(s, id=f"new{i}") for i, s in enumerate(more)]
    for policy in ("floor", "projection", "legacy", "static:5", "none"):
        (config, rule), model = config_of(floor, policy=policy), model_of(cost)
        before = decide(inp_of(ss), config, model, 0.0, rule)
        after = decide(inp_of(grown, tickets), config, model, 0.0, rule)
        assert after.projection.headroom <= before.projection.headroom
        assert after.projection.tps_next <= before.projection.tps_next * (1 + 1e-12)
        if policy != "legacy":  # legacy only reads measured speeds
            assert after.headroom <= before.headroom


@settings(max_examples=100, deadline=None)
@given(sessions, costs, floors)
def test_headroom_matches_admitting_one_by_one(
    ss: list[SessionLoad], cost: StepCost, floor: float
) -> None:
    (config, rule), model = config_of(floor), model_of(cost)
    headroom = decide(inp_of(ss), config, model, 0.0, rule).headroom
    for granted in range(headroom):
        assert decide(inp_of(ss, granted), config, model, 0.0, rule).admitted
    assert not decide(inp_of(ss, headroom), config, model, 0.0, rule).admitted


def test_projection_numbers_are_finite() -> None:
    d = run(gate_input(decoding(3)), cost=StepCost(a=0.0, b=1e-12, c=0.0))
    assert math.isfinite(d.projection.tps_next)


def test_floor_above_solo_speed_still_admits_one_worker_when_none_runs() -> None:
    """A floor the hardware cannot reach even alone must not starve the queue."""
    from mesh.engine.interface import PoolLoad
    from mesh.gate.decide import Verdict, decide
    from mesh.gate.model import ThroughputModel

    empty = PoolLoad(taken_at=0.0, sessions=(), step_ms=None, agg_tps=0.0, cells_used=100,
                     cells_total=10_000, prefix_cells=100, naive_cells=0, free_seq_ids=8,
                     max_sessions=8, session_budget=512)
    cfg, rule = config_and_rule("projection", floor_tps=10_000.0, slow_start=True)
    first = decide(GateInput(load=empty), cfg, ThroughputModel(), 0.0, rule)
    assert first.verdict is Verdict.ADMIT
    assert any("none is running" in r for r in first.reasons)
    busy = decide(GateInput(load=empty, num_tickets=1), cfg, ThroughputModel(), 0.0, rule)
    assert busy.verdict is Verdict.WAIT


def test_live_scale_corrects_a_model_that_is_off() -> None:
    """Recent decode steps 2.5x faster than modelled pull the projection with them."""
    from mesh.engine.interface import PoolLoad, StepSample
    from mesh.gate.decide import decide, live_scale
    from mesh.gate.model import StepCost

    cost = StepCost(0.03, 0.02, 1e-5, 0.006)
    fast = [StepSample(num_decode=1, num_prefill_tokens=0, sum_context=1600,
                       step_s=cost.step_s(1, 1600) / 2.5) for _ in range(16)]
    assert abs(live_scale(fast, cost) - 0.4) < 1e-9
    assert live_scale(fast[:3], cost) == 1.0, "too few steps: no correction"
    # Prefill the model does not price (d = 0) costs its time: half the steps 3x slower.
    flat = StepCost(0.03, 0.02, 1e-5, 0.0)
    base = flat.step_s(1, 1600)
    mixed = [StepSample(1, 0, 1600, base), StepSample(1, 60, 1600, 3 * base)] * 8
    assert abs(live_scale(mixed, flat) - 2.0) < 1e-9
    idle = [StepSample(0, 50, 0, 9.0)] * 16
    assert live_scale(idle, cost) == 1.0, "steps with no decoding worker say nothing"
    absurd = [StepSample(1, 0, 1600, 1e-9)] * 16
    assert live_scale(absurd, cost) == 0.25, "clamped"

    session = SessionLoad(id="s1", state=SessionState.DECODING, private_cells=400,
                          context_len=1600, decode_tps=38.0, duty_cycle=1.0, age_s=5.0,
                          num_generated=100)

    def load(steps: list[StepSample]) -> PoolLoad:
        return PoolLoad(taken_at=0.0, sessions=(session,), step_ms=None, agg_tps=38.0,
                        cells_used=1600, cells_total=30_000, prefix_cells=1200,
                        naive_cells=1600, free_seq_ids=15, max_sessions=16,
                        session_budget=2048, recent_steps=tuple(steps))

    cfg, rule = config_and_rule("projection", floor_tps=12.0, slow_start=True)
    model = model_of(cost)
    stale = decide(GateInput(load=load([]), num_tickets=1), cfg, model, 0.0, rule)
    assert not stale.admitted
    # Measured with two rows decoding, the correction holds for the two rows projected.
    fast2 = [StepSample(num_decode=2, num_prefill_tokens=0, sum_context=3200,
                        step_s=cost.step_s(2, 3200) / 2.5) for _ in range(16)]
    live = decide(GateInput(load=load(fast2), num_tickets=1), cfg, model, 0.0, rule)
    assert live.admitted and live.projection.scale < 1.0
    # Measured with one row only, a faster regime is not extrapolated to two rows.
    lone = decide(GateInput(load=load(fast), num_tickets=1), cfg, model, 0.0, rule)
    assert not lone.admitted and lone.projection.scale < 1.0


@pytest.mark.parametrize(("margin", "admitted"), [(0.0, True), (0.1, False)])
def test_margin_is_spent_above_the_floor(margin: float, admitted: bool) -> None:
    """A projection 5 % above the floor admits with no margin, not with a 10 % one."""
    cost = StepCost(0.0, 0.01, 0.0, 0.0)  # 1 worker: 100 tok/s; 2 workers: 50 tok/s
    one = SessionLoad(id="s1", state=SessionState.DECODING, private_cells=10,
                      context_len=20, decode_tps=100.0, duty_cycle=1.0, age_s=5.0,
                      num_generated=10)
    load = PoolLoad(taken_at=0.0, sessions=(one,), step_ms=None, agg_tps=100.0,
                    cells_used=20, cells_total=10_000, prefix_cells=10, naive_cells=20,
                    free_seq_ids=7, max_sessions=8, session_budget=512)
    cfg, rule = config_and_rule("projection", floor_tps=50 / 1.05, slow_start=True)
    cfg = dataclasses.replace(cfg, margin=margin)
    d = decide(GateInput(load=load, num_tickets=1), cfg, model_of(cost), 0.0, rule)
    assert d.admitted is admitted


def test_young_sessions_count_as_always_decoding() -> None:
    """A duty cycle seen over a second or two is noise: it frees no capacity yet."""
    cfg, rule = config_and_rule("projection", floor_tps=5.0, slow_start=True)
    old = [session(i, S.IDLE, duty=0.1) for i in range(4)]
    young = [session(i, S.IDLE, duty=0.1, age=1.0) for i in range(4)]
    d_old = decide(GateInput(load=pool(old), num_tickets=4), cfg, model_of(), 0.0, rule)
    d_young = decide(GateInput(load=pool(young), num_tickets=4), cfg, model_of(), 0.0, rule)
    assert d_old.projection.idle_estimate and not d_young.projection.idle_estimate
    assert d_young.projection.num_effective == 4.0
    assert d_old.headroom >= d_young.headroom


def test_prefill_the_workers_bring_is_priced_per_worker() -> None:
    """Tool results prefilled alongside decoding lower every worker's projected rate."""
    from mesh.engine.interface import StepSample
    from mesh.gate.decide import prefill_ratio, project

    assert prefill_ratio([StepSample(4, 0, 4000, 0.05)] * 3) == 0.0, "too little data"
    steps = [StepSample(4, 6, 4000, 0.05)] * 8  # 6 prefill tokens per 4 decoded
    assert abs(prefill_ratio(steps) - 1.5) < 1e-9
    cost = StepCost(0.01, 0.02, 0.0, 0.004)
    cfg = GateConfig.create(policy="projection", floor_tps=5.0)
    busy = [session(i, S.DECODING, duty=1.0) for i in range(4)]
    quiet = project(GateInput(load=pool(busy), num_tickets=4), cfg, model_of(cost))
    loud_load = dataclasses.replace(pool(busy), recent_steps=tuple(
        StepSample(4, 6, 4000, cost.step_s(4, 4000, 6)) for _ in range(8)))
    loud = project(GateInput(load=loud_load, num_tickets=4), cfg, model_of(cost))
    assert loud.tps_next < quiet.tps_next


def test_slow_start_counts_short_workers_measured_by_tokens() -> None:
    """Workers too short-lived to reach slow_start_s still count once they generated."""
    cfg, rule = config_and_rule("projection", floor_tps=1.0, slow_start=True)
    young = dataclasses.replace(session(0, S.DECODING, tps=30.0, age=0.5), num_generated=20)
    fresh = dataclasses.replace(session(0, S.DECODING, tps=30.0, age=0.5), num_generated=2)
    young_in = GateInput(load=pool([young]), num_tickets=1)
    assert decide(young_in, cfg, model_of(), 0.0, rule).admitted
    blocked = decide(GateInput(load=pool([fresh]), num_tickets=1), cfg, model_of(), 0.0, rule)
    assert not blocked.admitted and any("slow start" in r for r in blocked.reasons)


def test_slow_start_ages_sessions_past_the_snapshot() -> None:
    """An idle, never-measured session (an API conversation left open) stops holding the
    gate once it is older than min_duty_age_s, even when no step refreshed the snapshot:
    the pool takes no new one while nothing decodes."""
    cfg, rule = config_and_rule("projection", floor_tps=1.0, slow_start=True)
    idle = session(0, S.IDLE, age=0.5)  # snapshot taken at t = 0
    load = pool([idle])
    early = decide(GateInput(load=load, num_tickets=1), cfg, model_of(), 0.1, rule)
    assert not early.admitted and any("slow start" in r for r in early.reasons)
    later = cfg.min_duty_age_s + 1.0
    assert decide(GateInput(load=load, num_tickets=1), cfg, model_of(), later, rule).admitted


# ---------------------------------------------------------------- the reason line


@pytest.mark.parametrize("policy", ["floor", "projection", "legacy", "static:8", "none"])
@pytest.mark.parametrize("n", [0, 3, 6])
def test_an_admit_line_never_quotes_a_projection_under_the_floor(policy: str, n: int) -> None:
    """An operator reading "admit: projected 0.83 tok/s ... (floor 5)" sees a contradiction:
    an admit line either quotes a projection at or above the floor, or says what decided."""
    d = run(gate_input(decoding(n)), policy, floor_tps=50.0)  # every projection is under it
    admit = [r for r in d.reasons if r.startswith("admit:")]
    if not d.admitted:
        assert not admit
        return
    assert len(admit) == 1, d.reasons
    line = admit[0]
    if "projected" in line:
        assert d.projection.tps_next >= 50.0, line
    if policy == "floor":  # admitted by memory: the line says who holds the floor
        assert "decode gate" in line, line
