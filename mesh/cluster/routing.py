"""Which pool a new session goes to: prefix- and floor-aware routing, pure.

The coordinator keeps one :class:`PoolView` per pool actor, refreshed from the pool's own
load reports (:mod:`mesh.cluster.pools`); :func:`route` reads them and names a pool or
says why none can take a session. No I/O, no Ray: tested with tables of views.

The order, first rule first:

1. **alive**: a pool whose actor died is never chosen again (its sessions resume elsewhere);
2. **holds the prefix**: only a pool whose prefix hash equals the session's may take it
   (a session's suffix is only meaningful after that exact prefix; a pool building its
   prefix, or holding another project's, does not qualify);
3. **can attach**: its last report said ``check_attach`` is ok and it has attach room
   left after the sessions this coordinator holds on it and is attaching there;
4. **room at the floor**: a pool whose decode gate holds turns waiting has no room at the
   floor now; pools with none waiting come first;
5. then the fewest running turns (the step a new row joins is the cheapest), the most
   attach room, the most free cells, and the name (a stable tie-break).

A session stays on its pool: routing runs once, at attach (and again only if the pool dies).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["PoolView", "Route", "route"]


@dataclass(frozen=True)
class PoolView:
    """What the coordinator knows of one pool, from its latest report."""

    name: str
    is_alive: bool
    prefix_hash: str  # "" until the pool has built (or restored) its prefix
    can_attach: bool
    attach_reason: str  # why not, when ``can_attach`` is False
    attach_room: int  # sessions it may attach, less those held and attaching there
    waiting_turns: int  # turns its decode gate holds
    running_turns: int  # turns prefilling or decoding
    cells_free: int


@dataclass(frozen=True)
class Route:
    """The answer of :func:`route`: ``pool`` (None: no pool can take a session now) and
    ``reason`` (why that one, or why none: each pool's reason, named)."""

    pool: str | None
    reason: str


def _why_not(v: PoolView, prefix_hash: str) -> str:
    if not v.is_alive:
        return "its actor died"
    if v.prefix_hash != prefix_hash:
        held = v.prefix_hash[:12] or "no prefix yet"
        return f"holds {held}, not the session's prefix {prefix_hash[:12]}"
    if not v.can_attach:
        return v.attach_reason or "it refuses attaches"
    if v.attach_room <= 0:
        return "no attach room left"
    return ""


def route(pools: Sequence[PoolView], prefix_hash: str, exclude: Iterable[str] = ()) -> Route:
    """The pool a new session of ``prefix_hash`` should attach to (see the module
    docstring); pools named in ``exclude`` (tried and refused just now) are skipped."""
    skip = set(exclude)
    fit: list[PoolView] = []
    refusals: list[str] = []
    for v in pools:
        why = "refused this session just now" if v.name in skip else _why_not(v, prefix_hash)
        if why:
            refusals.append(f"{v.name}: {why}")
        else:
            fit.append(v)
    if not fit:
        detail = "; ".join(refusals) or "there are no pools"
        return Route(None, f"no pool can take a session ({detail})")
    best = min(fit, key=lambda v: (v.waiting_turns > 0, v.running_turns, -v.attach_room,
                                   -v.cells_free, v.name))
    floor = "room at the floor" if best.waiting_turns == 0 else "no pool has room at the floor"
    return Route(best.name, f"{best.name}: holds the prefix, {floor}, "
                            f"{best.running_turns} turns running")
