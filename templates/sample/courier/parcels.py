"""Parcels and stops: the records the planner works on."""

from __future__ import annotations

from dataclasses import dataclass

Point = tuple[int, int]

MAX_WEIGHT_KG = 30.0


class ParcelError(ValueError):
    """A parcel that cannot be delivered as described."""


@dataclass(frozen=True)
class Parcel:
    """One parcel to deliver to ``destination`` (grid coordinates)."""

    id: str
    destination: Point
    weight_kg: float = 1.0
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.id:
            raise ParcelError("a parcel needs an id")
        if not 0 < self.weight_kg <= MAX_WEIGHT_KG:
            raise ParcelError(f"parcel {self.id}: weight {self.weight_kg} kg out of range")


@dataclass(frozen=True)
class Stop:
    """A point on a route and the parcels delivered there."""

    at: Point
    parcel_ids: tuple[str, ...]


def distance(a: Point, b: Point) -> int:
    """Manhattan distance between two grid points."""
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def group_by_destination(parcels: list[Parcel]) -> list[Stop]:
    """One stop per destination, parcel ids sorted, stops in first-seen order."""
    by_point: dict[Point, list[str]] = {}
    for parcel in parcels:
        by_point.setdefault(parcel.destination, []).append(parcel.id)
    return [Stop(at, tuple(sorted(ids))) for at, ids in by_point.items()]
