"""Request checks that run before the SDK sees a body (see :mod:`.guard`).

:mod:`.guard` is the ASGI middleware (:class:`RequestGuard`) and the order of its checks;
:mod:`.shapes` the A2A params shapes; :mod:`.fields` JSON parsing and field checks;
:mod:`.asgi` reading, replaying and answering bodies; :mod:`.checked` what a checked
message carries on to the executor (:class:`CheckedContextBuilder` puts it in the SDK's
call context).
"""

from mesh.a2a.validation.checked import (
    CheckedContextBuilder,
    CheckedMessage,
    checked_message,
)
from mesh.a2a.validation.fields import Invalid, check_json_depth
from mesh.a2a.validation.guard import RequestGuard
from mesh.a2a.validation.shapes import ACCEPTED_MEDIA_TYPES, JSONRPC_METHODS

__all__ = ["ACCEPTED_MEDIA_TYPES", "JSONRPC_METHODS", "CheckedContextBuilder",
           "CheckedMessage", "Invalid", "RequestGuard", "check_json_depth", "checked_message"]
