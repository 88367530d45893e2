"""courier: plan parcel deliveries on a city grid."""

from courier.dispatch import Courier, Plan, dispatch
from courier.parcels import Parcel, Stop
from courier.routes import Route, plan_route

__all__ = ["Courier", "Parcel", "Plan", "Route", "Stop", "dispatch", "plan_route"]
