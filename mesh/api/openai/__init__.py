"""An OpenAI-compatible API on the pool (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``): routes in :mod:`.routes`, request schema in :mod:`.schema`, the tools'
limits, grammar and parsing in :mod:`.limits`, :mod:`.grammar`, :mod:`.tools`, rendering in
:mod:`.render`, turns in :mod:`.turns`, replies in :mod:`.replies`, names in :mod:`.models`."""

from mesh.api.openai.routes import OpenAIAPI

__all__ = ["OpenAIAPI"]
