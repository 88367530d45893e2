"""Request checks that run before the SDK sees a body (see :mod:`.guard`).

:mod:`.guard` is the ASGI middleware (:class:`RequestGuard`) and the order of its checks;
:mod:`.shapes` the A2A params shapes; :mod:`.fields` JSON parsing and field checks;
:mod:`.asgi` reading, replaying and answering bodies.
"""

from mesh.a2a.validation.fields import Invalid, check_json_depth
from mesh.a2a.validation.guard import RequestGuard
from mesh.a2a.validation.shapes import ACCEPTED_MEDIA_TYPES, JSONRPC_METHODS

__all__ = ["ACCEPTED_MEDIA_TYPES", "JSONRPC_METHODS", "Invalid", "RequestGuard",
           "check_json_depth"]
