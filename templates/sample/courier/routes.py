"""Route planning: nearest neighbour from the depot, improved by 2-opt."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from courier.parcels import Point, Stop, distance


@dataclass(frozen=True)
class Route:
    """An ordered tour from the depot through every stop and back."""

    depot: Point
    stops: tuple[Stop, ...]

    @property
    def length(self) -> int:
        """Total grid distance, depot to depot."""
        points = [self.depot, *(s.at for s in self.stops), self.depot]
        return sum(distance(a, b) for a, b in itertools.pairwise(points))


def nearest_neighbour(depot: Point, stops: list[Stop]) -> list[Stop]:
    """Greedy tour: always go to the closest unvisited stop (ties: first parcel id)."""
    left = sorted(stops, key=lambda s: s.parcel_ids)
    tour: list[Stop] = []
    here = depot
    while left:
        best = min(left, key=lambda s: (distance(here, s.at), s.parcel_ids))
        left.remove(best)
        tour.append(best)
        here = best.at
    return tour


def two_opt(depot: Point, tour: list[Stop], max_rounds: int = 20) -> list[Stop]:
    """Reverse segments while that shortens the tour (at most ``max_rounds`` passes)."""
    best = list(tour)
    for _ in range(max_rounds):
        improved = False
        for i in range(len(best) - 1):
            for j in range(i + 2, len(best) + 1):
                candidate = best[:i] + best[i:j][::-1] + best[j:]
                if Route(depot, tuple(candidate)).length < Route(depot, tuple(best)).length:
                    best = candidate
                    improved = True
        if not improved:
            break
    return best


def plan_route(depot: Point, stops: list[Stop]) -> Route:
    """The planner's route for ``stops``: nearest neighbour, then 2-opt."""
    return Route(depot, tuple(two_opt(depot, nearest_neighbour(depot, stops))))
