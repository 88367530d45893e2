"""Dispatch: give each parcel to a courier with room for it, then plan each route."""

from __future__ import annotations

from dataclasses import dataclass, field

from courier.parcels import Parcel, Point, distance, group_by_destination
from courier.routes import Route, plan_route


@dataclass(frozen=True)
class Courier:
    """A courier starting and ending at ``depot`` who can carry ``capacity_kg``."""

    name: str
    depot: Point
    capacity_kg: float


@dataclass(frozen=True)
class Plan:
    """Routes per courier name, and the parcels nobody could carry."""

    routes: dict[str, Route]
    unassigned: tuple[str, ...] = field(default_factory=tuple)


def dispatch(parcels: list[Parcel], couriers: list[Courier]) -> Plan:
    """Heaviest and most urgent parcels first, each to the closest courier with room."""
    load = {c.name: 0.0 for c in couriers}
    assigned: dict[str, list[Parcel]] = {c.name: [] for c in couriers}
    unassigned: list[str] = []
    order = sorted(parcels, key=lambda p: (-p.priority, -p.weight_kg, p.id))
    for parcel in order:
        fits = [c for c in couriers if load[c.name] + parcel.weight_kg <= c.capacity_kg]
        if not fits:
            unassigned.append(parcel.id)
            continue
        chosen = min(fits, key=lambda c: (distance(c.depot, parcel.destination), c.name))
        load[chosen.name] += parcel.weight_kg
        assigned[chosen.name].append(parcel)
    routes = {c.name: plan_route(c.depot, group_by_destination(assigned[c.name])) for c in couriers}
    return Plan(routes=routes, unassigned=tuple(sorted(unassigned)))
