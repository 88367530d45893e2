"""Tests of the sample courier project (run from its own folder: python -m pytest)."""

from __future__ import annotations

import pytest
from courier import Courier, Parcel, dispatch, plan_route
from courier.parcels import ParcelError, Stop


def test_route_visits_every_stop_once() -> None:
    stops = [Stop((3, 0), ("a",)), Stop((1, 0), ("b",)), Stop((2, 2), ("c",))]
    route = plan_route((0, 0), stops)
    assert sorted(s.parcel_ids for s in route.stops) == [("a",), ("b",), ("c",)]
    assert route.length == 10


def test_heavy_parcel_is_reported_not_dropped() -> None:
    plan = dispatch([Parcel("big", (1, 1), weight_kg=20.0)], [Courier("ana", (0, 0), 10.0)])
    assert plan.unassigned == ("big",)
    assert plan.routes["ana"].stops == ()


def test_closest_courier_with_room_wins() -> None:
    couriers = [Courier("ana", (0, 0), 5.0), Courier("ben", (9, 9), 5.0)]
    plan = dispatch([Parcel("p", (8, 8), weight_kg=2.0)], couriers)
    assert [s.parcel_ids for s in plan.routes["ben"].stops] == [("p",)]


def test_parcel_weight_is_checked() -> None:
    with pytest.raises(ParcelError):
        Parcel("p", (0, 0), weight_kg=0.0)
