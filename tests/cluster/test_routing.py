"""Prefix- and floor-aware routing (mesh.cluster.pools): pure, a table of pool views."""

from __future__ import annotations

import pytest

from mesh.cluster.pools import PoolView, route

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
