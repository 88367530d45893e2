"""Engines that run sessions somewhere else: the :class:`~mesh.engine.interface.Engine` seam
over a serving cluster's OpenAI-compatible API (``mesh serve --engine openai:URL``).

The engine package stays free of HTTP; this one may use an HTTP client (httpx) and
nothing of A2A, Starlette or the layers above the engine. Importing it loads no model.
"""

from mesh.backends.openai import BackendConfig, OpenAIEngine
from mesh.backends.remote_wire import parse_engine_spec

__all__ = ["BackendConfig", "OpenAIEngine", "parse_engine_spec"]
