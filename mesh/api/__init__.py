"""HTTP routes served by the mesh process: ``/capacity``, ``/metrics`` and the session API.

The app factory mounts :func:`api_routes`; to detach the API's sessions at shutdown, build
a :class:`SessionAPI` yourself and call its ``aclose()`` from the lifespan.
"""

from __future__ import annotations

from starlette.routing import BaseRoute

from mesh.api.capacity import CapacityCollector, capacity_routes
from mesh.api.session_wire import AttachRequest, TurnRequest, error_response
from mesh.api.sessions import SessionAPI
from mesh.engine.interface import Engine
from mesh.gate.queue import Admission

__all__ = [
    "AttachRequest",
    "CapacityCollector",
    "SessionAPI",
    "TurnRequest",
    "api_routes",
    "capacity_routes",
    "error_response",
]


def api_routes(
    engine: Engine, admission: Admission, sessions: SessionAPI | None = None
) -> list[BaseRoute]:
    """Every route of this package, ready to mount in a Starlette app (pass ``sessions`` to
    keep the handle whose ``aclose`` the app's lifespan should call)."""
    api = SessionAPI(engine, admission) if sessions is None else sessions
    return [*capacity_routes(admission), *api.routes]
