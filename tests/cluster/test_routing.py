"""Prefix- and floor-aware routing (mesh.cluster.pools): pure, a table of pool views."""

from __future__ import annotations

import pytest

from mesh.cluster.pool_actor import PoolReport
from mesh.cluster.pools import PoolHandle, PoolView, RayPools, route
from mesh.engine.interface import AttachCheck, PoolLoad, SessionLoad, SessionState

H = "a" * 64  # the session's prefix hash


def view(name: str, **kw: object) -> PoolView:
    base: dict[str, object] = dict(name=name, is_alive=True, prefix_hash=H, can_attach=True,
                                   attach_reason="", attach_room=4, waiting_turns=0,
                                   running_turns=0, cells_free=1000)
    base.update(kw)
    return PoolView(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("pools", "want"), [
    # the pool holding the prefix wins over an emptier one holding another
    ([view("a", prefix_hash="b" * 64, running_turns=0), view("b", running_turns=3)], "b"),
    # room at the floor (no turn held by its decode gate) before fewer running turns
    ([view("a", waiting_turns=2, running_turns=0), view("b", running_turns=5)], "b"),
    # then the fewest running turns
    ([view("a", running_turns=2), view("b", running_turns=1)], "b"),
    # then the most attach room, then the most free cells, then the name
    ([view("a", attach_room=1), view("b", attach_room=3)], "b"),
    ([view("a", cells_free=10), view("b", cells_free=20)], "b"),
    ([view("b"), view("a")], "a"),
    # a dead pool, a full one and one that refuses are never chosen
    ([view("a", is_alive=False), view("b", running_turns=9)], "b"),
    ([view("a", attach_room=0), view("b", running_turns=9)], "b"),
    ([view("a", can_attach=False, attach_reason="no free cells"), view("b", waiting_turns=1)],
     "b"),
    # every pool held at the floor: the least loaded still takes it (the gate queues turns)
    ([view("a", waiting_turns=3), view("b", waiting_turns=1, running_turns=1)], "a"),
])
def test_route_picks(pools: list[PoolView], want: str) -> None:
    assert route(pools, H).pool == want


def test_route_none_names_every_pool() -> None:
    r = route([view("a", is_alive=False), view("b", prefix_hash=""),
               view("c", can_attach=False, attach_reason="no free sequence id"),
               view("d")], H, exclude=["d"])
    assert r.pool is None
    assert "a: its actor died" in r.reason
    assert "b: holds no prefix yet" in r.reason
    assert "c: no free sequence id" in r.reason
    assert "d: refused this session just now" in r.reason
    assert route([], H).reason == "no pool can take a session (there are no pools)"


def test_turn_place_reads_the_pools_latest_reports() -> None:
    """RayPools.turn_place: each held turn's place as its pool's report says (its own
    line), cached with the merged load and read again once a new report arrives; no Ray
    call is made."""
    pools = RayPools(lambda: None, num_pools=1, tokenize=lambda text: [])  # type: ignore[arg-type, return-value]
    h = PoolHandle(name="p0", actor=None)
    pools.pools.append(h)

    def report(places: dict[str, int | None]) -> PoolReport:
        rows = tuple(SessionLoad(id=sid, state=SessionState.WAITING if place else
                                 SessionState.DECODING, private_cells=1, context_len=1,
                                 decode_tps=None, duty_cycle=None, age_s=0.0, num_generated=0,
                                 turn_place=place) for sid, place in places.items())
        load = PoolLoad(taken_at=0.0, sessions=rows, step_ms=None, agg_tps=0.0, cells_used=1,
                        cells_total=8, prefix_cells=0, naive_cells=1, free_seq_ids=1,
                        max_sessions=4, session_budget=8)
        return PoolReport(load=load, check=AttachCheck(True), new_steps=())

    assert pools.turn_place("p0/s1") is None  # no report yet
    pools.take_report(h, report({"s1": None, "s2": 1, "s3": 2}))
    assert [pools.turn_place(f"p0/s{i}") for i in (1, 2, 3)] == [None, 1, 2]
    pools.take_report(h, report({"s1": None, "s2": None, "s3": 1}))
    assert [pools.turn_place(f"p0/s{i}") for i in (1, 2, 3)] == [None, None, 1]
